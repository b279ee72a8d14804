"""Host tiers under speculative decoding, through SGLang's own registry, hybrid pool
assembler, HybridCacheController and UnifiedRadixCache on CPU, for every format."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from tests.support import hybrid_rigs as hybrid
from tests.support.hybrid_rigs import (
    DTYPE,
    HOST_DTYPES,
    Rig,
    build_cache,
    expected_host_cls,
    fill_kv,
    assert_restored,
    publish_server_args,
    swa_rig,
    swa_round_trip,
    wipe_kv,
)
from scripts.rigs.hicache_harness import (
    Geometry,
    MLAGeometry,
    make_allocator,
    make_device_pool,
    make_host_pool,
)
from tests.support.server_args import DEEPSEEK_V3
from tests.support.server_args import LLAMA as _LLAMA

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

# The pools here are a few MB: sized against a fixed budget, not the free RAM
# of a shared machine less SGLang's 10 GiB reserve.
pytestmark = pytest.mark.usefixtures(
    "hybrid_host_copies_on_cpu", "hybrid_runtime_context", "host_ram_not_under_test"
)

# Every (layout, page size, io backend) the encoded pools serve, with a page
# size above 1 wherever the layout groups by page.
MHA_LAYOUTS = [
    ("page_first", 4, "kernel"),
    ("page_first", 4, "direct"),
    ("page_first_direct", 4, "direct"),
    ("page_first_direct", 4, "kernel"),
    ("layer_first", 1, "kernel"),
    ("layer_first", 2, "direct"),
]
DEEPSEEK_MLA = dict(DEEPSEEK_V3, num_nextn_predict_layers=1)
MHA_MTP = dict(_LLAMA, num_nextn_predict_layers=1)
TARGET_LAYERS = 2
DEVICE_TOKENS = 256


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory, hybrid_model_dirs):
    root = tmp_path_factory.mktemp("spec_models")
    paths = dict(hybrid_model_dirs)
    for name, config in (("mha_mtp", MHA_MTP), ("deepseek", DEEPSEEK_MLA)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        paths[name] = str(root / name)
    return paths


def mha_pool(layers: int, page_size: int, head_num=2, head_dim=16):
    geo = Geometry(layers, head_num, head_dim, dtype=DTYPE, page_size=page_size)
    return make_device_pool(geo, DEVICE_TOKENS)


def mla_pool(layers: int, page_size: int):
    geo = MLAGeometry(
        layers,
        DEEPSEEK_MLA["kv_lora_rank"],
        DEEPSEEK_MLA["qk_rope_head_dim"],
        dtype=DTYPE,
        page_size=page_size,
    )
    return make_device_pool(geo, DEVICE_TOKENS)


def flat_rig(server_args, kv_pool, page_size, packed_drafts=()) -> Rig:
    """A flat (MHA or MLA) target's radix cache with HiCache, as the scheduler builds
    it, optionally with packed MTP draft pools."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    allocator = make_allocator(kv_pool)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=512, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        mtp_draft_device_pools=tuple(packed_drafts),
    )
    cache = build_cache(server_args, params, swa=False, ssm=False)
    return Rig(server_args.hicache_host_dtype, cache, allocator, kv_pool, None, None)


def add_draft_sidecar(rig, draft_pool):
    """Register the draft pool as SGLang does for a separate draft model (SIDECAR)."""
    from sglang.srt.mem_cache.kv_cache_builder import maybe_register_hicache_draft
    from sglang.srt.speculative.base_spec_worker import (
        HiCacheDraftMode,
        HiCacheDraftPlan,
    )

    maybe_register_hicache_draft(
        tree_cache=rig.cache,
        draft_plan=HiCacheDraftPlan(
            mode=HiCacheDraftMode.SIDECAR, device_pools=(draft_pool,)
        ),
    )


# -- what a restore must give --------------------------------------------------


def round_trip(rig, pools, tokens, *, sidecars=(), seed=0):
    """Write `tokens` tokens of KV into every pool in `pools` (target first), back them
    up through the controller, wipe the device and load them back into fresh slots;
    returns the loaded slots and the rows written per pool."""
    ctl, gen = rig.controller, torch.Generator().manual_seed(seed)
    slots = rig.allocator.alloc(tokens)
    written = [fill_kv(pool, slots, gen) for pool in pools]
    extra = [PoolTransfer(name=n, indices_from_pool=PoolName.KV) for n in sidecars]
    host = ctl.write(slots, extra_pools=extra or None)
    assert host is not None
    rig.finish()
    for pool in pools:
        wipe_kv(pool, slots)
    rig.allocator.free(slots)

    extra = [PoolTransfer(name=n, indices_from_pool=PoolName.KV) for n in sidecars]
    loaded = ctl.load(host, extra_pools=extra or None)
    assert loaded is not None
    ctl.start_loading()
    rig.finish()
    return loaded, written


# -- packed MTP drafts (NEXTN) ---------------------------------------------------


def packed_mha_rig(spec_models, host_dtype, layout, page_size, io_backend, depth=2):
    server_args = publish_server_args(
        spec_models["mha_mtp"], host_dtype, layout, page_size, io_backend
    )
    target = mha_pool(TARGET_LAYERS, page_size)
    drafts = tuple(mha_pool(1, page_size) for _ in range(depth))
    return flat_rig(server_args, target, page_size, drafts), target, drafts


def check_packed_layers(rig, host_dtype, draft_layers):
    host = rig.host_pool(PoolName.KV)
    assert type(host) is expected_host_cls(host_dtype)
    assert (host.target_layer_num, host.layer_num) == (
        TARGET_LAYERS,
        TARGET_LAYERS + draft_layers,
    )
    if host_dtype == "auto":
        return
    # Allocated bytes are what the pool reports per token (the metrics'
    # bytes_per_token), target and draft layers together.
    allocated = sum(t.nbytes for t in host.host_records.values())
    # int4c gets the sink page on this Llama-style model (sink_page.host_plan):
    # its side store counts too.
    sink = host.sink_pages.nbytes() if host.sink_pages is not None else 0
    assert (sink > 0) == (host_dtype == "int4c")
    assert allocated + sink == pytest.approx(host.size * host.size_per_token)
    per_layer = host.host_format.unit_bytes() / host.host_format.unit_tokens
    assert host.size_per_token_without_draft() == per_layer * TARGET_LAYERS
    assert host.size_per_token == pytest.approx(
        per_layer * (TARGET_LAYERS + draft_layers) + sink / host.size
    )


# (host_dtype, layout, page size, io backend, draft depth): INT8 with two drafts,
# every format (the stock pool too) with one, on every layout.
PACKED_MHA = [("int8", *row, 2) for row in MHA_LAYOUTS] + [
    (f, *row, 1) for f in HOST_DTYPES for row in MHA_LAYOUTS
]


@pytest.mark.parametrize("host_dtype,layout,page_size,io_backend,depth", PACKED_MHA)
def test_packed_mtp_mha(spec_models, host_dtype, layout, page_size, io_backend, depth):
    rig, target, drafts = packed_mha_rig(
        spec_models, host_dtype, layout, page_size, io_backend, depth=depth
    )
    check_packed_layers(rig, host_dtype, depth)
    pools = (target, *drafts)
    loaded, written = round_trip(rig, pools, (depth + 1) * page_size + 2 * depth)
    for i, (pool, rows) in enumerate(zip(pools, written)):
        assert_restored(rig.host_pool(PoolName.KV), pool, loaded, rows, i)


def test_packed_mtp_draft_layer_loads_alone_and_rides_storage_pages(
    spec_models, caplog
):
    """INT8 with one draft: the start-up log names the bytes with and without the draft;
    an is_draft load writes only the draft's host layer into the draft pool (a target
    load leaves it); a storage page holds every host layer and restores the draft's."""
    with caplog.at_level(logging.INFO, logger="sglang.srt.mem_cache.pool_host"):
        rig, target, (draft,) = packed_mha_rig(
            spec_models, "int8", "page_first", 4, "kernel", depth=1
        )
    host = rig.host_pool(PoolName.KV)
    lines = [
        r.getMessage() for r in caplog.records if "stores INT8 KV" in r.getMessage()
    ]
    assert len(lines) == 1, lines
    assert f"{host.size_per_token} B/token" in lines[0]
    assert (
        f"{TARGET_LAYERS} target + 1 packed draft layers "
        f"({host.size_per_token_without_draft()} B/token without the draft)"
    ) in lines[0]
    assert host.storage_page_bytes == host.host_format.unit_bytes() * (
        TARGET_LAYERS + 1
    )
    gen = torch.Generator().manual_seed(3)
    slots = rig.allocator.alloc(8)
    fill_kv(target, slots, gen)
    draft_rows = fill_kv(draft, slots, gen)
    host_slots = torch.arange(8, dtype=torch.int64)
    host.backup_from_device_all_layer(target, host_slots, slots, "kernel")
    wipe_kv(draft, slots)
    for layer in range(TARGET_LAYERS):
        host.load_to_device_per_layer(target, host_slots, slots, layer, "kernel")
    assert torch.isnan(draft.k_buffer[0][slots]).all()
    # Out of the draft range: nothing moves.
    host.load_to_device_per_layer(
        draft, host_slots, slots, TARGET_LAYERS + 1, "kernel", is_draft=True
    )
    assert torch.isnan(draft.k_buffer[0][slots]).all()
    host.load_to_device_per_layer(
        draft, host_slots, slots, TARGET_LAYERS, "kernel", is_draft=True
    )
    assert_restored(host, draft, slots, draft_rows, "draft")
    # Host page 0 through a storage page into host page 2.
    page = host.get_data_page(0, key="k0").clone()
    host.set_from_flat_data_page(8, page, key="k0")
    wipe_kv(draft, slots)
    host.load_to_device_per_layer(
        draft, torch.arange(8, 12), slots[:4], TARGET_LAYERS, "kernel", is_draft=True
    )
    first_page = [tuple(x[:4] for x in rows) for rows in draft_rows]
    assert_restored(host, draft, slots[:4], first_page, "draft via L3 page")


MLA_LAYOUTS = [
    ("page_first", 4, "kernel"),
    ("page_first_direct", 4, "direct"),
    ("layer_first", 1, "kernel"),
    ("layer_first", 2, "direct"),
]


# The stock MLA pool's `kernel` copies have no CPU stand-in: `auto` runs the
# direct ones.
MLA_CASES = [("int8", *case) for case in MLA_LAYOUTS] + [
    ("auto", *case) for case in MLA_LAYOUTS if case[2] == "direct"
]


@pytest.mark.parametrize("host_dtype,layout,page_size,io_backend", MLA_CASES)
def test_packed_mtp_mla(spec_models, host_dtype, layout, page_size, io_backend):
    """DeepSeek V3 NEXTN: the draft's latent layer is packed after the target's."""
    server_args = publish_server_args(
        spec_models["deepseek"], host_dtype, layout, page_size, io_backend
    )
    target = mla_pool(TARGET_LAYERS, page_size)
    draft = mla_pool(1, page_size)
    rig = flat_rig(server_args, target, page_size, (draft,))
    host = rig.host_pool(PoolName.KV)
    expected = (
        MLATokenToKVPoolHost
        if host_dtype == "auto"
        else host_pool_cls(host_dtype, "mla")
    )
    assert type(host) is expected
    assert (host.target_layer_num, host.layer_num) == (TARGET_LAYERS, TARGET_LAYERS + 1)
    if host_dtype != "auto":
        allocated = sum(t.nbytes for t in host.host_records.values())
        assert allocated == host.size * host.size_per_token
        assert host.size_per_token_without_draft() * 3 == host.size_per_token * 2
    loaded, written = round_trip(rig, (target, draft), 2 * page_size + 2)
    for pool, rows, what in zip((target, draft), written, ("target", "draft")):
        assert_restored(host, pool, loaded, rows, what)


# -- separate drafts (EAGLE/EAGLE3 with a draft model, STANDALONE) ---------------


# EAGLE3 with a Llama-shaped draft (one layer, its own heads), STANDALONE (a smaller
# model of the target's family: several layers, the target's heads), and an MLA target
# whose EAGLE3 draft gets the MHA pool: (target model, host_dtype, layout, page size,
# io backend, draft pool arguments, tokens).
SIDECARS = (
    [
        ("mha_mtp", f, "page_first", 4, "kernel", dict(head_num=4, head_dim=32), 12)
        for f in HOST_DTYPES
    ]
    + [
        ("mha_mtp", f, "layer_first", 1, "direct", dict(layers=2), 7)
        for f in ("auto", "int8")
    ]
    + [("deepseek", "int8", "page_first", 4, "kernel", {}, 12)]
)


@pytest.mark.parametrize(
    "model,host_dtype,layout,page_size,io_backend,draft_args,tokens", SIDECARS
)
def test_separate_draft_sidecar_is_the_encoded_pool(
    spec_models, model, host_dtype, layout, page_size, io_backend, draft_args, tokens
):
    server_args = publish_server_args(
        spec_models[model], host_dtype, layout, page_size, io_backend
    )
    make_target = mla_pool if model == "deepseek" else mha_pool
    target = make_target(TARGET_LAYERS, page_size)
    rig = flat_rig(server_args, target, page_size)
    draft_args = {"layers": 1, **draft_args}
    draft = mha_pool(page_size=page_size, **draft_args)
    add_draft_sidecar(rig, draft)
    draft_host = rig.host_pool(PoolName.DRAFT)
    assert type(draft_host) is expected_host_cls(host_dtype)
    assert draft_host.layer_num == draft_host.target_layer_num == draft_args["layers"]
    loaded, written = round_trip(
        rig, (target, draft), tokens, sidecars=(PoolName.DRAFT,)
    )
    assert_restored(rig.host_pool(PoolName.KV), target, loaded, written[0], "t")
    assert_restored(draft_host, draft, loaded, written[1], "draft")


@pytest.mark.parametrize("host_dtype", ["auto", "int8", "k8v4"])
def test_sliding_window_draft_sidecar(spec_models, host_dtype):
    """gpt-oss + EAGLE3: the draft's SWA layers get DRAFT_SWA, indexed like the target's
    SWA pool; both are the format's encoded pool."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        build_swa_draft_pools,
    )
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    layout, page_size, io_backend = ("page_first", 16, "kernel")
    rig = swa_rig(spec_models, host_dtype, layout, page_size, io_backend)
    target_swa_host = rig.host_pool(PoolName.SWA)
    draft = SWAKVPool(
        size=256,
        size_swa=128,
        page_size=page_size,
        dtype=DTYPE,
        head_num=target_swa_host.head_num,
        head_dim=target_swa_host.head_dim,
        swa_attention_layer_ids=[0],
        full_attention_layer_ids=[],
        device="cpu",
        enable_alt_stream=False,
    )
    specs, entries = build_swa_draft_pools(draft_kv_pool=draft, tree_cache=rig.cache)
    for spec, entry in zip(specs, entries, strict=True):
        rig.cache.register_sidecar_pool(spec, entry)
    draft_host = rig.controller.mem_pool_host.entry_map[PoolName.DRAFT_SWA].host_pool
    assert type(draft_host) is type(target_swa_host)
    assert type(draft_host) is expected_host_cls(host_dtype)

    swa_round_trip(rig, 32, seed=2, draft=draft.swa_kv_pool)


# -- a hybrid target's packed MTP layer (Qwen3-Next NEXTN) ------------------------


@pytest.mark.parametrize("host_dtype", ["auto", "int8", "k8v4"])
def test_packed_mtp_on_linear_attention_target(spec_models, host_dtype, monkeypatch):
    """Qwen3-Next NEXTN: the draft's full-attention layer packs after the target's in
    the (encoded) KV host pool; the draft shares the target's Mamba state, which stays
    SGLang's MambaPoolHost."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    drafts = []

    def build_with_draft(server_args, params, *, swa, ssm):
        full = params.token_to_kv_pool_allocator.get_kvcache().full_kv_pool
        draft = HybridLinearKVPool(
            size=DEVICE_TOKENS,
            dtype=DTYPE,
            page_size=params.page_size,
            head_num=full.head_num,
            head_dim=full.head_dim,
            full_attention_layer_ids=[0],
            device="cpu",
            mamba_pool=params.req_to_token_pool.mamba_pool,
        )
        drafts.append(draft)
        params.mtp_draft_device_pools = (draft,)
        return build_cache(server_args, params, swa=swa, ssm=ssm)

    monkeypatch.setattr(hybrid, "build_cache", build_with_draft)
    rig = hybrid.mamba_rig(spec_models, host_dtype, "page_first", 16, "kernel")
    (draft,) = drafts
    host = rig.host_pool(PoolName.KV)
    assert type(host) is expected_host_cls(host_dtype)
    assert host.layer_num == host.target_layer_num + 1
    draft_kv = draft.full_kv_pool

    loaded, (written, d_written) = round_trip(rig, (rig.kv_pool, draft_kv), 40, seed=7)
    assert_restored(host, rig.kv_pool, loaded, written, "target")
    assert_restored(host, draft_kv, loaded, d_written, "draft")


# -- an FP8 device KV cache (int4/k8v4 encode it) ---------------------------------


@pytest.mark.parametrize("host_dtype", ["int4", "k8v4"])
def test_packed_mtp_with_fp8_device_kv(host_dtype):
    """--kv-cache-dtype fp8_e4m3: the packed draft pool is FP8 too (stored as uint8);
    its layer restores exactly what a target layer holding the same rows restores
    (test_fp8_host_pool checks target layers against the reference codec)."""
    fp8, page_size = torch.float8_e4m3fn, 16
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, dtype=fp8, page_size=page_size)
    target = make_device_pool(geo, 4 * page_size)
    draft = make_device_pool(
        Geometry(**{**geo.__dict__, "layer_num": 1}), 4 * page_size
    )
    host = make_host_pool(
        target,
        host_tokens=4 * page_size,
        layout="page_first",
        host_dtype=host_dtype,
        device_kv_dtype=fp8,
        draft_buffer_infos=(draft.get_device_pool_infos()[0].buffer_info,),
    )
    assert (host.layer_num, host.host_format.device_dtype) == (3, fp8)
    gen = torch.Generator().manual_seed(11)
    slots = torch.arange(page_size, 3 * page_size)
    for pool, layer in ((target, 1), (draft, 0)):
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            x = torch.randn((len(slots), *buf.shape[1:]), generator=gen)
            buf[slots] = (x * 4).to(fp8).view(torch.uint8)
        gen = torch.Generator().manual_seed(11)  # the same rows in both
    host_slots = torch.arange(2 * page_size, 4 * page_size)
    host.backup_from_device_all_layer(target, host_slots, slots, "kernel")
    for pool, layer in ((target, 1), (draft, 0)):
        pool.k_buffer[layer][slots] = 0xFF  # NaN in FP8
        pool.v_buffer[layer][slots] = 0xFF
    host.load_to_device_per_layer(target, host_slots, slots, 1, "kernel")
    host.load_to_device_per_layer(draft, host_slots, slots, 2, "kernel", is_draft=True)
    for side in ("k_buffer", "v_buffer"):
        got = getattr(draft, side)[0][slots]
        assert torch.equal(got, getattr(target, side)[1][slots]), side
        assert not torch.isnan(got.view(fp8).float()).any()
