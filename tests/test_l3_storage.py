"""Encoded host pages in L3 through SGLang's real storage threads (`file`,
MooncakeStore over a real master, HiCacheNixl's POSIX files): objects are the L2
records, round trips the reference decode; a failing store never corrupts L1/L2."""

from __future__ import annotations

import time

import pytest
import torch

from scripts.rigs import l3_harness as h
from scripts.rigs.hicache_harness import LAYOUTS, Geometry
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES
from tests.support import l3_faults as lf
from tests.support.l3_faults import (
    FORMATS,
    GEO16,
    check_restored_to_device,
    make_l3,
    reference_restore,
)

pytestmark = pytest.mark.usefixtures("host_ram_not_under_test")

GEO = Geometry(layer_num=3, head_num=2, head_dim=16, page_size=4)
PAGES = 8
TOKENS = list(range(1000, 1000 + PAGES * GEO.page_size))


def expected_restore(rows: list[torch.Tensor], host_dtype: str):
    if host_dtype == "auto":
        return rows
    return [
        codec.dequantize_reference(*codec.quantize_reference(r), r.dtype) for r in rows
    ]


def assert_restored(l3, dev, expected):
    n = len(dev)
    for g, e in zip(h.device_rows(l3.rig, dev), expected):
        assert torch.equal(g, e[:n]), "restored KV differs from what was written"


def tokens_for(geo, pages=PAGES, first=5000):
    return list(range(first, first + pages * geo.page_size))


# The records each zero-copy object holds, in order: (record, half of it).
OBJECT_RECORDS = {
    "int8": [[("k", None), ("scale", 0)], [("v", None), ("scale", 1)]],
    "int4": [[("k", None), ("k_meta", None)], [("v", None), ("v_meta", None)]],
    "k8v4": [[("k", None), ("k_scale", None)], [("v", None), ("v_meta", None)]],
}
OBJECTS = [
    *[("mooncake", fmt, "page_first_direct") for fmt in ("int8", "int4", "k8v4")],
    ("mooncake", "mla-int8", "page_first_direct"),
    *[
        ("nixl", fmt, layout)
        for fmt in ("int8", "int4", "mla-int8")
        for layout in ("page_first_direct", "layer_first")
    ],
]


@pytest.mark.parametrize("backend,fmt,layout", OBJECTS)
def test_objects_are_the_l2_records_and_their_seal(
    tmp_path, request, backend, fmt, layout
):
    """No re-encoding: each object is byte for byte the pool's page records
    (MLA: its flat page, one `_k` object, no tp rank), then its seal from
    the pool's seal buffer; copy mode's file is the pool's flat page."""
    geo, host_dtype, _ = FORMATS[fmt]
    l3 = make_l3(
        request, tmp_path, backend, host_dtype=host_dtype, geo=geo, layout=layout
    )
    pool = l3.controller.mem_pool_host
    if fmt == "mla-int8":
        assert type(pool) is host_pool_cls("int8", "mla")
    dev, host, hashes, stored = h.write_through(l3, tokens_for(geo, 4), seed=5)
    assert stored == 4
    objects = lf.objects_for(l3)
    for p, page_hash in enumerate(hashes):
        index = int(host[p * geo.page_size])
        flat = pool.get_data_page(index, key=page_hash).numpy().tobytes()
        if not objects.zero_copy:
            assert objects.read(page_hash, "") == flat
            continue
        slot = index // geo.page_size
        for obj, part in enumerate(objects.parts()):
            if fmt == "mla-int8":
                want = flat[:-SEAL_BYTES]
            else:
                pieces = []
                for name, half in OBJECT_RECORDS[fmt][obj]:
                    record = pool.host_records[name][slot].view(torch.uint8).flatten()
                    n = record.numel() // 2
                    pieces.append(record if half is None else record[half * n :][:n])
                want = torch.cat(pieces).numpy().tobytes()
            seal = pool.pages.seals[slot, obj].numpy().tobytes()
            assert objects.read(page_hash, part) == want + seal, (p, part)
    if backend == "mooncake":
        # The key carries the pool's format tag (storage_model_name).
        key = objects.key(hashes[0], "k")
        assert pool.storage_format_tag in key
        if fmt == "mla-int8":
            assert "mla-int8-t128-fp16scale-rope16-v1" in key


# The stock pool moves page_first only with --hicache-io-backend kernel (CUDA);
# "odirect": int8 under SGLang's default O_DIRECT config.
ROUND_TRIP_FORMATS = {**FORMATS, "auto": (GEO16, "auto", 0), "odirect": FORMATS["int8"]}
ROUND_TRIPS = [(fmt, layout) for fmt in FORMATS for layout in LAYOUTS] + [
    (fmt, layout) for fmt in ("auto", "odirect") for layout in LAYOUTS[1:]
]


def round_trip(l3, tokens, seed):
    """Write-through to L3, evict L1 and L2, prefetch back and load to L1;
    returns (page hashes, what L1 must hold)."""
    pool = l3.controller.mem_pool_host
    dev, host, hashes, stored = h.write_through(l3, tokens, seed=seed)
    assert stored == len(tokens) // l3.geo.page_size
    expected = h.device_rows(l3.rig, dev)
    if pool.storage_format_tag is not None:
        expected = reference_restore(pool, expected)
    h.evict_everywhere(l3, dev, host)
    check_restored_to_device(l3, tokens, expected, stored)
    return hashes, expected


@pytest.mark.parametrize("fmt,layout", ROUND_TRIPS)
def test_nixl_round_trip_is_the_reference_decode(
    tmp_path, request, monkeypatch, fmt, layout
):
    if fmt == "odirect":  # a sealed object is never whole OS pages: buffered
        config = {k: v for k, v in lf.NIXL_CONFIG.items() if k != "use_direct_io"}
        monkeypatch.setattr(lf, "NIXL_CONFIG", config)
    geo, host_dtype, _ = ROUND_TRIP_FORMATS[fmt]
    l3 = make_l3(
        request, tmp_path, "nixl", host_dtype=host_dtype, geo=geo, layout=layout
    )
    assert not l3.backend.file_manager.use_direct_io
    assert l3.backend.is_zero_copy == (layout != "layer_first")
    round_trip(l3, tokens_for(geo, 4), seed=3)
    if host_dtype != "auto":
        counts = l3.controller.mem_pool_host.storage_integrity_counts()
        assert counts["verified"] >= 4
        assert not any(counts["refused"].values()), counts


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_nixl_int8_and_int4_never_read_each_others_pages(tmp_path, request, layout):
    int8 = make_l3(request, tmp_path, "nixl", geo=GEO16, layout=layout)
    int4 = make_l3(
        request, tmp_path, "nixl", host_dtype="int4", geo=GEO16, layout=layout
    )
    tokens = tokens_for(GEO16, 4)
    int8_hashes, int8_expected = round_trip(int8, tokens, seed=1)
    # Same tokens, same model: the INT4 pool finds nothing of INT8's.
    assert h.prefetch(int4, tokens + [7]).hit_tokens == 0
    # Different KV under the same tokens, so a crossed read would show.
    _, int4_expected = round_trip(int4, tokens, seed=2)
    check_restored_to_device(int8, tokens, int8_expected, 4)
    check_restored_to_device(int4, tokens, int4_expected, 4)

    # INT4's objects planted under INT8's keys for page 1: refused there.
    ours, theirs = lf.objects_for(int8), lf.objects_for(int4)
    for part in ours.parts():
        ours.write(int8_hashes[1], part, theirs.read(int8_hashes[1], part))
    pool = int8.controller.mem_pool_host
    before = dict(pool.storage_integrity_counts()["refused"])
    pf = h.prefetch(int8, tokens + [7])
    assert pf.hit_tokens == len(tokens)
    assert pf.completed_tokens == GEO16.page_size
    after = pool.storage_integrity_counts()["refused"]
    new = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert sum(new.values()) == 1 and set(new) <= {"missing", "tag"}, new
    pool.free(pf.host_indices)


# A store that fails or lies never corrupts L1/L2.
PARTIAL = [
    # (backend, host dtype, fault, page): a shorter object, or one deleted
    # between the hit query and the read; the stock pool alike.
    *[
        ("mooncake", d, f, p)
        for d in ("auto", "int8")
        for f, p in (("truncate", 3), ("delete", 5))
    ],
    ("file", "int8", "truncate", 3),
    ("file", "int8", "delete", 5),
]


@pytest.mark.parametrize("backend,host_dtype,fault,page", PARTIAL)
def test_bad_object_is_a_miss_from_that_page_on(
    tmp_path, request, backend, host_dtype, fault, page
):
    l3 = make_l3(request, tmp_path, backend, host_dtype=host_dtype)
    dev, host, hashes, stored = h.write_through(l3, TOKENS)
    assert stored == PAGES
    written = h.device_rows(l3.rig, dev)
    h.evict_everywhere(l3, dev, host)
    objects = lf.objects_for(l3)
    before_io = None
    if fault == "truncate":
        part = objects.parts()[0]
        objects.write(hashes[page], part, objects.read(hashes[page], part)[:-16])
    else:
        part = objects.parts()[-1]
        before_io = lambda: objects.write(hashes[page], part, None)  # noqa: E731

    pf = h.prefetch(l3, TOKENS + [7], before_io=before_io)
    assert pf.hit_tokens == len(TOKENS)  # the object exists, so the query hits
    assert pf.completed_tokens == page * GEO.page_size
    assert_restored(
        l3, h.load_to_device(l3, pf.host_indices), expected_restore(written, host_dtype)
    )
    # Every host slot came back: the refused pages hold nothing.
    pool = l3.controller.mem_pool_host
    assert pool.available_size() + page * GEO.page_size == pool.size
    assert l3.controller.prefetch_failed_pages == PAGES - page
    if backend == "file" and fault == "truncate":
        assert pool.storage_integrity.counts()["size"] == 1


def test_master_stopped_mid_run(tmp_path, l3_rigs, request):
    h.require_mooncake()
    m = h.MooncakeMaster(tmp_path / "master.log").start()
    try:
        l3 = h.make_l3_rig(
            "mooncake", m.storage_config(), model_name=f"hiq/{request.node.name}"
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
            "mooncake", m.storage_config(segment_bytes=capacity), geo=geo,
            device_tokens=2048, host_tokens=4096, model_name=f"hiq/{request.node.name}",
        )  # fmt: skip
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


# Page I/O on the pool itself.
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_page_is_k_v_scales_and_round_trips(tmp_path, request, layout):
    l3 = make_l3(request, tmp_path, "file", layout=layout)
    dev, host, _, _ = h.write_through(l3, TOKENS)
    pool = l3.controller.mem_pool_host
    index = int(host[2 * GEO.page_size])
    page = pool.get_data_page(index)
    assert page.dtype == torch.uint8
    assert page.numel() == pool.storage_page_bytes + SEAL_BYTES
    records = [pool.host_records[name] for name in ("k", "v", "scale")]
    if layout == "layer_first":
        parts = [b[:, index : index + GEO.page_size] for b in records]
    else:
        parts = [b[index // GEO.page_size] for b in records]
    expected = torch.cat([x.contiguous().view(torch.uint8).flatten() for x in parts])
    assert torch.equal(page[:-SEAL_BYTES], expected)

    # Into a free page: the records land exactly, nothing else changes.
    free = pool.alloc(GEO.page_size)
    before = [b.clone() for b in pool.kv_buffer]
    pool.set_from_flat_data_page(int(free[0]), page)
    assert torch.equal(pool.get_data_page(int(free[0])), page)
    changed = [(a != b).sum().item() for a, b in zip(before, pool.kv_buffer)]
    assert sum(changed) <= page.numel()


def test_layer_first_has_no_zero_copy_pages(tmp_path, request):
    l3 = make_l3(request, tmp_path, "file", layout="layer_first")
    pool = l3.controller.mem_pool_host
    with pytest.raises(ValueError, match="--hicache-mem-layout page_first"):
        pool.get_page_buffer_meta(torch.arange(GEO.page_size))
    assert not pool.is_stride_page_aligned()
    with pytest.raises(NotImplementedError, match="page_head"):
        pool.get_split_heads_page_buffer_meta(torch.arange(GEO.page_size), 2)
