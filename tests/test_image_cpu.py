"""The Dockerfile built (podman) and its default command run live on CPU, opt-in
(HIQ_LIVE_IMAGE=1; root; 3-10 min) by scripts/image_cpu_check.sh, which saves what
these tests read under build/image-cpu/run/; a base with another sglang is refused."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from scripts.overlay import read_lock
from scripts.rigs import prom
from scripts.rigs.model import smollm2_dir

pytestmark = pytest.mark.skipif(
    os.environ.get("HIQ_LIVE_IMAGE") != "1",
    reason="HIQ_LIVE_IMAGE=1 (builds and runs the image with podman; needs root)",
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "image_cpu_check.sh"
RUN_DIR = REPO / "build" / "image-cpu" / "run"
PIN = read_lock(REPO / "sglang.lock")["SGLANG_VERSION"]
CONTAINER = "hiq-image-cpu-check"


def run_script(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=3600,
        )
    finally:
        # The script removes its container on exit; not when a timeout kills it.
        subprocess.run(
            ["podman", "--runtime", "runc", "rm", "-f", "--ignore", CONTAINER],
            capture_output=True,
        )


def int8_bytes_per_token(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    # One int8 per value plus one FP16 scale per head row, K and V.
    return (
        config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * (head_dim + 2)
    )


@pytest.fixture(scope="module")
def image_run() -> Path:
    proc = run_script()
    assert proc.returncode == 0, proc.stderr[-6000:]
    return RUN_DIR


def test_series_is_installed_into_the_editable_layout_and_the_cmd_kept(image_run):
    version, package, applied = (image_run / "install.txt").read_text().split()
    assert version == PIN
    # Where `pip install -e python[all]` leaves it in lmsysorg/sglang.
    assert package == "/sgl-workspace/sglang/python/sglang"
    assert applied == "True"  # overlay.py install's marker
    assert "[hiqcache-serve]" in (image_run / "image-config.txt").read_text()


def test_startup_log_names_int8_and_bytes_per_token(image_run):
    log = (image_run / "server.log").read_text()
    expected = int8_bytes_per_token(smollm2_dir())
    assert "HiCache host KV dtype: int8" in log
    assert "HiCache kv host format: int8 (int8-fp16scale-v1)" in log
    assert f"stores INT8 KV: {expected} B/token" in log


def test_repeated_long_prompt_is_a_device_hit_in_the_metrics(image_run):
    replies = json.loads((image_run / "replies.json").read_text())
    first, second = replies["first"]["meta_info"], replies["second"]["meta_info"]
    assert first["prompt_tokens"] >= 1000
    assert first["cached_tokens"] == 0
    # The last prompt token is always recomputed to produce logits.
    assert second["cached_tokens"] == second["prompt_tokens"] - 1
    assert replies["first"]["text"] == replies["second"]["text"]
    # The metrics come from the patched pool.
    metrics = prom.parse((image_run / "metrics.txt").read_text())
    info = metrics.samples("sglang:hicache_host_info")
    assert len(info) == 1, info
    labels = info[0][0]
    assert labels["host_dtype"] == "int8"
    assert labels["layout"] == "layer_first" and labels["io_backend"] == "direct"
    expected = int8_bytes_per_token(smollm2_dir())
    assert metrics.value("sglang:hicache_host_bytes_per_token") == expected
    # Both requests counted, the second one's prompt from the device.
    cached = second["cached_tokens"]
    assert metrics.value("sglang:cached_tokens_total", cache_source="device") == cached


def test_no_sgl_kernel_stand_in_op_ran(image_run):
    log = image_run / "sgl_kernel.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    events = [json.loads(line) for line in lines]
    assert any(e["event"] == "load" for e in events), "stand-in never loaded"
    assert [e for e in events if e["event"] == "call"] == []


def test_dockerfile_refuses_a_base_with_another_sglang(image_run):
    # After image_run: the wrong base reuses its cached rootfs and wheels.
    proc = run_script("--base-version", "0.5.22")
    assert proc.returncode != 0
    assert f"base image has sglang 0.5.22, sglang.lock pins {PIN}" in proc.stderr
