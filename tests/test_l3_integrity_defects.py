"""Defects found by hostile probes and by hand mutation of the suite (issue
21, item 5): each test here failed before its fix or catches a mutant that
the rest of the suite let through.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.hicache_harness import Geometry, MLAGeometry, make_rig
from sglang.srt.mem_cache.device_pool_info import MLABufferInfo, MLASplitBuffers
from sglang.srt.mem_cache.pool_host import base
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat
from sglang.srt.mem_cache.pool_host.encoded_fused import FusedTransfer
from sglang.srt.mem_cache.pool_host.mla_encoded import _refuse_unsupported
from sglang.srt.mem_cache.pool_host.mla_int8 import get_mla_host_pool_cls
from sglang.srt.server_args import ServerArgs


@pytest.fixture(autouse=True)
def _host_ram_not_under_test():
    # These pools are a few KiB; the free-RAM guard (pool_host/base.py) is not
    # what is tested here, and the machine's RAM is shared with other work.
    with base.host_memory_budget_scope(1 << 40):
        yield


def test_k8v4_odd_key_dim_is_refused_at_startup_naming_the_flag():
    # Keys are int8 but the k8v4 codec's key path needs an even width too;
    # before the fix the pool started and every backup raised.
    geo = Geometry(layer_num=2, head_num=2, head_dim=15, v_head_dim=64, page_size=16)
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype k8v4") as e:
        make_rig(geo, layout="page_first", host_dtype="k8v4")
    assert "(15, 64)" in str(e.value) and "--hicache-host-dtype int8" in str(e.value)


def test_mla_int8_without_rope_is_refused_naming_the_flag():
    # Before the fix: OSError [Errno 22] from mmap of the empty RoPE record.
    geo = MLAGeometry(layer_num=2, qk_rope_head_dim=0, page_size=4)
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype int8") as e:
        make_rig(geo, layout="page_first", host_dtype="int8")
    assert "qk_rope_head_dim" in str(e.value)


def test_mla_torch_path_counts_one_per_nonfinite_rope_row():
    """Two bad values in one RoPE row count once, as the fused kernel counts
    rows (mutant: counting every non-finite RoPE element)."""
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
        _refuse_unsupported("int8", _split_buffer_info(), None, (), 1, False)


@pytest.mark.parametrize("host_dtype", ["int4", "k8v4"])
def test_mla_host_pool_class_refuses_4bit_formats(host_dtype):
    """Auto-sizing and the hybrid assembler call this directly, after no
    start-up validation (mutant: they silently got the BF16 MLA pool)."""
    with pytest.raises(NotImplementedError, match=f"--hicache-host-dtype {host_dtype}"):
        get_mla_host_pool_cls(None, host_dtype=host_dtype)


@pytest.mark.parametrize("dtype", ["float", "float32"])
def test_fp32_model_dtype_spellings_are_refused(dtype):
    """--dtype float is float32 (mutant: only "float32" refused)."""
    server_args = ServerArgs(
        model_path="dummy",
        device="cpu",
        skip_tokenizer_init=True,
        enable_hierarchical_cache=True,
        hicache_host_dtype="int8",
        dtype=dtype,
    )
    with pytest.raises(ValueError, match=f"--dtype {dtype}"):
        server_args.resolve_once()


def test_fused_load_index_cache_sees_in_place_changes():
    """The fused load uploads indices once per transfer and reuses them for
    every layer; an index tensor changed in place is a new transfer (mutant:
    the cache ignoring the tensor's version)."""
    geo = Geometry(layer_num=2, head_num=2, head_dim=16, page_size=4)
    rig = make_rig(geo, layout="page_first", host_dtype="int8")
    fused = FusedTransfer(rig.host_pool)
    # A GPU upload is a copy; on CPU the tensor itself would hide a stale cache.
    fused._on_device = lambda t: t.clone()
    host = torch.arange(8, dtype=torch.int64)
    dev = torch.arange(8, 16, dtype=torch.int64)
    first = [t.clone() for t in fused._load_indices(host, dev)]
    assert torch.equal(first[0].cpu(), host) and torch.equal(first[1].cpu(), dev)
    host.add_(8)  # one tensor at a time: each must invalidate the cache
    again = fused._load_indices(host, dev)
    assert torch.equal(again[0].cpu(), host) and torch.equal(again[1].cpu(), dev)
    dev.sub_(8)
    again = fused._load_indices(host, dev)
    assert torch.equal(again[0].cpu(), host) and torch.equal(again[1].cpu(), dev)
