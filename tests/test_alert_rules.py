"""The HiCache alerting rules (docs/prometheus/hicache_rules.yml): `promtool
check rules` and `promtool test rules` (tests/prometheus/hicache_rules_test.yml)
pass; promtool comes from Debian's `prometheus` (skip without it, fail in CI).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "docs" / "prometheus" / "hicache_rules.yml"
RULE_TESTS = ROOT / "tests" / "prometheus" / "hicache_rules_test.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if found:
        return found
    reason = "promtool not found (apt-get install prometheus)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must run the alert rule tests")
    pytest.skip(reason)


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rules_pass_promtool_check(promtool):
    proc = run(promtool, "check", "rules", str(RULES), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 4 rules found" in proc.stdout + proc.stderr


def test_rules_pass_their_unit_tests(promtool):
    # rule_files in the test file are relative to it.
    proc = run(promtool, "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def undefined_metrics(text: str) -> set[str]:
    """sglang: metric names in `text` that the patched collector does not define."""
    spec = importlib.util.find_spec("sglang.srt.observability.metrics_collector")
    defined = set(re.findall(r'name="(sglang:\w+)"', Path(spec.origin).read_text()))
    used = set(re.findall(r"sglang:\w+", text))
    assert used, "no sglang: metric named"
    # Counters are defined without the _total suffix prometheus_client adds,
    # histograms without _sum/_count/_bucket.
    suffixes = ("_total", "_sum", "_count", "_bucket")
    return {
        name
        for name in used
        if not {name, *(name.removesuffix(s) for s in suffixes)} & defined
    }


def test_rules_use_metrics_the_collector_exports():
    missing = undefined_metrics(RULES.read_text())
    assert not missing, f"rules read metrics the collector does not define: {missing}"


def test_operations_doc_names_exported_metrics():
    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc[doc.index("\n## Metrics\n") :]
    section = section[: section.index("\n## ", 1)]
    missing = undefined_metrics(section.replace("{used,total}", "used"))
    assert not missing, (
        f"docs/operations.md names metrics the collector does not define: {missing}"
    )
