"""The texts `make quality` scores, read in place (docs/results.md): WikiText-2,
stdlib source code and pydoc's topics."""

from __future__ import annotations

import ast
import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from scripts.overlay import sha256_of

# Large, pure-Python modules (about 300k tokens in all with SmolLM2's
# tokenizer): room for 32 windows of 1,537 tokens with most inside one file.
STDLIB_FILES = (
    "argparse.py",
    "ast.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "functools.py",
    "inspect.py",
    "logging/__init__.py",
    "shutil.py",
    "subprocess.py",
    "tarfile.py",
    "typing.py",
)
# Between two files, so no token spans the end of one and the start of the next.
FILE_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class TextSource:
    name: str
    kind: str  # "prose", "source code"
    paths: tuple[Path, ...]

    def read(self) -> str:
        missing = [str(p) for p in self.paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{self.name}: missing {', '.join(missing)}")
        return FILE_SEPARATOR.join(self.parts())

    def parts(self) -> list[str]:
        return [p.read_text(encoding="utf-8") for p in self.paths]

    def describe(self) -> dict:
        """Where the text came from, for the report (paths and checksums)."""
        files = [{"path": str(p), "sha256": sha256_of(p)} for p in self.paths]
        whole = hashlib.sha256("".join(f["sha256"] for f in files).encode())
        info = {"name": self.name, "kind": self.kind, "sha256": whole.hexdigest()}
        if len(files) == 1:
            info["path"] = files[0]["path"]
        else:
            info["path"] = str(Path(files[0]["path"]).parent)
            info["files"] = files
            info["python"] = platform.python_version()
        return info


def wikitext(path: str | Path) -> TextSource:
    return TextSource("wikitext-2", "prose", (Path(path),))


def python_stdlib(
    files: tuple[str, ...] = STDLIB_FILES, root: str | Path | None = None
) -> TextSource:
    """Source code of the Python standard library, read where it is installed."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    return TextSource("python-stdlib", "source code", tuple(base / f for f in files))


class PythonDocs(TextSource):
    """The topic texts of `pydoc_data/topics.py`, in the module's order."""

    def parts(self) -> list[str]:
        tree = ast.parse(self.paths[0].read_text(encoding="utf-8"))
        topics = next(
            ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign)
            and getattr(node.targets[0], "id", None) == "topics"
        )
        return list(topics.values())


def python_docs(root: str | Path | None = None) -> TextSource:
    """Python's reference documentation, read where the interpreter installs it."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    return PythonDocs("python-docs", "documentation", (base / "pydoc_data/topics.py",))


CODE_TEXTS = {"python-stdlib": python_stdlib}
DOC_TEXTS = {"python-docs": python_docs}
