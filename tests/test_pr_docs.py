"""What `make pr` exports is described: docs/development.md names every PR,
and each PR's description (docs/PR_DESCRIPTION.md blocks) and upstream docs
cover the modules and formats it ships (the real export: test_pr_gate.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from scripts import overlay
from tests.test_docs_formats import _backticked

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "docs" / "PR_DESCRIPTION.md"
# The sections a PR fills with its own blocks (the checklist is shared).
OWN_SECTIONS = (
    "Motivation",
    "Modifications",
    "Accuracy Tests",
    "Speed Tests and Profiling",
)
DECLARED = overlay.read_pr_declaration()
VALUES = dict.fromkeys(overlay.PR_PLACEHOLDER.findall(SOURCE.read_text()), "")


def _render(pr) -> str:
    return overlay.render_description(pr, VALUES, SOURCE)


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _shipped_formats(hf) -> list[list[str]]:
    """Per PR, the registered formats whose codec module PRs 1..n add, in
    registry order (a format ships with its codec)."""
    files: set[str] = set()
    out = []
    for pr in DECLARED:
        files |= {p.as_posix() for p in pr.overlay}
        out.append(
            [
                name
                for name, entry in hf.HOST_DTYPES.items()
                if "python/" + entry.mha_format.split(":")[0].replace(".", "/") + ".py"
                in files
            ]
        )
    return out


@pytest.fixture(scope="module")
def hf():
    from scripts import docs_formats

    return docs_formats.registry()


def test_development_md_names_every_exported_pr():
    text = " ".join((REPO / "docs" / "development.md").read_text().split())
    for pr in DECLARED:
        assert f"{pr.number} `{pr.name}`" in text, pr.name


def test_pr_blocks_name_declared_prs():
    names = {pr.name for pr in DECLARED}
    for block in overlay.PR_BLOCK.findall(SOURCE.read_text()):
        unknown = {n.strip() for n in block[0].split(",")} - names
        assert not unknown, f"docs/PR_DESCRIPTION.md has blocks for no PR: {unknown}"


def test_every_pr_describes_itself_in_each_section():
    shared = _render(dataclasses.replace(DECLARED[0], name="-"))
    for pr in DECLARED:
        text = _render(pr)
        for heading in OWN_SECTIONS:
            assert _section(text, heading) != _section(shared, heading), (
                f"PR {pr.dir_name}: docs/PR_DESCRIPTION.md has no "
                f"`<!-- pr: {pr.name} -->` block under ## {heading}"
            )


def test_every_pr_names_each_module_it_adds():
    for pr in DECLARED:
        mods = _section(_render(pr), "Modifications")
        for rel in pr.overlay:
            if rel.parts[0] in ("test", "docs"):
                continue
            assert re.search(rf"\b{re.escape(rel.name)}\b", mods), (
                f"PR {pr.dir_name} adds {rel}; its Modifications in "
                f"docs/PR_DESCRIPTION.md never name {rel.name}"
            )


def test_pr_descriptions_and_upstream_docs_cover_the_formats_they_ship(hf):
    shipped = _shipped_formats(hf)
    before: list[str] = []
    pages = ""
    for pr, formats in zip(DECLARED, shipped):
        text = _render(pr)
        own_pages = "".join(
            (REPO / "sglang_overlay" / rel).read_text()
            for rel in pr.overlay
            if rel.parts[0] == "docs"
        )
        pages += own_pages
        allowed = {"auto", *formats}
        for where, body in (("description", text), ("upstream docs", own_pages)):
            later = sorted(set(_backticked(body)) - allowed)
            assert not later, (
                f"PR {pr.dir_name}'s {where} names {later}, which no PR up to it ships"
            )
        for listed in re.findall(r"--hicache-host-dtype \{([^}]*)\}", text):
            assert listed.split(",") == ["auto", *formats], (
                f"PR {pr.dir_name}: --hicache-host-dtype {{{listed}}}; it ships "
                f"{{{','.join(['auto', *formats])}}}"
            )
        for name in (n for n in formats if n not in before):
            assert f"`{name}`" in text, (
                f"PR {pr.dir_name} ships `{name}`; its description never names it"
            )
            assert f"`{name}`" in pages, (
                f"PR {pr.dir_name} ships `{name}`; no upstream doc page up to it "
                "(sglang_overlay/docs/) describes it"
            )
        before = formats
