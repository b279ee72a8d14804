"""Sealed L3 pages (pool_host/page_integrity.py) through SGLang's real storage
threads on `file`, Mooncake and NIXL: refusals never reach L2, are counted and
logged once by reason, and refused pages are replaced at their next write."""

from __future__ import annotations

import dataclasses
import logging
import struct

import pytest
import torch

from scripts.rigs import l3_harness as h
from scripts.rigs.hicache_harness import Geometry, fill_random, finish_transfers
from sglang.srt.mem_cache.pool_host import page_integrity
from sglang.srt.mem_cache.pool_host.page_integrity import (
    SEAL_BYTES,
    StoragePageRefused,
)
from tests.support import l3_faults as lf
from tests.support.l3_faults import (
    check_restored_to_device,
    make_l3,
    reference_restore,
)

GEO = Geometry(layer_num=3, head_num=2, head_dim=16, page_size=4)
PAGES = 6
TOKENS = list(range(7000, 7000 + PAGES * GEO.page_size))
BAD = 3  # the page a test corrupts

pytestmark = pytest.mark.usefixtures("host_ram_not_under_test")


def corrupt(l3, page_hash, kind):
    """A payload flip or 8 more bytes (NIXL writes over a file in place,
    keeping a longer file's tail) in the first object of a stored page."""
    objects = lf.objects_for(l3)
    part = objects.parts()[0]
    data = objects.read(page_hash, part)
    if kind == "flip":
        data = data[:5] + bytes([data[5] ^ 0x10]) + data[6:]
    else:
        data += b"\x01" * 8
    objects.write(page_hash, part, data)


def written_then_evicted(l3, tokens=TOKENS, seed=0):
    dev, host, hashes, stored = h.write_through(l3, tokens, seed=seed)
    assert stored == len(tokens) // l3.geo.page_size
    written = h.device_rows(l3.rig, dev)
    h.evict_everywhere(l3, dev, host)
    return written, hashes


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_each_reason_is_counted_and_logged_once(
    tmp_path, request, backend, caplog, monkeypatch
):
    """Each bad object is a miss for that page only; `file` also reads objects
    of the wrong length (a size refusal)."""
    monkeypatch.setattr(page_integrity, "_logged_reasons", set())
    l3 = make_l3(request, tmp_path, backend)
    pool = l3.controller.mem_pool_host
    _, hashes = written_then_evicted(l3)
    objects = lf.objects_for(l3)
    part = objects.parts()[0]
    good = objects.read(hashes[BAD], part)
    other = objects.read(hashes[BAD + 1], part)
    flipped = good[:5] + bytes([good[5] ^ 0x10]) + good[6:]
    caplog.set_level(logging.WARNING, logger=page_integrity.__name__)
    bad = [flipped, flipped, other, bytes(len(good))]
    sizes = 3 if backend == "file" else 0
    bad += [good + b"\0", good[:-1], b""][:sizes]
    for data in bad:
        objects.write(hashes[BAD], part, data)
        pf = h.prefetch(l3, TOKENS + [7])
        assert pf.completed_tokens == BAD * GEO.page_size, len(data)
        pool.free(pf.host_indices)
    objects.write(hashes[BAD], part, good)
    assert h.prefetch(l3, TOKENS + [7]).completed_tokens == len(TOKENS)
    counts = pool.storage_integrity.counts()
    want = {"missing": 0, "size": sizes, "seal": 1, "tag": 0, "key": 1, "checksum": 2}
    assert counts == want
    logged = [r for r in caplog.records if "L3 page refused" in r.getMessage()]
    reasons = [r.getMessage().split("(")[1].split(")")[0] for r in logged]
    assert reasons == ["checksum", "key", "seal", "size"][: 4 if sizes else 3]


def _flipped(page: torch.Tensor, at: int) -> torch.Tensor:
    out = page.clone()
    out[at] ^= 1
    return out


def _seal_field(page: torch.Tensor, at: int, fmt: str, delta: int) -> torch.Tensor:
    """`page` with one seal field (at byte `at`) re-packed to its value + delta."""
    raw = bytearray(page.numpy().tobytes())
    struct.pack_into(fmt, raw, at, struct.unpack_from(fmt, raw, at)[0] + delta)
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


# reason -> (bad page from the good one and the payload size, key); the seal
# starts at `n`: version at +4, stated payload length at +24.
FLAT_PAGE_FAULTS = {
    "key": (lambda page, n: page, "page-b"),
    "size": (lambda page, n: page[:-1], "page-a"),
    "checksum": (lambda page, n: _flipped(page, 0), "page-a"),
    "seal": (lambda page, n: _flipped(page, n), "page-a"),
    # One field alone wrong, every other field and the object length right.
    "seal-version": (lambda page, n: _seal_field(page, n + 4, "<H", 1), "page-a"),
    "size-stated": (lambda page, n: _seal_field(page, n + 24, "<Q", 1), "page-a"),
}


def test_flat_page_refusals_name_the_reason(tmp_path, request):
    l3 = make_l3(request, tmp_path, "file")
    pool = l3.controller.mem_pool_host
    _, host, _, _ = h.write_through(l3, TOKENS)
    page = pool.get_data_page(int(host[0]), key="page-a")
    n = pool.storage_page_bytes
    assert page.numel() == n + SEAL_BYTES
    free = int(pool.alloc(GEO.page_size)[0])
    before = [b.clone() for b in pool.kv_buffer]
    for case, (bad, key) in FLAT_PAGE_FAULTS.items():
        reason = case.split("-")[0]
        data = bad(page, n)
        counted = pool.storage_integrity.counts()[reason]
        with pytest.raises(StoragePageRefused, match=reason) as err:
            pool.set_from_flat_data_page(free, data.clone(), key=key)
        assert err.value.reason.value == reason, case
        assert pool.storage_integrity.counts()[reason] == counted + 1, case
    # Without a key (no seal check): a page of the wrong size is still refused.
    for bad in (page[:-1], torch.cat([page, page[:1]])):
        with pytest.raises(ValueError, match="expected"):
            pool.set_from_flat_data_page(free, bad.clone().fill_(1))
    # Nothing reached the pool; the good page still does.
    assert all(torch.equal(a, b) for a, b in zip(before, pool.kv_buffer))
    pool.set_from_flat_data_page(free, page, key="page-a")
    assert torch.equal(pool.get_data_page(free, key="page-a"), page)


def test_sealed_pages_have_their_own_storage_tag(tmp_path, request):
    """Pages written before sealing (unsealed tag) are a miss by key."""
    l3 = make_l3(request, tmp_path, "file")
    pool = l3.controller.mem_pool_host
    base = pool.host_format.storage_format_tag
    assert pool.storage_format_tag == f"{base}-{page_integrity.SEAL_TAG}"
    h.write_through(l3, TOKENS)
    names = [p.name for p in tmp_path.glob("*.bin")]
    assert names and all(pool.storage_format_tag in n for n in names)


# --- non-finite scales on the way in -----------------------------------------

NONFINITE = [("file", name) for name in lf.FORMATS] + [("mooncake", "int8")]


@pytest.mark.parametrize("backend,fmt", NONFINITE)
def test_nonfinite_pages_loaded_from_l3_are_counted_in_pages(
    tmp_path, request, backend, fmt
):
    """Three non-finite groups in page 1 and one in page 4: two pages."""
    mla = fmt == "mla-int8"
    geo = (
        lf.GEO_MLA
        if mla
        else Geometry(layer_num=2, head_num=2, head_dim=64, page_size=4)
    )
    host_dtype = "int8" if mla else fmt
    l3 = make_l3(request, tmp_path, backend, host_dtype=host_dtype, geo=geo)
    pool, ps = l3.controller.mem_pool_host, geo.page_size
    tokens = list(range(9000, 9000 + 6 * ps))

    def poison(device_pool, dev):
        nan, inf = float("nan"), float("inf")
        if mla:
            rank, kv = device_pool.kv_lora_rank, device_pool.kv_buffer
            kv[0][dev[ps], 0, 3] = nan  # page 1: a latent tile ...
            kv[0][dev[ps], 0, 4] = nan
            kv[1][dev[ps + 1], 0, rank + 1] = inf  # ... and a RoPE row
            kv[0][dev[4 * ps + 2], 0, rank + 5] = nan  # page 4
            return
        k, v = device_pool.k_buffer, device_pool.v_buffer
        k[0][dev[ps], 0, 3] = nan  # page 1: two key rows and a value group
        k[0][dev[ps + 1], 0, 3] = nan
        v[1][dev[ps + 2], 1, 0] = inf
        k[1][dev[4 * ps + 3], 1, 60] = nan  # page 4

    dev, host, _, stored = h.write_through(l3, tokens, edit=poison)
    assert stored == 6
    assert pool.nonfinite_group_count() >= 3
    h.evict_everywhere(l3, dev, host)
    pf = h.prefetch(l3, tokens + [7])
    assert pf.completed_tokens == len(tokens)
    counts = pool.storage_integrity_counts()
    assert counts["verified"] == 6
    assert counts["nonfinite_pages_loaded"] == 2
    if fmt == "int8":
        # The whole head row of a non-finite value restores as NaN, nothing else.
        dev, device = h.load_to_device(l3, pf.host_indices), l3.rig.device_pool
        (k0, k1), v1 = (b[dev] for b in device.k_buffer), device.v_buffer[1][dev]
        for row in (k0[ps, 0], k0[ps + 1, 0], v1[ps + 2, 1], k1[4 * ps + 3, 1]):
            assert row.isnan().all()
        bufs = (*device.k_buffer, *device.v_buffer)
        assert sum(int(b[dev].isnan().sum()) for b in bufs) == 4 * geo.head_dim


# --- a refused page is replaced at its next write ----------------------------
# The controller remembers the keys from the first page a prefetch could not
# use and deletes their objects before the recomputed pages' write-back, which
# the backends would otherwise skip (the key exists) or write over in place.

# backend id -> (backend, layout)
BACKENDS = {
    "file": ("file", "page_first_direct"),
    "mooncake": ("mooncake", "page_first_direct"),
    "nixl": ("nixl", "page_first_direct"),  # zero-copy: _k/_v files
    "nixl-copy": ("nixl", "layer_first"),  # one sealed flat page per file
}
# A flip fails the checksum; a longer object is `file`'s size refusal, while
# Mooncake and NIXL deliver no object.
REASONS = {"flip": "checksum", "extend": "missing", ("extend", "file"): "size"}


def make(request, tmp_path, backend_id, **kwargs):
    backend, layout = BACKENDS[backend_id]
    return make_l3(request, tmp_path, backend, layout=layout, **kwargs)


def write_back(l3, tokens, hashes, first_page: int, seed: int):
    """The radix cache after a partial hit: new KV from `first_page` on, to L2 and
    L3 under their keys: (device, host indices, device rows, pages stored)."""
    ctl, rig, ps = l3.controller, l3.rig, l3.geo.page_size
    dev = rig.allocator.alloc(len(tokens) - first_page * ps)
    fill_random(rig.device_pool, dev, seed=seed)
    host = ctl.write(dev, node_id=0)
    assert host is not None, "host pool full"
    ctl.start_writing()
    finish_transfers(ctl)
    op_id = ctl.write_storage(
        host, tokens[first_page * ps :], hash_value=hashes[first_page:]
    )
    op = ctl.ack_backup_queue.get(timeout=h.STORAGE_WAIT_S)
    assert op.id == op_id
    return dev, host, h.device_rows(rig, dev), op.completed_tokens // ps


REPLACED = [
    *[(b, f, "mha") for b in BACKENDS for f in ("flip", "extend")],
    # One object per page on every backend (MLA: `_k` only).
    *[(b, "extend", "mla") for b in ("file", "mooncake", "nixl")],
]


@pytest.mark.parametrize("backend_id,fault,kind", REPLACED)
def test_refused_page_is_replaced_at_the_next_write(
    tmp_path, request, backend_id, fault, kind
):
    """Corrupt page 2, read it (refused), write the recomputed pages back: a hit."""
    geo = lf.GEO_MLA if kind == "mla" else GEO
    l3 = make(request, tmp_path, backend_id, geo=geo)
    ctl, pool, ps, bad = l3.controller, l3.controller.mem_pool_host, geo.page_size, 2
    tokens = TOKENS[: PAGES * ps]
    first, hashes = written_then_evicted(l3, tokens)
    corrupt(l3, hashes[bad], fault)

    # Refused and counted: the pages before it are the hit.
    pf = h.prefetch(l3, tokens + [7])
    assert pf.completed_tokens == bad * ps
    pool.free(pf.host_indices)
    refused = pool.storage_integrity_counts()["refused"]
    reason = REASONS.get((fault, BACKENDS[backend_id][0]), REASONS[fault])
    assert refused[reason] == 1 and sum(refused.values()) == 1, refused

    # The write-back replaces the refused page and the unverified ones after it.
    dev2, host2, second, stored = write_back(l3, tokens, hashes, bad, seed=1)
    assert stored == PAGES - bad
    assert pool.storage_integrity_counts()["replaced"] == PAGES - bad
    assert ctl.storage_keys_to_replace == {}
    h.evict_everywhere(l3, dev2, host2)

    written = [torch.cat([a[: bad * ps], b]) for a, b in zip(first, second)]
    check_restored_to_device(l3, tokens, reference_restore(pool, written), PAGES)
    assert pool.storage_integrity_counts()["refused"] == refused  # none new


@pytest.mark.parametrize("change", ["device_dtype", "layers"])
@pytest.mark.parametrize("backend_id", ["file", "nixl"])
def test_restart_with_another_geometry_replaces_old_pages_once(
    tmp_path, request, backend_id, change
):
    """Old pages of another device dtype (same size, another seal tag) or layer
    count (another size) are refused once; the write-back replaces all. (A
    Mooncake client's objects live in its own segment.)"""
    model = f"hiq/{request.node.name}"
    old = make(request, tmp_path, backend_id, model_name=model)
    _, _, hashes, stored = h.write_through(old, TOKENS, seed=0)
    assert stored == PAGES
    old.close()

    if change == "device_dtype":
        geo = dataclasses.replace(GEO, dtype=torch.float16)
    else:
        geo = dataclasses.replace(GEO, layer_num=GEO.layer_num - 1)
    l3 = make(request, tmp_path, backend_id, geo=geo, model_name=model)
    pool = l3.controller.mem_pool_host

    pf = h.prefetch(l3, TOKENS + [7])
    assert pf.hit_tokens == len(TOKENS)  # the old objects are there, by key
    assert pf.completed_tokens == 0
    refused = pool.storage_integrity_counts()["refused"]
    assert sum(refused.values()) == 1, refused

    dev, host, written, stored = write_back(l3, TOKENS, hashes, 0, seed=2)
    assert stored == PAGES
    assert pool.storage_integrity_counts()["replaced"] == PAGES
    h.evict_everywhere(l3, dev, host)
    check_restored_to_device(l3, TOKENS, reference_restore(pool, written), PAGES)
    assert pool.storage_integrity_counts()["refused"] == refused  # once


@pytest.mark.parametrize("backend_id", ["mooncake", "nixl"])
def test_zero_copy_slots_after_a_refused_page_are_zeroed(tmp_path, request, backend_id):
    """A zero-copy batch get fills every page's host slots before the pool
    checks them; after a refused page none of the batch's bytes stay in L2."""
    l3 = make(request, tmp_path, backend_id)
    pool, ps, bad = l3.controller.mem_pool_host, GEO.page_size, 2
    _, hashes = written_then_evicted(l3)
    corrupt(l3, hashes[bad], "flip")

    hit, completed, slots = h.prefetch_to_host(l3, TOKENS + [7], stop_on_miss=False)
    assert (hit, completed) == (len(TOKENS), bad * ps)
    pages = slots[::ps] // ps
    for name, buf in (*pool.host_records.items(), ("seals", pool.pages.seals)):
        assert bool(buf[pages[:bad]].any()), name  # the hit, restored
        assert not buf[pages[bad:]].any(), name
    pool.free(slots)


@pytest.mark.parametrize(
    "host_dtype,fault,kept", [("int8", "flip", 3), ("auto", "extend", 0)]
)
def test_remembered_keys_are_bounded_oldest_first_and_stock_pool_keeps_none(
    tmp_path, request, monkeypatch, host_dtype, fault, kept
):
    """The stock BF16 pool keeps upstream's path: a page it cannot use (here a
    file of another size) is a miss, and its next write skips the key."""
    from sglang.srt.managers import cache_controller

    monkeypatch.setattr(cache_controller, "STORAGE_KEYS_TO_REPLACE_MAX", 3)
    l3 = make(request, tmp_path, "file", host_dtype=host_dtype)
    _, hashes = written_then_evicted(l3)
    corrupt(l3, hashes[2], fault)
    pf = h.prefetch(l3, TOKENS + [7])
    assert pf.completed_tokens == 2 * GEO.page_size
    l3.controller.mem_pool_host.free(pf.host_indices)
    remembered = list(l3.controller.storage_keys_to_replace)
    assert remembered == hashes[len(hashes) - kept :]
