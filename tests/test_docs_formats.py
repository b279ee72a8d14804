"""Every host-format list in the docs is the registry's (pool_host/host_format.py):
the generated table of docs/supported.md, the README's format table, flag
synopses, the MLA and FP8 rows, and no format name the registry lacks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts import docs_formats
from scripts.quality.harness import SINK_ARMS

REPO = Path(__file__).resolve().parents[1]
# The project's docs; docs/PR_DESCRIPTION.md is checked per PR (test_pr_docs.py).
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


def test_supported_md_table_is_generated_from_the_registry(hf):
    text = docs_formats.DOC.read_text()
    assert docs_formats.current_block(text) == docs_formats.render(hf), (
        "docs/supported.md's host-format table is stale: run "
        "`.venv/bin/python scripts/docs_formats.py --write`"
    )
    names = re.findall(r"^\| `([a-z0-9]+)`", docs_formats.render(hf), re.M)
    assert names == hf.host_dtype_choices()


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


def test_flag_synopses_and_values_are_registered(hf):
    choices = hf.host_dtype_choices()
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


def test_docs_name_no_format_the_registry_lacks(hf):
    known = set(hf.host_dtype_choices()) | DTYPE_WORDS | set(SINK_ARMS)
    for doc in DOCS:
        text = doc.read_text()
        # Plain words too; one followed by "-" is a storage tag, not a format.
        plain = re.findall(r"\b((?:int|k)\d[a-z0-9]*)\b(?!-)", text)
        unknown = sorted(set(_backticked(text) + plain) - known)
        assert not unknown, (
            f"{doc.name} names formats the registry does not have: {unknown} "
            "(register them in pool_host/host_format.py, or drop them)"
        )


def _cell(doc: str, row_start: str, column: int) -> str:
    for line in (REPO / "docs" / doc).read_text().splitlines():
        if line.startswith(row_start):
            return line.split(" | ")[column]
    raise AssertionError(f"docs/{doc} has no row starting {row_start!r}")


def test_supported_md_mla_and_fp8_rows_are_the_registrys(hf):
    mla = [n for n, e in hf.HOST_DTYPES.items() if e.mla_format is not None]
    assert _backticked(_cell("supported.md", "| MLA (", 1)) == mla
    assert _backticked(_cell("supported.md", "| `fp8_e4m3`", 1)) == (
        hf.fp8_host_dtypes()
    )
