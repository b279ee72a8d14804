"""Building the stock host pools (--hicache-host-dtype auto) imports no codec,
kernel or encoded-pool module of ours: checked in a fresh interpreter, after
importing every upstream module the series edits to dispatch host pools. And
the tools in scripts/ import nothing from tests/ (their rigs are scripts/rigs)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from scripts.rigs.standins import run_fresh

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
from sglang.srt.mem_cache import hicache_auto_size
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost, get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost, get_mla_host_pool_cls
from scripts.rigs import hicache_harness as hh
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
built = []
for geo in (hh.Geometry(), hh.MLAGeometry(layer_num=2)):
    device_pool = hh.make_device_pool(geo, 64)
    with host_memory_budget_scope(1 << 40):  # a few kB; other processes' use aside
        pool = hh.make_host_pool(device_pool, host_tokens=128, host_dtype="auto")
    built.append(type(pool).__name__)
info = hh.make_device_pool(hh.Geometry(), 16).get_device_pool_infos()[0].buffer_info
assert get_mha_host_pool_cls(info, "auto") is MHATokenToKVPoolHost
print(json.dumps({"built": built, "modules": sorted(sys.modules)}))
"""
OURS = (
    "sglang.kernels.ops.kvcache.kv_",
    "sglang.kernels.ops.kvcache.host_kv_common",
    "sglang.srt.mem_cache.pool_host.kv_",
    "sglang.srt.mem_cache.pool_host.encoded",
    "sglang.srt.mem_cache.pool_host.mha_encoded",
    "sglang.srt.mem_cache.pool_host.mla_encoded",
)


def test_stock_pools_import_none_of_our_codecs_or_kernels():
    probe = run_fresh(PROBE)
    assert probe["built"] == ["MHATokenToKVPoolHost", "MLATokenToKVPoolHost"]
    loaded = [m for m in probe["modules"] if m.startswith(OURS)]
    assert loaded == []
    # The registry itself is what the dispatch reads.
    assert "sglang.srt.mem_cache.pool_host.host_format" in probe["modules"]


def _imports_of_tests(path: Path) -> list[str]:
    """Where a scripts/ file imports tests.*: import statements, code it runs
    in another interpreter (python -c text) and modules it runs with -m."""
    text = path.read_text()
    if path.suffix == ".sh":
        lines = enumerate(text.splitlines(), 1)
        found = r"\b(?:from|import)\s+tests\b"
        return [f"{path}:{i}" for i, line in lines if re.search(found, line)]
    hits = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            code = re.search(r"(?m)^\s*(?:from|import)\s+(tests\b[\w.]*)", node.value)
            module = re.fullmatch(r"tests(\.\w+)+", node.value)
            names = [code.group(1)] if code else [node.value] if module else []
        else:
            continue
        hits += [
            f"{path}:{node.lineno} {n}" for n in names if n.split(".")[0] == "tests"
        ]
    return hits


def test_scripts_import_nothing_from_tests():
    files = sorted(REPO.glob("scripts/**/*.py")) + sorted(REPO.glob("scripts/**/*.sh"))
    assert len(files) > 20
    hits = [hit for path in files for hit in _imports_of_tests(path)]
    assert not hits, (
        "scripts/ must not import tests.* (use scripts/rigs):\n" + "\n".join(hits)
    )
