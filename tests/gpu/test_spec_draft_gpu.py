"""One packed MTP draft (NEXTN) through the INT8 host pools on a real GPU (dry run on
CPU): the self-check keeps the kernels, one backup launch encodes target and draft, and
the draft load restores the torch path's bits."""

from __future__ import annotations

import pytest
import torch
from scripts.rigs.gpu import (
    CUDA,
    DEVICE,
    destroy_host_pool,
    make_device_pool,
    make_mla_device_pool,
    pages_to_tokens,
    same_bits,
    sync,
)

PAGE, PAGES, LAYERS = 16, 3, 2


def packed_pool(kind: str, fused: bool):
    from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls

    tokens = 8 * PAGE
    if kind == "mla":
        target = make_mla_device_pool(
            layer_num=LAYERS, page_size=PAGE, tokens=tokens, device=DEVICE
        )
        draft = make_mla_device_pool(
            layer_num=1, page_size=PAGE, tokens=tokens, device=DEVICE
        )
        extra = dict(override_kv_cache_dim=target.kv_cache_dim, target_layer_num=LAYERS)
    else:
        geo = dict(head_num=8, head_dim=128, page_size=PAGE, tokens=tokens)
        target = make_device_pool(layer_num=LAYERS, device=DEVICE, **geo)
        draft = make_device_pool(layer_num=1, device=DEVICE, **geo)
        extra = {}
    pool = host_pool_cls("int8", kind)(
        target.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        PAGE,
        "page_first",
        pin_memory=CUDA,
        device="cpu",
        device_capacity_tokens=target.size,
        start_layer=target.start_layer,
        end_layer=target.end_layer,
        host_token_capacity=8 * PAGE,
        draft_buffer_infos=(draft.get_device_pool_infos()[0].buffer_info,),
        # On CPU (dry run) "direct" runs the kernels under the interpreter.
        fused_transfer="direct" if fused else "off",
        **extra,
    )
    if fused:
        # The start-up self-check ran over all three layers and kept the kernels.
        assert pool.transfer_path == "fused_direct"
    return target, draft, pool


def layers_of(dev_pool):
    if hasattr(dev_pool, "k_buffer"):
        return [*dev_pool.k_buffer, *dev_pool.v_buffer]
    return list(dev_pool.kv_buffer)


def round_trip(kind: str, fused: bool):
    target, draft, pool = packed_pool(kind, fused)
    g = torch.Generator().manual_seed(5)
    src = pages_to_tokens(torch.tensor([1, 2, 3]), PAGE).to(DEVICE)
    rows = []
    for dev_pool in (target, draft):
        for buf in layers_of(dev_pool):
            x = torch.randn(len(src), *buf.shape[1:], generator=g) * 3
            buf[src] = x.to(buf.dtype).to(DEVICE)
            rows.append(x.to(buf.dtype))
    host = pages_to_tokens(torch.tensor([4, 0, 2]), PAGE)
    pool.backup_from_device_all_layer(target, host, src, "kernel")
    sync()
    dst = pages_to_tokens(torch.tensor([5, 6, 7]), PAGE).to(DEVICE)
    for dev_pool in (target, draft):
        for buf in layers_of(dev_pool):
            buf.fill_(float("nan"))
    for layer in range(LAYERS):
        pool.load_to_device_per_layer(target, host, dst, layer, "kernel")
    pool.load_to_device_per_layer(draft, host, dst, LAYERS, "kernel", is_draft=True)
    sync()
    restored = [
        buf[dst].cpu() for dev_pool in (target, draft) for buf in layers_of(dev_pool)
    ]
    records = [b.cpu().clone() for b in pool.kv_buffer]
    destroy_host_pool(pool)
    return rows, records, restored


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_packed_draft_fused_equals_torch_path(kind):
    rows, ref_records, ref_restored = round_trip(kind, fused=False)
    _, records, restored = round_trip(kind, fused=True)
    for a, b in zip(records, ref_records):
        assert same_bits(a, b), "host records differ from the torch path"
    for i, (a, b) in enumerate(zip(restored, ref_restored)):
        assert same_bits(a, b), ("restored device KV differs", i)
        assert not a.isnan().any(), ("layer not restored", i)
    if kind == "mha":
        from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec

        for i, (x, got) in enumerate(zip(rows, restored)):
            q, s = codec.quantize_reference(x)
            assert same_bits(got, codec.dequantize_reference(q, s, x.dtype)), i
