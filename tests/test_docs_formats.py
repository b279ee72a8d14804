"""Every host-format list in the docs is the registry's (pool_host/host_format.py),
and what `make pr` exports is described: docs/development.md names every PR, each
PR's description and upstream docs cover the modules and formats it ships."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from scripts import docs_formats, overlay
from scripts.quality.harness import SINK_ARMS

REPO = Path(__file__).resolve().parents[1]
# The project's docs; docs/PR_DESCRIPTION.md is checked per PR (below).
DOCS = [REPO / "README.md"] + sorted(
    p for p in (REPO / "docs").glob("*.md") if p.name != "PR_DESCRIPTION.md"
)
# Not formats: dtypes the docs name beside them.
DTYPE_WORDS = {"int8", "int32", "int64", "uint8", "int16"}
SYNOPSIS = re.compile(r"--hicache-host-dtype \{([^}]*)\}")
FLAG_VALUE = re.compile(r"(?:--hicache-host-dtype[ =]|HOST_DTYPE=)([a-z][a-z0-9_]*)")


@pytest.fixture(scope="module")
def hf():
    return docs_formats.registry()


def _backticked(text: str) -> list[str]:
    """Backticked words shaped like a format value: int8, int4r, k8v4, ..."""
    return [
        w
        for w in re.findall(r"`([^`\s]+)`", text)
        if re.fullmatch(r"(?:int|k)\d[a-z0-9]*", w)
    ]


def test_supported_md_format_table_mla_and_fp8_rows_are_the_registrys(hf):
    text = docs_formats.DOC.read_text()
    assert docs_formats.current_block(text) == docs_formats.render(hf), (
        "docs/supported.md's host-format table is stale: run "
        "`.venv/bin/python scripts/docs_formats.py --write`"
    )
    names = re.findall(r"^\| `([a-z0-9]+)`", docs_formats.render(hf), re.M)
    assert names == hf.host_dtype_choices()
    mla = [n for n, e in hf.HOST_DTYPES.items() if e.mla_format is not None]
    for start, formats in (("| MLA (", mla), ("| `fp8_e4m3`", hf.fp8_host_dtypes())):
        row = next(line for line in text.splitlines() if line.startswith(start))
        assert _backticked(row.split(" | ")[1]) == formats, start


def test_readme_format_table_has_one_row_per_registered_format(hf):
    readme = (REPO / "README.md").read_text()
    start = readme.index("## Host formats")
    section = readme[start : readme.index("\n## ", start + 1)]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|", section, re.M)
    # Its order is the README's advice (the 8-bit pick first); the set is the registry's.
    assert sorted(rows) == sorted(hf.host_dtype_choices()) and rows[0] == "auto", (
        "README's host-format table must list `auto` first and every registered "
        f"format once: {hf.host_dtype_choices()}, got {rows}"
    )


def test_flag_synopses_values_and_format_names_are_registered(hf):
    choices = hf.host_dtype_choices()
    known = set(choices) | DTYPE_WORDS | set(SINK_ARMS)
    for doc in DOCS:
        text = doc.read_text()
        for listed in SYNOPSIS.findall(text):
            assert [v.strip() for v in listed.split(",")] == choices, (
                f"{doc.name}: --hicache-host-dtype {{{listed}}} is not the "
                f"registry's {{{','.join(choices)}}}"
            )
        for value in FLAG_VALUE.findall(text):
            assert value in choices, (
                f"{doc.name}: --hicache-host-dtype {value} is not registered"
            )
        # Plain words too; one followed by "-" is a storage tag, not a format.
        plain = re.findall(r"\b((?:int|k)\d[a-z0-9]*)\b(?!-)", text)
        unknown = sorted(set(_backticked(text) + plain) - known)
        assert not unknown, (
            f"{doc.name} names formats the registry does not have: {unknown} "
            "(register them in pool_host/host_format.py, or drop them)"
        )


# --- the PR descriptions (docs/PR_DESCRIPTION.md blocks) ----------------------
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


def test_development_md_names_every_pr_and_blocks_name_only_declared_ones():
    text = " ".join((REPO / "docs" / "development.md").read_text().split())
    for pr in DECLARED:
        assert f"{pr.number} `{pr.name}`" in text, pr.name
    names = {pr.name for pr in DECLARED}
    for block in overlay.PR_BLOCK.findall(SOURCE.read_text()):
        unknown = {n.strip() for n in block[0].split(",")} - names
        assert not unknown, f"docs/PR_DESCRIPTION.md has blocks for no PR: {unknown}"


def test_every_pr_describes_itself_and_names_each_module_it_adds():
    shared = _render(dataclasses.replace(DECLARED[0], name="-"))
    for pr in DECLARED:
        text = _render(pr)
        for heading in OWN_SECTIONS:
            assert _section(text, heading) != _section(shared, heading), (
                f"PR {pr.dir_name}: docs/PR_DESCRIPTION.md has no "
                f"`<!-- pr: {pr.name} -->` block under ## {heading}"
            )
        mods = _section(text, "Modifications")
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
