"""The docs' relative links resolve; every recorded run under results/runs/ is listed
in results/README.md with its command and commit, and quoted by a doc."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "results" / "runs"
PAGES = [REPO / "README.md", REPO / "results" / "README.md"]
PAGES += sorted((REPO / "docs").glob("*.md")) + sorted(RUNS.glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _targets(page: Path) -> list[Path]:
    out = []
    for href in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", href) or href.startswith("#"):
            continue
        out.append((page.parent / href.split("#")[0]).resolve())
    return out


def test_relative_links_resolve():
    broken = [
        f"{page.relative_to(REPO)} -> {target.relative_to(REPO)}"
        for page in PAGES
        for target in _targets(page)
        if not target.exists()
    ]
    assert not broken, broken


def test_every_run_has_its_command_commit_and_a_doc_quoting_it():
    runs = sorted(RUNS.glob("*.md"))
    assert runs, "results/runs/ holds no recorded run"
    index = set(_targets(REPO / "results" / "README.md"))
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    quoted = {t for page in docs for t in _targets(page)}
    for run in runs:
        text = run.read_text()
        name = run.relative_to(REPO)
        assert re.match(r"\d{4}-\d{2}-\d{2}-", run.name), f"{name}: name it by date"
        assert re.search(r"Commit that recorded it: [0-9a-f]{7,}", text), name
        assert "```bash\n" in text, f"{name} states no command"
        assert run.resolve() in index, f"{name} is not listed in results/README.md"
        assert run.resolve() in quoted, f"no doc links {name}"
