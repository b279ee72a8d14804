"""An INT8 server from each way a user installs the product into a fresh venv
with the stock wheel: make wheel's wheel, or overlay.py install --target (and
uninstall). Opt-in, HIQ_LIVE_INSTALL=1, 3-6 min each."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from scripts.rigs.model import smollm2_dir, stdlib_prompts
from scripts.rigs.server import (
    CPU_FLAGS,
    LiveServer,
    cpu_env,
    fresh_dir,
    hicache_flags,
    to_stderr,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("HIQ_LIVE_INSTALL") != "1", reason="HIQ_LIVE_INSTALL=1"
)

REPO = Path(__file__).resolve().parents[1]


def run(*argv, **kwargs) -> str:
    # Without the test's PYTHONPATH (build/sglang): the venvs see their own.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    kwargs.setdefault("env", env)
    proc = subprocess.run(
        [str(a) for a in argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        **kwargs,
    )
    assert proc.returncode == 0, f"{argv}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc.stdout


def pip(venv_python: Path, *args) -> str:
    # The test venv's pip installs into the fresh venv (--python).
    return run(
        sys.executable, "-m", "pip", "--python", venv_python, "install",
        "--quiet", "--disable-pip-version-check", "--no-deps", *args,
    )  # fmt: skip


def stock_wheel() -> Path:
    return Path(run(sys.executable, "scripts/overlay.py", "fetch").strip())


def fresh_stock_venv(root: Path) -> tuple[Path, Path]:
    venv = root / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(
        run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        ).strip()
    )
    pip(python, stock_wheel())
    return python, site


def borrow_test_venv(site: Path) -> None:
    """Torch & co. from the test venv after the venv's own (once pip is done:
    pip would take the test venv's stock sglang for the venv's own)."""
    (site / "zz_hiq_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")


def serve_int8(python: Path, site: Path, name: str) -> dict:
    # The server's own environment: cpu_site on PYTHONPATH, no build/sglang.
    where = run(
        python, "-c", "import sglang; print(sglang.__file__)", env=cpu_env(None)
    ).strip()
    assert Path(where).is_relative_to(site), where
    model = smollm2_dir()
    prompts = stdlib_prompts(model, 3, 1400)
    server = LiveServer(
        [*CPU_FLAGS, *hicache_flags("int8", layout=None, io_backend=None)],
        name=name,
        model=model,
        python=str(python),
        sglang_path=None,
        progress=to_stderr,
    )
    with server:
        first = server.generate(input_ids=prompts[0], max_new_tokens=4)
        for p in prompts[1:]:
            server.generate(input_ids=p, max_new_tokens=1)
        reuse = server.generate(input_ids=prompts[0], max_new_tokens=4)
        info = server.metrics().samples("sglang:hicache_host_info")[0][0]
        log = server.log_text()
    assert info["host_dtype"] == "int8"
    assert "HiCache kv host format: int8" in log
    assert (reuse["meta_info"].get("cached_tokens_details") or {}).get("host", 0) > 0
    assert reuse["output_ids"] == first["output_ids"]
    return info


def test_wheel_over_stock_install_serves_int8():
    run("make", "wheel", f"WHEEL_TAGS={sys.version_info[0]}{sys.version_info[1]}")
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    wheels = sorted((REPO / "dist").glob(f"sglang-0.5.23+hiq.*-{tag}-*.whl"))
    assert wheels, "make wheel built no wheel for this Python"
    python, site = fresh_stock_venv(fresh_dir("install-wheel"))
    pip(python, wheels[-1])
    borrow_test_venv(site)
    version = run(
        python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"
    )
    assert "+hiq." in version
    serve_int8(python, site, "install-wheel-int8")


def package_state(site: Path) -> dict[str, str | None]:
    """Path -> sha256 under site/sglang (bytecode and folders: None)."""
    return {
        p.relative_to(site).as_posix(): (
            hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() and p.suffix != ".pyc"
            else None
        )
        for p in (site / "sglang").rglob("*")
    }


def test_overlay_install_in_place_serves_int8():
    python, site = fresh_stock_venv(fresh_dir("install-overlay"))
    stock = package_state(site)
    overlay = (sys.executable, "scripts/overlay.py")
    run(*overlay, "install", "--target", site)
    # pip's reinstall writes the stock files back and leaves the overlay files
    # and the marker: install must see that and patch again.
    pip(python, "--force-reinstall", stock_wheel())
    assert "already carries" not in run(*overlay, "install", "--target", site)
    borrow_test_venv(site)
    assert (site / "sglang" / ".hiqcache-applied").is_file()
    serve_int8(python, site, "install-overlay-int8")
    # Undone after serving: pip's files as pip wrote them (sources; the server
    # recompiled bytecode), no overlay file, module bytecode or marker left.
    out = run(*overlay, "uninstall", "--target", site)
    assert "patched files restored to stock" in out
    assert package_state(site) == stock
