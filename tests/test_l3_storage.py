"""INT8 host pages in HiCache's L3 tier, through SGLang's real HiCacheController
storage threads, with the `file` backend and with SGLang's MooncakeStore
against a real mooncake_master (zero-copy path) started on 127.0.0.1.

BF16 (the stock host pool) is the control: its round trip is bit-exact. An
INT8 round trip restores exactly the reference codec's values of what was
written, because L3 holds the L2 records unchanged.
"""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from scripts.rigs import l3_harness as h
from scripts.rigs.hicache_harness import Geometry
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES

GEO = Geometry(layer_num=3, head_num=2, head_dim=16, page_size=4)
PAGES = 8
TOKENS = list(range(1000, 1000 + PAGES * GEO.page_size))
HOST_DTYPES = ("auto", "int8")  # auto: the stock BF16 host pool


def expected_restore(rows: list[torch.Tensor], host_dtype: str):
    if host_dtype == "auto":
        return rows
    out = []
    for r in rows:
        q, scale = codec.quantize_reference(r)
        out.append(codec.dequantize_reference(q, scale, r.dtype))
    return out


def assert_restored(l3, dev, expected, tokens=None):
    got = h.device_rows(l3.rig, dev)
    n = len(dev)
    for g, e in zip(got, expected):
        assert torch.equal(g, e[:n]), "restored KV differs from what was written"


def model_name(request) -> str:
    # Tests share one store; distinct model names keep their keys apart.
    return f"hiq/{request.node.name}"


@pytest.fixture
def mooncake_l3(mooncake_master, l3_rigs, request):
    """make_l3_rig on the shared mooncake_master, this test's model name."""

    def make(**kwargs):
        l3 = h.make_l3_rig(
            "mooncake",
            mooncake_master.storage_config(),
            model_name=model_name(request),
            **kwargs,
        )
        l3_rigs.append(l3)
        return l3

    return make


@pytest.fixture
def file_l3(tmp_path, l3_rigs, request):
    """make_l3_rig on the file backend under tmp_path, this test's model name."""
    l3 = h.make_l3_rig(
        "file", h.file_storage_config(tmp_path), model_name=model_name(request)
    )
    l3_rigs.append(l3)
    return l3


# ---------------------------------------------------------------------------
# round trips


def test_mooncake_objects_are_the_l2_records(mooncake_l3):
    """No re-encoding: each object is byte-for-byte the pool's page records."""
    l3 = mooncake_l3()
    dev, host, hashes, stored = h.write_through(l3, TOKENS)
    pool, backend = l3.controller.mem_pool_host, l3.backend
    page = int(host[GEO.page_size]) // GEO.page_size
    k_page = pool.host_records["k"][page].view(torch.uint8).flatten()
    v_page = pool.host_records["v"][page].view(torch.uint8).flatten()
    scales = pool.host_records["scale"][page].view(torch.uint8).flatten()
    half = scales.numel() // 2
    key = backend._tag_keys([hashes[1]])[0] + f"_{backend.mha_suffix}"
    k_obj = torch.frombuffer(
        bytearray(backend.store.get(key + "_k")), dtype=torch.uint8
    )
    v_obj = torch.frombuffer(
        bytearray(backend.store.get(key + "_v")), dtype=torch.uint8
    )
    assert torch.equal(k_obj[:-SEAL_BYTES], torch.cat([k_page, scales[:half]]))
    assert torch.equal(v_obj[:-SEAL_BYTES], torch.cat([v_page, scales[half:]]))
    # Each object ends in its seal, moved zero-copy from the pool's seal buffer.
    assert torch.equal(k_obj[-SEAL_BYTES:], pool.pages.seals[page, 0])
    assert torch.equal(v_obj[-SEAL_BYTES:], pool.pages.seals[page, 1])
    # The key carries the pool's format tag (storage_model_name).
    assert pool.storage_format_tag in key


# ---------------------------------------------------------------------------
# isolation


# ---------------------------------------------------------------------------
# faults: a store that fails or lies never corrupts L1/L2


def mooncake_key(l3, page_hash: str, part: str) -> str:
    backend = l3.backend
    return backend._tag_keys([page_hash])[0] + f"_{backend.mha_suffix}_{part}"


def replace_object(store, key: str, value: bytes) -> None:
    deadline = time.monotonic() + h.STORAGE_WAIT_S
    while store.remove(key) != 0:  # a lease may hold it briefly
        assert time.monotonic() < deadline, f"cannot remove {key}"
        time.sleep(0.05)
    if value:
        assert store.put(key, value) == 0


def written_then_evicted(l3, seed=0):
    dev, host, hashes, stored = h.write_through(l3, TOKENS, seed=seed)
    assert stored == PAGES
    written = h.device_rows(l3.rig, dev)
    h.evict_everywhere(l3, dev, host)
    return written, hashes


def check_partial_prefetch(l3, host_dtype, written, pf, good_pages):
    assert pf.completed_tokens == good_pages * GEO.page_size
    if good_pages:
        dev = h.load_to_device(l3, pf.host_indices)
        assert_restored(l3, dev, expected_restore(written, host_dtype))
    # Every host slot came back: the refused pages hold nothing.
    pool = l3.controller.mem_pool_host
    assert pool.available_size() + good_pages * GEO.page_size == pool.size


@pytest.mark.parametrize("host_dtype", HOST_DTYPES)
def test_mooncake_truncated_object_is_refused(mooncake_l3, host_dtype):
    l3 = mooncake_l3(host_dtype=host_dtype)
    written, hashes = written_then_evicted(l3)
    store, key = l3.backend.store, mooncake_key(l3, hashes[3], "k")
    replace_object(store, key, bytes(store.get_size(key) - 16))

    pf = h.prefetch(l3, TOKENS + [7])
    assert pf.hit_tokens == len(TOKENS)  # the object exists, so the query hits
    check_partial_prefetch(l3, host_dtype, written, pf, good_pages=3)
    assert l3.controller.prefetch_failed_pages == PAGES - 3


@pytest.mark.parametrize("host_dtype", HOST_DTYPES)
def test_mooncake_object_missing_at_read_is_refused(mooncake_l3, host_dtype):
    l3 = mooncake_l3(host_dtype=host_dtype)
    written, hashes = written_then_evicted(l3)
    store, key = l3.backend.store, mooncake_key(l3, hashes[5], "v")
    pf = h.prefetch(l3, TOKENS + [7], before_io=lambda: replace_object(store, key, b""))
    check_partial_prefetch(l3, host_dtype, written, pf, good_pages=5)
    assert l3.controller.prefetch_failed_pages == PAGES - 5


def file_page(tmp_path, l3, page_hash):
    (path,) = tmp_path.glob(f"{page_hash}*.bin")
    return path


def test_file_truncated_page_is_refused(tmp_path, file_l3):
    l3 = file_l3
    written, hashes = written_then_evicted(l3)
    path = file_page(tmp_path, l3, hashes[3])
    path.write_bytes(path.read_bytes()[:-16])
    pf = h.prefetch(l3, TOKENS + [7])
    # A miss for that page only: the pages before it are restored.
    check_partial_prefetch(l3, "int8", written, pf, good_pages=3)
    assert l3.controller.prefetch_failed_pages == PAGES - 3
    assert l3.controller.mem_pool_host.storage_integrity.counts()["size"] == 1


def test_file_page_missing_at_read_is_refused(tmp_path, file_l3):
    l3 = file_l3
    written, hashes = written_then_evicted(l3)
    path = file_page(tmp_path, l3, hashes[5])
    pf = h.prefetch(l3, TOKENS + [7], before_io=path.unlink)
    check_partial_prefetch(l3, "int8", written, pf, good_pages=5)
    assert l3.controller.prefetch_failed_pages == PAGES - 5


def test_wrong_size_flat_page_is_refused_before_it_reaches_the_pool(l3_rigs, tmp_path):
    l3 = h.make_l3_rig("file", h.file_storage_config(tmp_path))
    l3_rigs.append(l3)
    pool = l3.controller.mem_pool_host
    before = [b.clone() for b in pool.kv_buffer]
    page = pool.get_dummy_flat_data_page()
    for bad in (page[:-1], torch.cat([page, page[:1]])):
        with pytest.raises(ValueError, match="expected"):
            pool.set_from_flat_data_page(0, bad.fill_(1))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.kv_buffer))


def test_master_stopped_mid_run(tmp_path, l3_rigs, request):
    h.require_mooncake()
    m = h.MooncakeMaster(tmp_path / "master.log").start()
    try:
        l3 = h.make_l3_rig(
            "mooncake", m.storage_config(), model_name=model_name(request)
        )
        l3_rigs.append(l3)
        dev_a, host_a, _, stored = h.write_through(l3, TOKENS, seed=1)
        assert stored == PAGES
        written_a = h.device_rows(l3.rig, dev_a)
        m.stop()

        # Writes fail cleanly: the backup thread acks with nothing stored.
        tokens_b = [t + 5000 for t in TOKENS]
        dev_b, host_b, _, stored = h.write_through(l3, tokens_b, seed=2)
        assert stored == 0
        written_b = h.device_rows(l3.rig, dev_b)
        # Prefetches miss instead of failing.
        assert h.prefetch(l3, TOKENS + [7]).hit_tokens == 0

        # L1 and L2 keep serving: both sets load back from the host pool.
        for dev, host, written in (
            (dev_a, host_a, written_a),
            (dev_b, host_b, written_b),
        ):
            h.evict_everywhere(l3, dev, host[:0])
            restored = h.load_to_device(l3, host)
            assert_restored(l3, restored, expected_restore(written, "int8"))
        ctl = l3.controller
        assert ctl.backup_thread.is_alive() and ctl.prefetch_io_aux_thread.is_alive()
    finally:
        m.stop()


def test_store_full_evicts_and_keeps_serving(tmp_path, l3_rigs, request):
    """A store smaller than what is written: the store evicts, writes fail or
    succeed cleanly, and whatever a prefetch delivers is the written KV."""
    h.require_mooncake()
    m = h.MooncakeMaster(
        tmp_path / "master.log", extra_args=("--default_kv_lease_ttl=50",)
    ).start()
    try:
        geo = Geometry(layer_num=4, head_num=4, head_dim=64, page_size=64)
        capacity = 16 << 20
        l3 = h.make_l3_rig(
            "mooncake",
            m.storage_config(segment_bytes=capacity),
            geo=geo,
            device_tokens=2048,
            host_tokens=4096,
            model_name=model_name(request),
        )
        l3_rigs.append(l3)
        round_bytes = 2048 * l3.controller.mem_pool_host.get_size_per_token()
        rounds = capacity // round_bytes + 3
        written = {}
        for r in range(rounds):
            tokens = list(range(r * 100_000, r * 100_000 + 2048))
            dev, host, _, stored = h.write_through(l3, tokens, seed=r)
            written[r] = (tokens, h.device_rows(l3.rig, dev))
            h.evict_everywhere(l3, dev, host)
            assert m.metrics()["master_allocated_bytes"] <= capacity
            time.sleep(0.1)  # let leases lapse so the store can evict
        hits = {}
        for r, (tokens, rows) in written.items():
            pf = h.prefetch(l3, tokens + [7], request_id=f"r{r}")
            hits[r] = pf.completed_tokens
            if pf.completed_tokens:
                dev = h.load_to_device(l3, pf.host_indices)
                assert_restored(l3, dev, expected_restore(rows, "int8"))
                l3.rig.allocator.free(dev)
                l3.controller.mem_pool_host.free(pf.host_indices)
        assert m.metrics()["master_evicted_key_count"] > 0
        assert sum(hits.values()) < rounds * 2048, "more came back than fits"
        assert any(hits.values()), "nothing survived in the store"
    finally:
        m.stop()


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_nonfinite_kv_comes_back_nan_through_l3(tmp_path, l3_rigs, request, backend):
    if backend == "mooncake":
        config = request.getfixturevalue("mooncake_master").storage_config()
    else:
        config = h.file_storage_config(tmp_path)
    l3 = h.make_l3_rig(backend, config, model_name=model_name(request))
    l3_rigs.append(l3)

    def poison(pool, dev):
        pool.k_buffer[1][dev[5], 0, 3] = float("inf")
        pool.v_buffer[2][dev[9], 1, 0] = float("nan")

    dev, host, _, stored = h.write_through(l3, TOKENS, edit=poison)
    assert stored == PAGES
    h.evict_everywhere(l3, dev, host)
    pf = h.prefetch(l3, TOKENS + [7])
    assert pf.completed_tokens == len(TOKENS)
    dev = h.load_to_device(l3, pf.host_indices)
    k, v = l3.rig.device_pool.k_buffer[1][dev], l3.rig.device_pool.v_buffer[2][dev]
    # The whole head row of a non-finite value restores as NaN, nothing else.
    assert k[5, 0].isnan().all() and v[9, 1].isnan().all()
    assert k.isnan().sum() == k.shape[-1] and v.isnan().sum() == v.shape[-1]


# ---------------------------------------------------------------------------
# page I/O on the pool itself


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_flat_page_is_k_v_scales_and_round_trips(tmp_path, l3_rigs, layout):
    l3 = h.make_l3_rig("file", h.file_storage_config(tmp_path), layout=layout)
    l3_rigs.append(l3)
    dev, host, _, _ = h.write_through(l3, TOKENS)
    pool = l3.controller.mem_pool_host
    index = int(host[2 * GEO.page_size])
    page = pool.get_data_page(index)
    assert page.dtype == torch.uint8
    assert page.numel() == pool.storage_page_bytes + SEAL_BYTES
    sl = slice(index, index + GEO.page_size)
    if layout == "layer_first":
        parts = [
            b[:, sl]
            for b in (
                pool.host_records["k"],
                pool.host_records["v"],
                pool.host_records["scale"],
            )
        ]
    else:
        p = index // GEO.page_size
        parts = [
            b[p]
            for b in (
                pool.host_records["k"],
                pool.host_records["v"],
                pool.host_records["scale"],
            )
        ]
    expected = torch.cat([x.contiguous().view(torch.uint8).flatten() for x in parts])
    assert torch.equal(page[:-SEAL_BYTES], expected)

    # Into a free page: the records land exactly, nothing else changes.
    free = pool.alloc(GEO.page_size)
    before = [b.clone() for b in pool.kv_buffer]
    pool.set_from_flat_data_page(int(free[0]), page)
    assert torch.equal(pool.get_data_page(int(free[0])), page)
    changed = [(a != b).sum().item() for a, b in zip(before, pool.kv_buffer)]
    assert sum(changed) <= page.numel()


def _read(ptr: int, size: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(ctypes.string_at(ptr, size)), dtype=torch.uint8)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_page_buffer_meta_points_at_the_flat_page_bytes(tmp_path, l3_rigs, layout):
    l3 = h.make_l3_rig("file", h.file_storage_config(tmp_path), layout=layout)
    l3_rigs.append(l3)
    dev, host, _, _ = h.write_through(l3, TOKENS)
    pool = l3.controller.mem_pool_host
    ptrs, sizes = pool.get_page_buffer_meta(host[: 2 * GEO.page_size])
    assert len(ptrs) == 2 * 2 * pool.storage_buffers_per_object  # 2 pages
    per_page = 2 * pool.storage_buffers_per_object
    for page in range(2):
        got = [
            _read(p, s)
            for p, s in zip(ptrs[page * per_page : (page + 1) * per_page], sizes)
        ]
        k, s_lo, k_seal, v, s_hi, v_seal = got
        flat = pool.get_data_page(int(host[page * GEO.page_size]))
        assert torch.equal(torch.cat([k, v, s_lo, s_hi]), flat[:-SEAL_BYTES])
        assert sum(sizes[:per_page]) == pool.storage_page_bytes + 2 * SEAL_BYTES
        assert len(k_seal) == len(v_seal) == SEAL_BYTES


def test_layer_first_has_no_zero_copy_pages(tmp_path, l3_rigs):
    l3 = h.make_l3_rig("file", h.file_storage_config(tmp_path), layout="layer_first")
    l3_rigs.append(l3)
    pool = l3.controller.mem_pool_host
    with pytest.raises(ValueError, match="--hicache-mem-layout page_first"):
        pool.get_page_buffer_meta(torch.arange(GEO.page_size))
    assert not pool.is_stride_page_aligned()
    with pytest.raises(NotImplementedError, match="page_head"):
        pool.get_split_heads_page_buffer_meta(torch.arange(GEO.page_size), 2)


# The byte format of an INT8 storage page, pinned per format tag. A change to
# the page bytes for the same KV fails here: give it a new storage_format_tag
# (keys change with it, so old pages become misses), then add its digest.
PAGE_FORMAT_DIGESTS = {
    "int8-fp16scale-v1-seal1": "09a31b14f2af2a2cf0a0409cc1f5adcae3ca19fe59a0f10d4e1afc76776310e9",
}


def test_storage_format_tag_names_the_page_bytes(tmp_path, l3_rigs):
    import hashlib

    l3 = h.make_l3_rig("file", h.file_storage_config(tmp_path))
    l3_rigs.append(l3)
    dev, host, _, _ = h.write_through(l3, TOKENS, seed=11)
    pool = l3.controller.mem_pool_host
    digest = hashlib.sha256()
    for i in range(0, len(host), GEO.page_size):
        digest.update(pool.get_data_page(int(host[i])).numpy().tobytes())
    assert pool.storage_format_tag in PAGE_FORMAT_DIGESTS, (
        f"new storage_format_tag {pool.storage_format_tag!r}: pin its digest"
    )
    assert PAGE_FORMAT_DIGESTS[pool.storage_format_tag] == digest.hexdigest()


# ---------------------------------------------------------------------------
# 4-bit formats (int4, k8v4): the same page I/O over their own records. Page
# size 16 gives int4 its per-channel keys on the page layouts; layer_first
# units are tokens, so its keys are per token.

GEO16 = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=16)
PAGES16 = 4
TOKENS16 = list(range(3000, 3000 + PAGES16 * GEO16.page_size))
FOUR_BIT = ("int4", "k8v4")


@pytest.mark.parametrize("host_dtype", FOUR_BIT)
def test_4bit_mooncake_objects_are_the_l2_records(mooncake_l3, host_dtype):
    """Object _k is the page's key payload then its key metadata, _v the same
    for values: the L2 records, never re-encoded."""
    l3 = mooncake_l3(host_dtype=host_dtype, geo=GEO16)
    dev, host, hashes, stored = h.write_through(l3, TOKENS16)
    pool, backend = l3.controller.mem_pool_host, l3.backend
    page = int(host[GEO16.page_size]) // GEO16.page_size
    k_meta = "k_meta" if host_dtype == "int4" else "k_scale"

    def record(name):
        return pool.host_records[name][page].view(torch.uint8).flatten()

    key = backend._tag_keys([hashes[1]])[0] + f"_{backend.mha_suffix}"
    k_obj = torch.frombuffer(
        bytearray(backend.store.get(key + "_k")), dtype=torch.uint8
    )
    v_obj = torch.frombuffer(
        bytearray(backend.store.get(key + "_v")), dtype=torch.uint8
    )
    assert torch.equal(k_obj[:-SEAL_BYTES], torch.cat([record("k"), record(k_meta)]))
    assert torch.equal(v_obj[:-SEAL_BYTES], torch.cat([record("v"), record("v_meta")]))
    assert pool.storage_format_tag in key
