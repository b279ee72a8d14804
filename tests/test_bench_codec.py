"""`make bench-codec` (scripts/bench/codec.py) at a tiny size: one row per
quantized host format the server accepts, each through its real format
object next to the plain BF16 copy, and bytes per token from the format."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


from scripts.bench import codec
from scripts.common.host_formats import host_formats


@pytest.fixture(scope="module")
def result():
    return codec.main(["--tokens", "64", "--reps", "1"])


def test_one_row_per_format_next_to_the_copy(result, capsys):
    quantized = [f.host_dtype for f in host_formats() if not f.stock]
    assert {"int8", "k8v4", "int4"} <= set(quantized)
    ops = result["throughput"][64]
    assert codec.COPY in ops
    for name in quantized:
        for op in ("encode_into", "gather + encode_into", "decode_into -> bf16"):
            median, low = ops[f"{name} {op}"]
            assert 0 < low <= median
    assert list(result["bytes_per_token"]) == quantized


def test_bytes_per_token_are_the_formats_own(result):
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls

    dims, heads = (codec.HEAD_DIM, codec.HEAD_DIM), codec.HEADS
    for name, row in result["bytes_per_token"].items():
        fmt = host_format_cls(name)(dims, heads, 64, codec.DEVICE_DTYPE)
        assert row[64] == codec.LAYERS * fmt.bytes_per_token()
    # hostfmt-spec 5 at Qwen3-8B: INT4 per-channel keys at page 64.
    assert result["bytes_per_token"]["int4"][64] == 36 * 1152
    assert result["bytes_per_token"]["int8"][1] == 36 * 2080


def test_timed_ops_really_encode_and_decode():
    """What is timed is a real round trip: decode after encode restores the
    gathered rows to within a few percent, not a buffer left untouched."""
    import torch

    dev = codec.DeviceStandIn(128, torch.Generator().manual_seed(0))
    for name, cls in codec.format_classes().items():
        ops, io = codec.format_ops(name, codec.make_format(cls), dev)
        for t in io["restored"]:
            t.fill_(float("nan"))
        ops[f"{name} decode_into -> bf16"]()
        for kv, restored in enumerate(io["restored"]):
            want = io["gathered"][kv, -1].float()
            got = restored.reshape(want.shape).float()
            rel = (got - want).norm() / want.norm()
            assert 0 < rel < 0.15, (name, kv, float(rel))


def test_tokens_must_be_whole_pages():
    with pytest.raises(SystemExit, match="multiples of 64"):
        codec.main(["--tokens", "100"])


def test_reps_and_threads_must_be_positive():
    with pytest.raises(SystemExit, match="--reps 0: pass 1 or more"):
        codec.main(["--reps", "0"])
    with pytest.raises(SystemExit, match="--threads 0: pass 1 or more"):
        codec.main(["--threads", "0"])


@pytest.mark.parametrize(
    "make_args,expected",
    [((), "--threads 1"), (("BENCH_ARGS=--tokens 64",), "--tokens 64")],
)
def test_make_bench_codec_passes_bench_args(make_args, expected):
    """`make bench-codec` runs the script with BENCH_ARGS (by default one torch
    thread, which keeps the full size to about 4 minutes on the shared VM)."""
    proc = subprocess.run(
        ["make", "-n", "bench-codec", "PYTHON=python3", *make_args],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if "-m scripts.bench.codec" in ln]
    assert line.endswith(f"-m scripts.bench.codec {expected}")
