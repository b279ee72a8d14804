"""DSA models (DeepSeek V3.2, GLM-5) with --hicache-host-dtype int8 and auto through
SGLang's own DSA stack on CPU (the latent host pool and DSAIndexerPoolHost under one
HybridCacheController): host hits, L3 round trips, sizing, and host dedup on 2 ranks."""

from __future__ import annotations

import contextlib
import json
import os
from array import array
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from scripts.rigs import standins
from scripts.rigs.hicache_harness import LoadBackReq, make_allocator
from scripts.rigs.l3_harness import radix_prefetch, wait_for
from tests.support import startup_table as st
from tests.support.hybrid_rigs import bits, build_cache, publish_server_args
from tests.support.server_args import resolve
from tests.support.spawned_ranks import run_ranks
from tests.test_mla_host_dedup import (
    _flip_a_byte,
    _host_kv_bytes,
    _radix_state,
    _same,
    _stamp_tp_rank,
)

from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.configs.model_config import (
    ModelConfig,
    dsa_layer_skips_topk,
    get_dsa_index_head_dim,
    get_dsa_index_kpool,
)
from sglang.srt.mem_cache import hicache_auto_size
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.pool_host import base, dsa, mla
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str
from sglang.srt.runtime_context import get_memory

pytestmark = pytest.mark.usefixtures(
    "dsa_copies_on_cpu", "h100", "hybrid_runtime_context", "host_ram_not_under_test"
)

HOST_DTYPES = ("int8", "auto")
# The (layout, io backend) pairs DSAIndexerPoolHost moves pages with
# (pool_host/dsa.py); SGLang resolves the others to these
# (tests/support/startup_table.py).
PAIRS = [
    ("page_first", "kernel"),
    ("page_first_direct", "direct"),
    ("layer_first", "direct"),
    ("layer_first", "kernel"),
]
PAGE = 64  # DSATokenToKVPool's physical page on CUDA
DEVICE_TOKENS = 16 * PAGE
TOKENS = 3 * PAGE


def install_cpu_copies(set_attr=setattr) -> None:
    """CPU stand-ins for the kvcacheio copies of the DSA indexer host pool and
    of the stock MLA host pool's `kernel` io backend."""
    for module, ops in ((dsa, standins.dsa_indexer_standins()),
                        (mla, standins.mla_kernel_standins())):  # fmt: skip
        for name, standin in ops.items():
            set_attr(module, name, standin)


@pytest.fixture(scope="module")
def dsa_copies_on_cpu():
    with pytest.MonkeyPatch.context() as patch:
        install_cpu_copies(lambda m, n, v: patch.setattr(m, n, v, raising=False))
        yield


@pytest.fixture
def h100(monkeypatch):
    """SGLang's DSA resolution reads the GPU's compute capability."""
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (9, 0))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa_models")
    paths = {}
    for name in ("dsa", "glm5"):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(st.MODELS[name][0]))
        paths[name] = str(root / name)
    return paths


# -- the rig ------------------------------------------------------------------


@dataclass
class DsaRig:
    host_dtype: str
    cache: object
    allocator: object
    kv: object  # DSATokenToKVPool
    lock: object = None  # the lock load_back holds on the loaded prefix

    @property
    def controller(self):
        return self.cache.cache_controller

    def host_pool(self, name: PoolName):
        return self.controller.mem_pool_host.entry_map[name].host_pool


def dsa_device_pool(server_args, dtype=torch.bfloat16):
    """DSATokenToKVPool as kv_cache_configurator._build_dsa_kv_pool builds it
    for the model (one rank, no CP layer split, no HiSparse)."""
    model_config = ModelConfig.from_server_args(server_args)
    hf = model_config.hf_config
    layers = model_config.num_hidden_layers
    return DSATokenToKVPool(
        DEVICE_TOKENS,
        page_size=PAGE,
        dtype=dtype,
        kv_lora_rank=model_config.kv_lora_rank,
        qk_rope_head_dim=model_config.qk_rope_head_dim,
        layer_num=layers,
        device="cpu",
        kv_cache_dim=calculate_mla_kv_cache_dim(
            model_config=model_config, kv_cache_dtype=dtype
        ),
        enable_memory_saver=False,
        index_head_dim=get_dsa_index_head_dim(hf),
        index_kpool=get_dsa_index_kpool(hf),
        skip_topk_layers=[dsa_layer_skips_topk(hf, i) for i in range(layers)],
    )


def dsa_rig(
    model_dir, host_dtype, layout, io_backend, l3=None, group=None, building=None
) -> DsaRig:
    """The registry's DSA stack; with `group`, host dedup over that TP group;
    `building(params)`: a context the cache is built in."""
    server_args = publish_server_args(
        model_dir, host_dtype, layout, PAGE, io_backend, l3=l3
    )
    if group is not None:
        if l3 is not None:
            _stamp_tp_rank()  # as the storage config reads the ranks

        def building(params):
            return get_memory().override(enable_mla_hicache_host_dedup=True)

    kv = dsa_device_pool(server_args)
    allocator = make_allocator(kv)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=2048, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        tp_cache_group=group,
    )
    with building(params) if building else contextlib.nullcontext():
        cache = build_cache(server_args, params, swa=False, ssm=False)
    return DsaRig(host_dtype, cache, allocator, kv)


# -- what is written, and what must come back ---------------------------------


def indexer_pages(indices: torch.Tensor) -> torch.Tensor:
    return indices.view(-1, PAGE)[:, 0] // PAGE


def fill(rig: DsaRig, dev: torch.Tensor, gen) -> tuple[list, list]:
    """Random latent rows (a wide range of magnitudes per 128-value tile) and
    random indexer pages (FP8 keys and fp32 scales as bytes) at `dev`."""
    latents, keys = [], []
    for layer in range(rig.kv.layer_num):
        buffer = rig.kv.kv_buffer[layer]
        rows = torch.randn((len(dev), *buffer.shape[1:]), generator=gen)
        rows *= torch.logspace(-2, 2, len(dev)).view(-1, 1, 1)
        buffer[dev] = rows.to(buffer.dtype)
        latents.append(buffer[dev].clone())
        index = rig.kv.index_k_with_scale_buffer[layer]
        if index.shape[0] == 0:  # a shared-top-k layer keeps no indexer keys
            keys.append(None)
            continue
        pages = indexer_pages(dev)
        index[pages] = torch.randint(
            0, 256, (len(pages), index.shape[1]), generator=gen, dtype=torch.uint8
        )
        keys.append(index[pages].clone())
    return latents, keys


def wipe(rig: DsaRig, dev: torch.Tensor) -> None:
    for layer in range(rig.kv.layer_num):
        rig.kv.kv_buffer[layer][dev] = float("nan")
        index = rig.kv.index_k_with_scale_buffer[layer]
        if index.shape[0]:
            index[indexer_pages(dev)] = 0


def latent_reference(rows: torch.Tensor, rope_dim: int):
    """The MLA int8 format's reference decode of `rows` and each element's
    bound (kv_mla_int8_codec: s/2 + half an ulp of the restored value per
    latent element; RoPE exact)."""
    fmt = MLAInt8HostFormat((rows.shape[-1],), 1, 1, rows.dtype, rope_dim=rope_dim)
    records = fmt.encode_reference([rows.view(-1, 1, 1, rows.shape[-1])])
    (restored,) = fmt.decode_reference(records, rows.dtype)
    restored = restored.view_as(rows)
    scale = records["scale"].float().view(len(rows), 1, -1)
    half_step = (scale / 2).repeat_interleave(128, dim=-1)
    bound = torch.zeros(rows.shape, dtype=torch.float32)
    latent = rows.shape[-1] - rope_dim
    bound[..., :latent] = half_step + restored[..., :latent].float().abs() * 2**-8
    return restored, bound


def assert_restored(rig: DsaRig, dev: torch.Tensor, latents, keys) -> None:
    kv = rig.kv
    rope_dim = kv.qk_rope_head_dim
    for layer, (rows, key) in enumerate(zip(latents, keys, strict=True)):
        got = kv.kv_buffer[layer][dev]
        if rig.host_dtype == "auto":
            assert torch.equal(bits(got), bits(rows)), ("latent", layer)
        else:
            want, bound = latent_reference(rows, rope_dim)
            assert torch.equal(bits(got), bits(want)), ("latent", layer)
            err = (got.float() - rows.float()).abs()
            assert bool((err <= bound).all()), ("latent bound", layer)
            assert torch.equal(bits(got[..., -rope_dim:]), bits(rows[..., -rope_dim:]))
        if key is not None:
            index = kv.index_k_with_scale_buffer[layer]
            assert torch.equal(index[indexer_pages(dev)], key), ("indexer", layer)


# -- the scheduler's host hit --------------------------------------------------


def radix_key(ids):
    return RadixKey(array("q", ids))


def insert(rig: DsaRig, ids, seed: int):
    """A prefill's KV at fresh device rows, inserted (written through)."""
    dev = rig.allocator.alloc(len(ids))
    written = fill(rig, dev, torch.Generator().manual_seed(seed))
    rig.cache.insert(
        InsertParams(key=radix_key(ids), value=dev.to(torch.int64), prev_prefix_len=0)
    )
    rig.cache.flush_pending_backups()
    rig.cache.check_hicache_events()
    return dev, written


def load_back(rig: DsaRig, ids) -> torch.Tensor:
    """A match that hits the host for every token, init_load_back and the
    load; returns the device rows the prefix is on now."""
    cache, tokens = rig.cache, len(ids)
    query = radix_key([*ids, 7])
    match = cache.match_prefix(MatchPrefixParams(key=query))
    assert (match.device_prefix_len, match.host_hit_length) == (0, tokens)
    lock = cache.lock(match.last_device_node)
    loaded, last_node = cache.init_load_back(
        InitLoadBackParams(
            best_match_node=match.best_match_node,
            host_hit_length=match.host_hit_length,
            req=LoadBackReq("r0", match.last_device_node),
        )
    )
    assert loaded == tokens
    cache.unlock(lock)
    rig.lock = cache.lock(last_node)
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    again = cache.match_prefix(MatchPrefixParams(key=query))
    assert (again.device_prefix_len, again.host_hit_length) == (tokens, 0)
    return cache.path_device_indices(last_node)


def host_hit(rig: DsaRig, seed: int = 1, check=assert_restored) -> torch.Tensor:
    """Insert, L1 eviction (the rows wiped and held by another request, so
    the load must land elsewhere), host hit, load; `check` both pools."""
    ids = list(range(100, 100 + TOKENS))
    dev, (latents, keys) = insert(rig, ids, seed)
    evicted = rig.cache.evict(EvictParams(num_tokens=TOKENS))
    assert evicted.num_tokens_evicted == TOKENS
    wipe(rig, dev)
    held = rig.allocator.alloc(TOKENS)
    assert torch.equal(held.sort().values, dev.sort().values)
    loaded = load_back(rig, ids)
    assert not set(loaded.tolist()) & set(dev.tolist())
    check(rig, loaded, latents, keys)
    rig.cache.sanity_check()
    return loaded


def expected_stack(rig: DsaRig, layout: str) -> None:
    """The DSA strategy's stack: the latent pool (encoded for int8) and
    SGLang's indexer pool laid out on it, one host page per latent page."""
    latent = rig.host_pool(PoolName.KV)
    indexer = rig.host_pool(PoolName.INDEXER)
    want = (
        MLATokenToKVPoolHost
        if rig.host_dtype == "auto"
        else host_pool_cls(rig.host_dtype, "mla")
    )
    assert type(latent) is want
    assert type(indexer) is DSAIndexerPoolHost
    assert latent.layout == indexer.layout == layout
    assert (latent.size, latent.page_size) == (indexer.size, indexer.page_size)
    # Shared-top-k layers own no indexer keys and get no host layer.
    assert indexer.layer_num == sum(not s for s in rig.kv.skip_topk_layers)


@pytest.mark.parametrize(
    "model,layout,io_backend",
    # GLM-5 shaped: layer 1 reuses layer 0's top-k (no indexer keys on the device,
    # no host layer); the other layers' keys and every latent layer come back.
    [("dsa", *pair) for pair in PAIRS] + [("glm5", "page_first", "kernel")],
)
@pytest.mark.parametrize("host_dtype", HOST_DTYPES)
def test_host_hit_restores_latent_and_indexer(
    model_dirs, host_dtype, model, layout, io_backend
):
    rig = dsa_rig(model_dirs[model], host_dtype, layout, io_backend)
    if model == "glm5":
        assert rig.kv.skip_topk_layers == [False, True, False]
    expected_stack(rig, layout)
    assert rig.controller.io_backend == io_backend
    host_hit(rig)


# -- the checks fail when a pool is broken ------------------------------------


def test_indexer_not_backed_up_is_caught(model_dirs, monkeypatch):
    rig = dsa_rig(model_dirs["dsa"], "int8", "page_first", "kernel")
    monkeypatch.setattr(
        DSAIndexerPoolHost, "backup_from_device_all_layer", lambda *a, **k: None
    )
    with pytest.raises(AssertionError, match="indexer"):
        host_hit(rig)


def test_latent_loaded_into_wrong_rows_is_caught(model_dirs, monkeypatch):
    rig = dsa_rig(model_dirs["dsa"], "int8", "layer_first", "direct")
    pool_cls = type(rig.host_pool(PoolName.KV))
    load = pool_cls.load_to_device_per_layer

    def shifted(self, device_pool, host_indices, device_indices, *args, **kw):
        # Every row one page along: the rows of another request.
        return load(
            self, device_pool, host_indices, device_indices.roll(PAGE), *args, **kw
        )

    monkeypatch.setattr(pool_cls, "load_to_device_per_layer", shifted)
    with pytest.raises(AssertionError, match="latent"):
        host_hit(rig)


# -- L3: the file backend across a restart ------------------------------------

WAIT_S = 30.0


def stop(rig: DsaRig) -> None:
    """The server goes away: its storage threads stop, its pools are freed."""
    rig.controller.detach_storage_backend()
    rig.cache.release_host_resources()


def wait_backed_up(rig: DsaRig) -> None:
    def backed_up():
        rig.cache.check_hicache_events()
        return not rig.cache.ongoing_backup

    wait_for(backed_up, "the L3 backup", WAIT_S)


def prefetch(rig: DsaRig, ids) -> None:
    """A fresh server's miss everywhere but L3: prefetch the prefix into the
    host tier as the scheduler does."""
    cache = rig.cache
    match = cache.match_prefix(MatchPrefixParams(key=radix_key([*ids, 7])))
    assert (match.device_prefix_len, match.host_hit_length) == (0, 0)
    assert radix_prefetch(cache, match, ids, timeout_s=WAIT_S) == (len(ids), 0)


@pytest.fixture(scope="module")
def storage_hash_built():
    """SGLang builds its native page-hash extension (a C++ compile) on first
    use, in the prefetch thread: here, before any deadline runs."""
    get_hash_str([1, 2, 3])


# Mooncake takes page-first layouts only (SGLang rewrites layer_first).
L3_CASES = [
    ("file", "page_first", "kernel"),
    ("file", "layer_first", "direct"),
    ("mooncake", "page_first_direct", "direct"),
]


@pytest.mark.usefixtures("storage_hash_built")
@pytest.mark.parametrize("backend,layout,io_backend", L3_CASES)
@pytest.mark.parametrize("host_dtype", HOST_DTYPES)
def test_l3_round_trip_after_restart(
    request, model_dirs, tmp_path, host_dtype, backend, layout, io_backend
):
    """Both pools' pages reach L3 and come back into a fresh server's pools
    (Mooncake's objects live in the server's own memory segment: there the
    same server, with its L1 and L2 copies dropped): a prefetch, then the
    host hit."""
    l3 = dict(hicache_storage_backend=backend, served_model_name=request.node.name)
    if backend == "file":
        l3["file_storage_path"] = str(tmp_path)
    else:
        l3["extra_config"] = request.getfixturevalue("mooncake_master").storage_config()
    ids = list(range(500, 500 + TOKENS))
    first = dsa_rig(model_dirs["dsa"], host_dtype, layout, io_backend, l3=l3)
    dev, (latents, keys) = insert(first, ids, seed=3)
    wait_backed_up(first)
    if backend == "mooncake":
        assert first.cache.evict(EvictParams(num_tokens=TOKENS)).num_tokens_evicted
        wipe(first, dev)
        for component in first.cache.components:
            first.cache.evict_host(TOKENS, component)
        second = first
    else:
        stop(first)
        second = dsa_rig(model_dirs["dsa"], host_dtype, layout, io_backend, l3=l3)
    if backend == "file":
        # One latent and one indexer object per page, under the format's tag.
        files = [p.name for p in tmp_path.iterdir() if p.suffix == ".bin"]
        assert len([f for f in files if ".indexer_" in f]) == TOKENS // PAGE
        assert len(files) == 2 * (TOKENS // PAGE)
        if host_dtype == "int8":
            assert all("mla-int8-t128" in f for f in files)

    prefetch(second, ids)
    loaded = load_back(second, ids)
    assert_restored(second, loaded, latents, keys)
    if host_dtype == "int8":
        integrity = second.host_pool(PoolName.KV).storage_integrity_counts()
        assert integrity["verified"] >= TOKENS // PAGE, integrity
    stop(second)


# -- start-up and sizing --------------------------------------------------------


def test_fp8_latent_from_kv_cache_dtype_auto_is_refused(model_dirs, monkeypatch):
    """On SM100+ SGLang gives DSA models an FP8 latent for --kv-cache-dtype
    auto: int8 is refused naming the fix; with --kv-cache-dtype bfloat16 it
    starts, and auto serves the FP8 latent."""
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (10, 0))
    with pytest.raises(ValueError) as error:
        resolve(model_dirs["dsa"], hicache_host_dtype="int8")
    message = str(error.value)
    for fragment in (
        "--hicache-host-dtype int8 with --kv-cache-dtype auto, which SGLang "
        "resolves to fp8_e4m3",
        "DeepseekV32ForCausalLM",
        "Pass --kv-cache-dtype bfloat16",
        "--hicache-host-dtype auto",
    ):
        assert fragment in message
    args = resolve(model_dirs["dsa"], hicache_host_dtype="int8", kv_cache_dtype="bf16")
    assert resolution_result(args, "kv_cache_dtype") == "bfloat16"
    args = resolve(model_dirs["dsa"], hicache_host_dtype="auto")
    assert resolution_result(args, "kv_cache_dtype") == "fp8_e4m3"


def test_auto_size_counts_the_indexer_unencoded(model_dirs, monkeypatch):
    """Auto-sizing (no --hicache-ratio/--hicache-size) fits the host pools
    into the host-memory budget: with int8 the latent shrinks, the indexer
    keys do not."""
    budget = 3 << 20
    monkeypatch.setattr(
        hicache_auto_size, "host_memory_budget_bytes", lambda **_: budget
    )
    fraction = 0.8  # the default: no --hicache-ratio or --hicache-size given

    @contextlib.contextmanager
    def auto_sized(params):
        with (
            get_memory().override(hicache_host_memory_fraction=fraction),
            hicache_auto_size.auto_size_hicache(params, None, enabled=True),
        ):
            yield

    tokens = {}
    for host_dtype in HOST_DTYPES:
        rig = dsa_rig(
            model_dirs["dsa"], host_dtype, "page_first", "kernel", building=auto_sized
        )
        group = rig.controller.mem_pool_host
        host_bytes = sum(
            b.nbytes
            for entry in group.entries
            for b in (
                entry.host_pool.get_hybrid_pool_buffer()
                if entry.name == PoolName.INDEXER
                else entry.host_pool.kv_buffer
            )
        )
        # The budget less the slack auto-sizing keeps for allocator rounding
        # (page-rounded pools come in a little under it).
        slack = hicache_auto_size._ALLOCATION_SLACK_FRACTION
        allowed = budget * fraction * (1 - slack)
        assert 0.9 * allowed <= host_bytes <= allowed, (host_dtype, host_bytes)
        tokens[host_dtype] = group.get_pool(PoolName.KV).size
    # int8 holds more tokens in the same budget.
    assert tokens["int8"] > 1.3 * tokens["auto"]


# -- MLA host dedup across 2 ranks (--enable-mla-hicache-host-dedup) ------------

# (name, model, host dtype, layout, io backend); glm5 has shared-top-k layers.
DEDUP_CASES = [
    ("dsa_int8", "dsa", "int8", "page_first", "kernel"),
    ("dsa_auto", "dsa", "auto", "layer_first", "direct"),
    ("glm5_int8", "glm5", "int8", "page_first_direct", "direct"),
]
# The `file` L3 backend: both pools' pages written once per group by the source.
DEDUP_L3_CASE = ("dsa_int8_l3", "dsa", "int8", "page_first", "kernel")
# Faults on the source's store after the restart, in order: a removed
# indexer page file, then a corrupted (sealed int8) latent one.
DEDUP_L3_FAULTS = (("indexer_removed", 2), ("latent_corrupted", 1))
DEDUP_TIMEOUT_S = 180


def _dedup_rig(case, model_dirs, group, l3=None) -> DsaRig:
    _, model, host_dtype, layout, io_backend = case
    return dsa_rig(model_dirs[model], host_dtype, layout, io_backend, l3, group)


def _loaded_on_every_rank(rig: DsaRig, result: dict):
    """A `host_hit` check for a rank: the restore's outcome recorded (the ranks
    stay in step), then whether both pools' rows at `loaded` equal rank 0's."""

    def check(rig, loaded, latents, keys):
        try:
            assert_restored(rig, loaded, latents, keys)
            result["restored"] = "ok"
        except AssertionError as exc:
            result["restored"] = repr(exc)
        kv, pages = rig.kv, indexer_pages(loaded)
        latent = [kv.kv_buffer[layer][loaded] for layer in range(kv.layer_num)]
        index = [b[pages] for b in kv.index_k_with_scale_buffer if b.shape[0]]
        result["latent_equal_to_rank0"] = _same(torch.stack(latent))
        result["indexer_equal_to_rank0"] = _same(torch.stack(index))
        result["indexer_layers"] = len(index)
        result["same_device_indices"] = _same(loaded.to(torch.int64))

    return check


def _dedup_case(case, model_dirs, rank, group) -> dict:
    """The scheduler's path with the flag: `host_hit` through the DSA stack the
    registry builds over the TP group."""
    rig = _dedup_rig(case, model_dirs, group)
    latent, indexer = rig.host_pool(PoolName.KV), rig.host_pool(PoolName.INDEXER)
    result = {
        "is_src": rig.controller.host_dedup.is_src,
        "pools": [type(latent).__name__, type(indexer).__name__],
        "host_kv_bytes": [_host_kv_bytes(latent), _host_kv_bytes(indexer)],
        "host_size": [latent.size, indexer.size],
    }
    host_hit(rig, seed=5, check=_loaded_on_every_rank(rig, result))
    return result


def _dedup_l3_case(case, model_dirs, rank, group, store_dir: str) -> dict:
    """With `file` L3: written through (the source writes both pools' pages,
    once per group), both ranks restarted (fresh pools, the same store), the
    prefix prefetched and loaded on both; then each of DEDUP_L3_FAULTS on the
    source alone: the same miss on both ranks."""

    l3 = dict(hicache_storage_backend="file", file_storage_path=store_dir)
    ids = list(range(100, 100 + TOKENS))
    query = radix_key([*ids, 7])
    first = _dedup_rig(case, model_dirs, group, l3)
    written = []
    backend = first.controller.storage_backend
    for name in ("batch_set", "batch_set_v1"):
        real = getattr(backend, name, None)
        if real is not None:
            setattr(backend, name, _counting(real, written))
    _, (latents, keys) = insert(first, ids, seed=5)
    wait_backed_up(first)
    result = {"is_src": first.controller.host_dedup.is_src}
    result["l3_keys_written"] = len(written)
    dist.barrier(group)
    result["l3_files"] = sorted(os.listdir(store_dir))
    # Restart: every rank's pools go away and come back empty.
    stop(first)
    first.controller.host_dedup.destroy()
    rig = _dedup_rig(case, model_dirs, group, l3)
    latent, indexer = rig.host_pool(PoolName.KV), rig.host_pool(PoolName.INDEXER)
    result["host_kv_bytes"] = [_host_kv_bytes(latent), _host_kv_bytes(indexer)]
    cache = rig.cache
    match = cache.match_prefix(MatchPrefixParams(key=query))
    result["l3"] = list(radix_prefetch(cache, match, ids, timeout_s=WAIT_S))
    loaded = load_back(rig, ids)
    _loaded_on_every_rank(rig, result)(rig, loaded, latents, keys)

    # Faults on the source's store: L1 and L2 dropped before each.
    hashes = get_storage_hash_str(ids, None, page_size=PAGE)

    def page_file(page: int, indexer: bool) -> str:
        (name,) = [
            f
            for f in os.listdir(store_dir)
            if f.startswith(hashes[page]) and (".indexer_" in f) == indexer
        ]
        return os.path.join(store_dir, name)

    result["faults"] = {}
    for i, (fault, page) in enumerate(DEDUP_L3_FAULTS):
        if rig.lock is not None:
            cache.unlock(rig.lock)
            rig.lock = None
        cache.evict(EvictParams(num_tokens=TOKENS))
        for component in cache.components:
            cache.evict_host(TOKENS, component)
        if rig.controller.host_dedup.is_src and fault == "indexer_removed":
            os.remove(page_file(page, indexer=True))
        elif rig.controller.host_dedup.is_src:
            _flip_a_byte(page_file(page, indexer=False))
        dist.barrier(group)
        match = cache.match_prefix(MatchPrefixParams(key=query))
        span = radix_prefetch(cache, match, ids, rid=f"fault{i}", timeout_s=WAIT_S)
        match = cache.match_prefix(MatchPrefixParams(key=query))
        result["faults"][fault] = {
            "prefetched": list(span),
            "hit": [match.device_prefix_len, match.host_hit_length],
            **_radix_state(cache, match),
        }
    stop(rig)
    return result


def _counting(batch_set, written: list):
    def counted(keys, *args, **kwargs):
        written.extend(keys)
        return batch_set(keys, *args, **kwargs)

    return counted


def dedup_rank(rank: int, group, model_dirs: dict, store_dir: str) -> dict:
    """One spawned rank (tests/support/spawned_ranks.py): this module's
    fixtures by hand (kvcacheio copies on CPU, an H100's capability, no RAM
    guard), then every case."""
    install_cpu_copies()
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    with base.host_memory_budget_scope(1 << 40):
        results = {
            case[0]: _dedup_case(case, model_dirs, rank, group) for case in DEDUP_CASES
        }
        results[DEDUP_L3_CASE[0]] = _dedup_l3_case(
            DEDUP_L3_CASE, model_dirs, rank, group, store_dir
        )
    return results


@pytest.fixture(scope="module")
def dedup_ranks(tmp_path_factory, model_dirs):
    out = tmp_path_factory.mktemp("dsa_dedup")
    return run_ranks(
        out,
        2,
        "tests.test_dsa_host_pools:dedup_rank",
        dict(model_dirs=model_dirs, store_dir=str(out / "l3")),
        DEDUP_TIMEOUT_S,
    )


def assert_loaded_on_every_rank(r0, r1) -> None:
    """Both ranks' latent and indexer rows equal rank 0's bit for bit (and the
    format's reference decode of what was written)."""
    assert r0["is_src"] and not r1["is_src"]
    for r in (r0, r1):
        assert r["latent_equal_to_rank0"] and r["indexer_equal_to_rank0"]
        assert r["restored"] == "ok" and r["same_device_indices"]


@pytest.mark.parametrize("case", DEDUP_CASES, ids=[c[0] for c in DEDUP_CASES])
def test_host_dedup_loads_both_pools_on_every_rank_and_peers_hold_none(
    dedup_ranks, case
):
    """The source alone backs up both pools (the peer's are allocator-only);
    after an L1 eviction both ranks load rank 0's rows, the peer's through the
    broadcaster."""
    r0, r1 = dedup_ranks[0][case[0]], dedup_ranks[1][case[0]]
    assert_loaded_on_every_rank(r0, r1)
    if case[1] == "glm5":  # shared-top-k layers hold no indexer keys
        assert 0 < r0["indexer_layers"] < st.MODELS["glm5"][0]["num_hidden_layers"]
    assert r1["pools"] == ["MLATokenToKVPoolHost", "DSAIndexerPoolHost"]
    assert r0["host_size"] == r1["host_size"]
    assert r1["host_kv_bytes"] == [0, 0]
    assert all(b >= r0["host_size"][0] for b in r0["host_kv_bytes"])


def test_host_dedup_l3_pages_written_once_and_read_back_after_a_restart(
    dedup_ranks,
):
    """With `file` L3: the source writes each page (one key, a file per pool:
    latent and indexer), the peer none; both ranks restarted with fresh
    pools, a prefetch brings the prefix back on both and the host hit loads
    both pools."""
    r0, r1 = dedup_ranks[0][DEDUP_L3_CASE[0]], dedup_ranks[1][DEDUP_L3_CASE[0]]
    pages = TOKENS // PAGE
    assert (r0["l3_keys_written"], r1["l3_keys_written"]) == (pages, 0)
    files = r0["l3_files"]
    assert len(files) == 2 * pages and sum(".indexer_" in f for f in files) == pages
    assert r0["l3"][0] == r1["l3"][0] == TOKENS
    assert_loaded_on_every_rank(r0, r1)
    assert r1["host_kv_bytes"] == [0, 0] and min(r0["host_kv_bytes"]) > 0


@pytest.mark.parametrize("fault,page", DEDUP_L3_FAULTS)
def test_host_dedup_l3_source_side_fault_is_the_same_miss_on_every_rank(
    dedup_ranks, fault, page
):
    """A removed indexer page file, then a corrupted (sealed) latent one, on
    the source alone: both ranks prefetch the pages before it and hold the
    same radix path, host and device indices and host pool afterwards."""
    r0, r1 = dedup_ranks[0][DEDUP_L3_CASE[0]], dedup_ranks[1][DEDUP_L3_CASE[0]]
    f0, f1 = r0["faults"][fault], r1["faults"][fault]
    assert f0["prefetched"][0] == f1["prefetched"][0] == page * PAGE, (f0, f1)
    assert f0["hit"] == f1["hit"] == [0, page * PAGE]
    assert f0 == f1
