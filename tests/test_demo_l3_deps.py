"""`make demo-l3` checks the Mooncake store's native libraries before it
imports SGLang and fails in one line naming the packages and the command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from scripts.demo import l3

REPO = Path(__file__).resolve().parents[1]

# A fresh interpreter: one library made unloadable, and setup() (SGLang's
# import) replaced by an exit that says it was reached.
PROBE = """
import json, sys
from scripts.demo import l3
l3.NATIVE_LIBS["libhiq-absent.so.1"] = "librdmacm1"
l3.setup = lambda: sys.exit("setup reached: SGLang would be imported first")
try:
    l3.main(["--out", sys.argv[1]])
except SystemExit as e:
    print(json.dumps({"exit": str(e.code), "loaded": sorted(
        m for m in ("sglang", "torch", "mooncake") if m in sys.modules)}))
"""


def test_missing_library_fails_in_one_line_before_sglang(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["exit"] == (
        "demo-l3: Mooncake needs the Debian packages librdmacm1; install them "
        "with: sudo bash scripts/debian_deps.sh install"
    )
    assert result["loaded"] == []
    assert not list(tmp_path.iterdir())


def test_missing_native_packages_tries_each_library():
    libs = {"libc.so.6": "libc6", "libhiq-absent.so.1": "hiq-absent"}
    assert l3.missing_native_packages(libs) == ["hiq-absent"]


def test_native_libs_are_the_ones_debian_deps_installs():
    script = (REPO / "scripts" / "debian_deps.sh").read_text()
    pairs = re.search(r"for lib in ([^;]+);", script)
    assert pairs, "scripts/debian_deps.sh: no `for lib in pkg:soname ...` loop"
    listed = dict(p.split(":")[::-1] for p in pairs[1].split())
    assert l3.NATIVE_LIBS == listed
