"""Defects found by hostile probes and hand mutation: each test here failed
before its fix or catches a mutant the rest of the suite let through."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import torch

from scripts.rigs.hicache_harness import Geometry, MLAGeometry, make_rig
from sglang.srt.mem_cache.device_pool_info import MLABufferInfo, MLASplitBuffers
from sglang.srt.mem_cache.pool_host import mla as mla_host
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat
from sglang.srt.mem_cache.pool_host.encoded_fused import FusedTransfer
from sglang.srt.mem_cache.pool_host.mla_encoded import _refuse_unsupported
from sglang.srt.arg_groups import hicache_hook
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
from sglang.srt.server_args import ServerArgs

pytestmark = pytest.mark.usefixtures("host_ram_not_under_test", "restore_environ")

README = Path(__file__).resolve().parents[1] / "README.md"


def _device_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The device KV dtype the model runner would configure (no weights)."""
    _, dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=kv_cache_dtype,
        model=None,
        model_dtype=model_dtype,
        is_draft_worker=False,
        is_dflash=False,
        speculative_draft_attention_backend=None,
    )
    return dtype


def test_k8v4_pool_refuses_an_odd_key_dim_naming_the_flag():
    # Keys are int8 but the k8v4 codec's key path needs an even width too;
    # before the fix the pool started and every backup raised.
    geo = Geometry(layer_num=2, head_num=2, head_dim=15, v_head_dim=64, page_size=16)
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype k8v4") as e:
        make_rig(geo, layout="page_first", host_dtype="k8v4")
    assert "(15, 64)" in str(e.value) and "--hicache-host-dtype int8" in str(e.value)


def test_mla_int8_pool_refuses_no_rope_part_naming_the_flag():
    # Before the fix: OSError [Errno 22] from mmap of the empty RoPE record.
    geo = MLAGeometry(layer_num=2, qk_rope_head_dim=0, page_size=4)
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype int8") as e:
        make_rig(geo, layout="page_first", host_dtype="int8")
    assert "qk_rope_head_dim" in str(e.value)


def test_mla_torch_path_counts_one_per_nonfinite_rope_row():
    """Two bad values in one RoPE row count once, as the fused kernel counts rows."""
    fmt = MLAInt8HostFormat((512 + 64,), 1, 1, torch.bfloat16)
    x = torch.randn(3, 1, 1, 576).to(torch.bfloat16)
    x[0, 0, 0, 512] = float("nan")
    x[0, 0, 0, 520] = float("inf")
    x[2, 0, 0, 575] = float("nan")
    out = {r.name: torch.empty((3, *r.shape), dtype=r.dtype) for r in fmt.records}
    stats = fmt.encode_into([x], out)
    assert int(stats.nonfinite) == 2


def _split_buffer_info() -> MLABufferInfo:
    split = MLASplitBuffers(
        k=torch.zeros(4, 512, dtype=torch.bfloat16),
        v=torch.zeros(4, 64, dtype=torch.bfloat16),
        index_k=None,
        index_scales=None,
        index_layer_indices=(),
        k_width=512,
        v_width=64,
        index_width=0,
    )
    return MLABufferInfo(
        buffers=split,
        data_ptrs=None,
        layer_indices=(0,),
        device_layer_num=1,
        page_size=1,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        kv_cache_dim=576,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )


def test_mla_int8_refuses_npu_split_buffers_naming_the_flag():
    # Mutant: without this refusal the pool fails later with an IndexError.
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype int8"):
        _refuse_unsupported("int8", _split_buffer_info(), None, 1, False)


@pytest.mark.parametrize("host_dtype", ["int4", "k8v4"])
def test_mla_host_pool_class_refuses_4bit_formats(host_dtype):
    """Auto-sizing and the hybrid assembler call these after no start-up
    validation (mutant: they silently got the BF16 MLA pool)."""
    match = f"--hicache-host-dtype {host_dtype}"
    with pytest.raises(NotImplementedError, match=match):
        mla_host.get_mla_host_pool_cls(host_dtype)
    with pytest.raises(NotImplementedError, match=match):
        host_pool_cls(host_dtype, "mla")
    assert mla_host.get_mla_host_pool_cls("int8") is host_pool_cls("int8", "mla")


def test_fused_load_index_cache_sees_in_place_changes():
    """The fused load uploads indices once per transfer; an index tensor changed
    in place is a new transfer (mutant: the cache ignoring its version)."""
    geo = Geometry(layer_num=2, head_num=2, head_dim=16, page_size=4)
    rig = make_rig(geo, layout="page_first", host_dtype="int8")
    fused = FusedTransfer(rig.host_pool.transfer_context, "direct")
    # A GPU upload is a copy; on CPU the tensor itself would hide a stale cache.
    fused._on_device = lambda t: t.clone()
    host = torch.arange(8, dtype=torch.int64)
    dev = torch.arange(8, 16, dtype=torch.int64)
    first = [t.clone() for t in fused._load_indices(host, dev)]
    assert torch.equal(first[0].cpu(), host) and torch.equal(first[1].cpu(), dev)
    # One tensor at a time: each must invalidate the cache.
    for change in (lambda: host.add_(8), lambda: dev.sub_(8)):
        change()
        again = fused._load_indices(host, dev)
        assert torch.equal(again[0].cpu(), host) and torch.equal(again[1].cpu(), dev)


# --- FP16 device KV: the README matrix, the hook and argparse agree ----------


def _choices(parser, dest: str) -> list:
    return next(a.choices for a in parser._actions if a.dest == dest)


def test_hook_device_kv_dtypes_are_argparse_choices(parser):
    """Every --kv-cache-dtype the hook lets through is an argparse choice the
    model runner maps to BF16/FP16 (it also took fp16, which neither accepts)."""
    choices = _choices(parser, "kv_cache_dtype")
    for kv_cache_dtype in hicache_hook._ENCODED_HOST_DEVICE_KV_DTYPES:
        assert kv_cache_dtype in choices, kv_cache_dtype
        if kv_cache_dtype != "auto":
            dtype = _device_kv_dtype(kv_cache_dtype, torch.float16)
            assert dtype in (torch.bfloat16, torch.float16), kv_cache_dtype


def _readme_plain_device_kv_spellings() -> list[list[str]]:
    """The spellings in the README's "device KV dtype" row before its FP8
    clause; `--flag a/b` is two."""
    row = next(
        line
        for line in README.read_text().splitlines()
        if line.startswith("| device KV dtype |")
    )
    plain = row.split("|")[2].split(";")[0]
    spellings = []
    for span in re.findall(r"`(--[^`]+)`", plain):
        argv = shlex.split(span)
        alternatives = [argv[:-1] + [v] for v in argv[-1].split("/")]
        spellings.extend(alternatives)
    return spellings


@pytest.mark.parametrize("host_dtype", ["int8", "int4", "k8v4"])
def test_readme_bf16_fp16_device_kv_rows_start_through_the_cli(
    models, parser, host_dtype
):
    """Each spelling parses, passes start-up with the encoded host dtype, and
    gives the row's device KV dtype: both BF16 and FP16 are reached."""
    model = models["mha"]
    spellings = _readme_plain_device_kv_spellings()
    assert spellings, "README's device KV dtype row names no flag"
    reached = set()
    for argv in spellings:
        full = ["--model-path", model, "--device", "cpu", "--skip-tokenizer-init"]
        full += ["--enable-hierarchical-cache", "--hicache-host-dtype", host_dtype]
        try:
            parsed = parser.parse_args(full + argv)
        except (SystemExit, argparse.ArgumentError):
            pytest.fail(f"README's {' '.join(argv)} is refused by argparse")
        server_args = ServerArgs.from_cli_args(parsed)
        server_args.resolve_once()
        model_dtype = ModelConfig.from_server_args(server_args).dtype
        reached.add(_device_kv_dtype(server_args.kv_cache_dtype, model_dtype))
    assert reached == {torch.bfloat16, torch.float16}, (spellings, reached)
