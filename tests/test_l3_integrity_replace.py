"""A refused L3 page is replaced at its next write, through SGLang's real
HiCacheController storage threads, on `file`, on MooncakeStore against a real
mooncake_master and on HiCacheNixl (NIXL's POSIX plugin): the controller
remembers the keys from the first page a prefetch could not use and deletes
their stored objects before the write-back of the recomputed pages, which the
backends would otherwise skip (the key exists) or write over in place (NIXL
keeps a longer file's tail). Also: a restart with another device dtype or
geometry on the same directory and model name, and the host slots a zero-copy
batch get filled after a refused page.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support import l3_faults as lf
from scripts.rigs import l3_harness as h
from scripts.rigs.hicache_harness import Geometry, fill_random, finish_transfers
from tests.support.l3_faults import reference_restore

GEO = Geometry(layer_num=3, head_num=2, head_dim=16, page_size=4)
PAGES = 6
TOKENS = list(range(9000, 9000 + PAGES * GEO.page_size))
BAD = 2  # the page a test corrupts
# POSIX plugin, buffered I/O, no cleaner thread (as tests/test_l3_nixl.py).
NIXL_CONFIG = {
    "plugin": {"posix": {"active": True}},
    "use_direct_io": False,
    "l3_cleaner_enabled": False,
}
# backend id -> (backend, layout)
BACKENDS = {
    "file": ("file", "page_first_direct"),
    "mooncake": ("mooncake", "page_first_direct"),
    "nixl": ("nixl", "page_first_direct"),  # zero-copy: _k/_v files
    "nixl-copy": ("nixl", "layer_first"),  # one sealed flat page per file
}
# What each fault is refused as: the seal's checksum, or an object of another
# length (`file` checks it in the pool; Mooncake and NIXL deliver no object).
REASONS = {
    ("flip", "file"): "checksum",
    ("flip", "mooncake"): "checksum",
    ("flip", "nixl"): "checksum",
    ("extend", "file"): "size",
    ("extend", "mooncake"): "missing",
    ("extend", "nixl"): "missing",
}

pytestmark = pytest.mark.usefixtures("host_ram_not_under_test")


def nixl_unavailable_reason() -> str | None:
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as e:  # ImportError, or a shared library it cannot load
        return f"nixl does not import ({type(e).__name__}: {e})"
    return None


def storage_config(request, tmp_path, backend):
    if backend == "mooncake":
        return request.getfixturevalue("short_lease_master").storage_config()
    if backend == "nixl":
        reason = nixl_unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setenv("SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR", str(tmp_path))
        return NIXL_CONFIG
    return h.file_storage_config(tmp_path)


def make(request, tmp_path, backend_id, l3_rigs, geo=GEO, model=None):
    backend, layout = BACKENDS[backend_id]
    l3 = h.make_l3_rig(
        backend,
        storage_config(request, tmp_path, backend),
        host_dtype="int8",
        geo=geo,
        layout=layout,
        model_name=model or f"hiq/{request.node.name}",
    )
    l3_rigs.append(l3)
    return l3


def write_back(l3, tokens, hashes, first_page: int, seed: int):
    """What the radix cache does after a partial hit: new KV for the pages
    from `first_page` on, written to L2 and then to L3 under their keys.
    Returns (device indices, host indices, device rows, pages L3 accepted)."""
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
    rows = h.device_rows(rig, dev)
    return dev, host, rows, op.completed_tokens // ps


def corrupt(l3, page_hash, kind):
    objects = lf.objects_for(l3)
    part = objects.parts()[0]
    data = objects.read(page_hash, part)
    if kind == "flip":
        data = data[:5] + bytes([data[5] ^ 0x10]) + data[6:]
    else:  # extend: NIXL writes over a file in place, keeping its tail
        data += b"\x01" * 8
    objects.write(page_hash, part, data)


def restore_and_check(l3, tokens, reference):
    """Prefetch every page, load it to L1 and compare bit for bit."""
    pf = h.prefetch(l3, tokens + [7])
    assert pf.completed_tokens == len(tokens)
    dev = h.load_to_device(l3, pf.host_indices)
    for got, want in zip(h.device_rows(l3.rig, dev), reference):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    h.evict_everywhere(l3, dev, pf.host_indices)


def check_replaced(l3, backend_id, fault):
    """Corrupt page BAD, read it (refused, counted), write the recomputed
    pages back, read again: a hit, bit-identical to what was written."""
    ctl, pool, ps = l3.controller, l3.controller.mem_pool_host, l3.geo.page_size
    tokens = TOKENS[: PAGES * ps]
    dev, host, hashes, stored = h.write_through(l3, tokens, seed=0)
    assert stored == PAGES
    first = h.device_rows(l3.rig, dev)
    h.evict_everywhere(l3, dev, host)
    corrupt(l3, hashes[BAD], fault)

    # Refused and counted: the pages before it are the hit.
    pf = h.prefetch(l3, tokens + [7])
    assert pf.completed_tokens == BAD * ps
    pool.free(pf.host_indices)
    refused = pool.storage_integrity_counts()["refused"]
    reason = REASONS[fault, BACKENDS[backend_id][0]]
    assert refused[reason] == 1 and sum(refused.values()) == 1, refused

    # The recomputed pages' write-back replaces the refused page and the
    # unverified ones after it.
    dev2, host2, second, stored = write_back(l3, tokens, hashes, BAD, seed=1)
    assert stored == PAGES - BAD
    counts = pool.storage_integrity_counts()
    assert counts["replaced"] == PAGES - BAD
    assert ctl.storage_keys_to_replace == {}
    h.evict_everywhere(l3, dev2, host2)

    # Now a hit, bit-identical to the reference decode of what was written.
    written = [torch.cat([a[: BAD * ps], b]) for a, b in zip(first, second)]
    restore_and_check(l3, tokens, reference_restore(pool, written))
    assert pool.storage_integrity_counts()["refused"] == refused  # none new


@pytest.mark.parametrize("fault", ["flip", "extend"])
@pytest.mark.parametrize("backend_id", list(BACKENDS))
def test_refused_page_is_replaced_at_the_next_write(
    tmp_path, l3_rigs, request, backend_id, fault
):
    l3 = make(request, tmp_path, backend_id, l3_rigs)
    check_replaced(l3, backend_id, fault)


@pytest.mark.parametrize("backend_id", ["file", "mooncake", "nixl"])
def test_refused_mla_page_is_replaced_at_the_next_write(
    tmp_path, l3_rigs, request, backend_id
):
    # One object per page on every backend (MLA: `_k` only).
    l3 = make(request, tmp_path, backend_id, l3_rigs, geo=lf.GEO_MLA)
    check_replaced(l3, backend_id, "extend")


@pytest.mark.parametrize("change", ["device_dtype", "layers"])
@pytest.mark.parametrize("backend_id", ["file", "nixl"])
def test_restart_with_another_geometry_replaces_old_pages_once(
    tmp_path, l3_rigs, request, backend_id, change
):
    """The same L3 directory and model name, a server restarted with another
    device dtype (same object sizes, another seal tag) or layer count (another
    object size): the first old page of a prefix is refused once, the
    write-back replaces all of them. (A Mooncake client's objects live in its
    own segment, so they do not outlive it in this rig.)"""
    model = f"hiq/{request.node.name}"
    old = make(request, tmp_path, backend_id, l3_rigs, model=model)
    dev, host, hashes, stored = h.write_through(old, TOKENS, seed=0)
    assert stored == PAGES
    old.close()

    if change == "device_dtype":
        geo = dataclasses.replace(GEO, dtype=torch.float16)
    else:
        geo = dataclasses.replace(GEO, layer_num=GEO.layer_num - 1)
    l3 = make(request, tmp_path, backend_id, l3_rigs, geo=geo, model=model)
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
    restore_and_check(l3, TOKENS, reference_restore(pool, written))
    assert pool.storage_integrity_counts()["refused"] == refused  # once


@pytest.mark.parametrize("backend_id", ["mooncake", "nixl"])
def test_zero_copy_slots_after_a_refused_page_are_zeroed(
    tmp_path, l3_rigs, request, backend_id
):
    """A zero-copy batch get fills every page's host slots before the pool
    checks them; after a refused page none of the batch's bytes stay in L2."""
    l3 = make(request, tmp_path, backend_id, l3_rigs)
    pool, ps = l3.controller.mem_pool_host, GEO.page_size
    dev, host, hashes, _ = h.write_through(l3, TOKENS, seed=0)
    h.evict_everywhere(l3, dev, host)
    corrupt(l3, hashes[BAD], "flip")

    hit, completed, slots = lf.prefetch_all(l3, TOKENS + [7])
    assert (hit, completed) == (len(TOKENS), BAD * ps)
    pages = slots[::ps] // ps
    for name, buf in (*pool.host_records.items(), ("seals", pool.pages.seals)):
        assert bool(buf[pages[:BAD]].any()), name  # the hit, restored
        assert not buf[pages[BAD:]].any(), name
    pool.free(slots)


def test_remembered_keys_are_bounded_oldest_first(
    tmp_path, l3_rigs, request, monkeypatch
):
    from sglang.srt.managers import cache_controller

    monkeypatch.setattr(cache_controller, "STORAGE_KEYS_TO_REPLACE_MAX", 3)
    l3 = make(request, tmp_path, "file", l3_rigs)
    dev, host, hashes, _ = h.write_through(l3, TOKENS, seed=0)
    h.evict_everywhere(l3, dev, host)
    corrupt(l3, hashes[BAD], "flip")
    pf = h.prefetch(l3, TOKENS + [7])
    l3.controller.mem_pool_host.free(pf.host_indices)
    assert list(l3.controller.storage_keys_to_replace) == hashes[-3:]


def test_stock_pool_remembers_no_keys(tmp_path, l3_rigs, request):
    """The stock BF16 pool keeps upstream's path: a page it cannot use (here
    a file of another size) is a miss, and its next write skips the key."""
    backend, layout = BACKENDS["file"]
    l3 = h.make_l3_rig(
        backend,
        h.file_storage_config(tmp_path),
        host_dtype="auto",
        geo=GEO,
        layout=layout,
        model_name=f"hiq/{request.node.name}",
    )
    l3_rigs.append(l3)
    dev, host, hashes, _ = h.write_through(l3, TOKENS, seed=0)
    h.evict_everywhere(l3, dev, host)
    corrupt(l3, hashes[BAD], "extend")
    pf = h.prefetch(l3, TOKENS + [7])
    assert pf.completed_tokens == BAD * GEO.page_size
    l3.controller.mem_pool_host.free(pf.host_indices)
    assert l3.controller.storage_keys_to_replace == {}
