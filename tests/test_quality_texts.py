"""The quality harness's third text (`--doc-text python-docs`): Python's
reference documentation, read from the interpreter's installed
`pydoc_data/topics.py`, never from the repo, scored as its own report."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from scripts.quality import harness as hq
from scripts.quality import texts
from tests.support.quality_inputs import TEXT_FILE

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bundle(smollm2_bundle):
    return smollm2_bundle


def test_doc_text_is_pydocs_topics_read_where_python_installs_them(bundle):
    from pydoc_data import topics

    source = texts.python_docs()
    (path,) = source.paths
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert path.resolve().is_relative_to(stdlib)
    assert not path.resolve().is_relative_to(REPO_ROOT)
    text = source.read()
    # Every topic, whole and in the module's order, and no Python syntax.
    assert text == texts.FILE_SEPARATOR.join(topics.topics.values())
    assert "topics = {" not in text and "The \"assert\" statement" in text
    ids, info = hq.tokenize_text(bundle.tokenizer, source)
    assert info["kind"] == "documentation" and info["name"] == "python-docs"
    assert info["tokens"] == len(ids) >= 32 * (1024 + 512 + 1)


def test_doc_text_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="topics.py"):
        texts.python_docs(root=tmp_path).read()


def test_cli_scores_the_doc_text_as_a_third_report(bundle, tmp_path):
    from scripts.quality import __main__ as quality

    argv = [
        "--text-file", str(TEXT_FILE), "--code-text", "none",
        "--doc-text", "python-docs", "--arms", "exact,bf16,int8",
        "--windows", "1", "--prefix-len", "64", "--score-len", "32",
        "--greedy-tokens", "0", "--out-dir", str(tmp_path), "--name", "ci",
    ]  # fmt: skip
    assert quality.main(argv, bundle=bundle) == 0
    prose = json.loads((tmp_path / "ci.json").read_text())
    docs = json.loads((tmp_path / "ci_docs.json").read_text())
    assert docs["text"]["name"] == "python-docs"
    assert docs["text"]["sha256"] != prose["text"]["sha256"]
    assert docs["arms"]["int8"]["restored_tokens"] == 64
    assert not (tmp_path / "ci_code.json").exists()
    summary = (tmp_path / "ci_summary.md").read_text()
    assert "python-docs (documentation" in summary
