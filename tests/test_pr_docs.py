"""`make pr` on the real series: every existing upstream file a PR edits has
its reason in docs/prs.toml (else the export warns and the PR description says
"not justified"), and docs/development.md names every PR it exports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRS = tomllib.loads((REPO / "docs" / "prs.toml").read_text())["pr"]


def test_real_export_justifies_every_upstream_edit(tmp_path):
    project = tmp_path / "project"
    for name in ("scripts", "patches", "sglang_overlay", "docs", "requirements"):
        shutil.copytree(
            REPO / name, project / name, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy2(REPO / "sglang.lock", project / "sglang.lock")
    (project / "build").mkdir()
    (project / "build" / "sglang").symlink_to(REPO / "build" / "sglang")
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "Export Test",
        "GIT_AUTHOR_EMAIL": "export@localhost",
        "GIT_COMMITTER_NAME": "Export Test",
        "GIT_COMMITTER_EMAIL": "export@localhost",
        "HIQ_WHEEL_CACHE": os.environ.get(
            "HIQ_WHEEL_CACHE", str(REPO / "build" / "wheels")
        ),
    }
    env.pop("PYTHONPATH", None)
    export = subprocess.run(
        [sys.executable, "scripts/overlay.py", "pr"],
        cwd=project, capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert export.returncode == 0, export.stdout + export.stderr
    assert f"exported {len(PRS)} PRs" in export.stdout
    assert "warning" not in export.stdout + export.stderr, export.stdout


def test_development_md_names_every_exported_pr():
    text = " ".join((REPO / "docs" / "development.md").read_text().split())
    for pr in PRS:
        assert f"{pr['number']} `{pr['name']}`" in text, pr["name"]
