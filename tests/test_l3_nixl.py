"""Encoded host pages in L3 over SGLang's NIXL backend (--hicache-storage-backend
nixl) with NIXL's POSIX file plugin, through the real HiCacheController
storage threads: every encoded format, page_first and page_first_direct (NIXL
zero-copy: one file per _k/_v object, gathered from the pool's record and
seal buffers) and layer_first (NIXL copy mode: one sealed flat page per file).

- Round trip: what comes back to L1 is bit-identical to the format's reference
  decode of what was written; the stock BF16 pool is the control (bit-exact).
- Isolation: int8 and int4 pages of the same tokens never read each other's,
  not even planted under the other's key.
- Faults (a subset of tests/test_l3_integrity_faults.py, every kind): each
  one refused (a miss for that page, counted by reason, L1 and L2 untouched)
  or restored bit-identical; never a silent corruption.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tests.support import l3_faults as lf
from scripts.rigs import l3_harness as h
from tests.support.l3_faults import (
    FORMATS,
    GEO16,
    check_restored_to_device,
    device_snapshot,
    page_bytes,
    raw,
    reference_restore,
)
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES
from tests.support.conformance import LAYOUTS


def _nixl_unavailable_reason() -> str | None:
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as e:  # ImportError, or a shared library it cannot load
        return (
            f"nixl does not import ({type(e).__name__}: {e}); install "
            "requirements/l3-nixl.txt with pip --no-deps"
        )
    return None


REASON = _nixl_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    pytest.mark.usefixtures("host_ram_not_under_test"),
]

PAGES = 4
# POSIX plugin, buffered I/O (tmp dirs may not take O_DIRECT), no cleaner thread.
NIXL_CONFIG = {
    "plugin": {"posix": {"active": True}},
    "use_direct_io": False,
    "l3_cleaner_enabled": False,
}
KINDS = lf.FAULT_KINDS + ("delete",)
FAULTS_PER_KIND = 2
# A wrong-size object is a miss before it is read (HiCacheNixl._whole_pages);
# the rest is the seal's (tests/test_l3_integrity_faults.py).
EXPECTED = {
    **lf.SEAL_REFUSALS,
    "truncate": {"missing"},
    "extend": {"missing"},
    "foreign": {"missing", "tag"},
    "swap_parts": {"missing", "tag"},
}


TALLY: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if TALLY:
        print(
            f"\nNIXL L3 faults: {TALLY['tried']} tried, {TALLY['refused']} refused, "
            f"{TALLY['identical']} identical, 0 silent (a silent one fails the test)"
        )


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh NIXL FILE directory (the backend reads it at construction)."""
    monkeypatch.setenv("SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR", str(tmp_path))
    return tmp_path


def make_rig(l3_rigs, request, host_dtype, geo, layout):
    l3 = h.make_l3_rig(
        "nixl",
        NIXL_CONFIG,
        host_dtype=host_dtype,
        geo=geo,
        layout=layout,
        model_name=f"hiq/{request.node.name}",
    )
    l3_rigs.append(l3)
    assert l3.backend.__class__.__name__ == "HiCacheNixl"
    return l3


def tokens_for(geo, first=5000):
    return list(range(first, first + PAGES * geo.page_size))


def round_trip(l3, tokens, seed):
    """Write-through to L3, evict L1 and L2, prefetch back and load to L1;
    returns what was written."""
    pool = l3.controller.mem_pool_host
    dev, host, hashes, stored = h.write_through(l3, tokens, seed=seed)
    assert stored == PAGES
    written = h.device_rows(l3.rig, dev)
    expected = written if pool.storage_format_tag is None else None
    if expected is None:
        expected = reference_restore(pool, written)
    h.evict_everywhere(l3, dev, host)
    check_restored_to_device(l3, tokens, expected, PAGES)
    return hashes, expected


# ---------------------------------------------------------------------------
# round trip


# The stock pool moves page_first only with --hicache-io-backend kernel (CUDA).
ROUND_TRIPS = [("auto", "page_first_direct"), ("auto", "layer_first")] + [
    (fmt, layout) for fmt in FORMATS for layout in LAYOUTS
]


@pytest.mark.parametrize("fmt,layout", ROUND_TRIPS)
def test_round_trip_is_the_reference_decode(store, l3_rigs, request, fmt, layout):
    geo, host_dtype, _ = FORMATS.get(fmt, (GEO16, "auto", None))
    l3 = make_rig(l3_rigs, request, host_dtype, geo, layout)
    assert l3.backend.is_zero_copy == (layout != "layer_first")
    round_trip(l3, tokens_for(geo), seed=3)
    pool = l3.controller.mem_pool_host
    if host_dtype != "auto":
        counts = pool.storage_integrity_counts()
        assert counts["verified"] >= PAGES
        assert not any(counts["refused"].values()), counts


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_default_direct_io_serves_sealed_pages_buffered(
    store, l3_rigs, request, layout
):
    # SGLang's default is O_DIRECT; a sealed object is never whole OS pages.
    config = {k: v for k, v in NIXL_CONFIG.items() if k != "use_direct_io"}
    l3 = h.make_l3_rig(
        "nixl", config, host_dtype="int8", geo=GEO16, layout=layout,
        model_name=f"hiq/{request.node.name}",
    )  # fmt: skip
    l3_rigs.append(l3)
    assert not l3.backend.file_manager.use_direct_io
    assert l3.backend.is_zero_copy == (layout != "layer_first")
    round_trip(l3, tokens_for(GEO16), seed=4)


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "mla-int8"])
def test_objects_are_the_l2_records_and_their_seal(
    store, l3_rigs, request, fmt, layout
):
    geo, host_dtype, _ = FORMATS[fmt]
    l3 = make_rig(l3_rigs, request, host_dtype, geo, layout)
    pool = l3.controller.mem_pool_host
    dev, host, hashes, stored = h.write_through(l3, tokens_for(geo), seed=5)
    assert stored == PAGES
    objects = lf.NixlObjects(l3)
    for p, page_hash in enumerate(hashes):
        index = int(host[p * geo.page_size])
        if not objects.zero_copy:
            # Copy mode: the flat page the pool reads out, seal included.
            want = pool.get_data_page(index, key=page_hash).numpy().tobytes()
            assert objects.read(page_hash, "") == want
            continue
        slot = index // geo.page_size
        for obj, (part, pieces) in enumerate(zip(objects.parts(), pool.pages.objects)):
            want = b"".join(
                pool.host_records[name][slot].view(torch.uint8).reshape(-1)
                [offset : offset + size].numpy().tobytes()
                for name, offset, size in pieces
            ) + pool.pages.seals[slot, obj].numpy().tobytes()  # fmt: skip
            assert objects.read(page_hash, part) == want, (p, part)
    assert len(objects.read(hashes[0], objects.parts()[0])) > SEAL_BYTES


# ---------------------------------------------------------------------------
# isolation


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_int8_and_int4_never_read_each_others_pages(store, l3_rigs, request, layout):
    int8 = make_rig(l3_rigs, request, "int8", GEO16, layout)
    int4 = make_rig(l3_rigs, request, "int4", GEO16, layout)
    tokens = tokens_for(GEO16)
    int8_hashes, int8_expected = round_trip(int8, tokens, seed=1)
    # Same tokens, same model: the INT4 pool finds nothing of INT8's.
    assert h.prefetch(int4, tokens + [7]).hit_tokens == 0
    # Different KV under the same tokens, so a crossed read would show.
    _, int4_expected = round_trip(int4, tokens, seed=2)
    check_restored_to_device(int8, tokens, int8_expected, PAGES)
    check_restored_to_device(int4, tokens, int4_expected, PAGES)

    # INT4's objects planted under INT8's keys for page 1: refused there.
    ours, theirs = lf.NixlObjects(int8), lf.NixlObjects(int4)
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


# ---------------------------------------------------------------------------
# faults


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_faults_are_refused_or_restored_exactly(store, l3_rigs, request, fmt, layout):
    geo, host_dtype, foreign_dtype = FORMATS[fmt]
    tokens = tokens_for(geo)
    foreign = make_rig(l3_rigs, request, foreign_dtype, geo, layout)
    fdev, fhost, _, stored = h.write_through(foreign, tokens, seed=7)
    assert stored == PAGES
    h.evict_everywhere(foreign, fdev, fhost)
    l3 = make_rig(l3_rigs, request, host_dtype, geo, layout)
    pool = l3.controller.mem_pool_host
    dev, host, hashes, stored = h.write_through(l3, tokens, seed=3)
    assert stored == PAGES
    reference = reference_restore(pool, h.device_rows(l3.rig, dev))
    written_pages = [page_bytes(pool, host, p) for p in range(PAGES)]
    h.evict_everywhere(l3, dev, host)
    check_restored_to_device(l3, tokens, reference, PAGES)

    objects, foreign_objects = lf.NixlObjects(l3), lf.NixlObjects(foreign)
    layouts = lf.object_layouts(pool, objects.zero_copy)
    rng = random.Random(f"nixl-{fmt}-{layout}")
    outcomes = {}
    for kind in KINDS * FAULTS_PER_KIND:
        page = rng.randrange(PAGES)
        before_io, deleted = None, []
        if kind == "delete":
            part = rng.choice(objects.parts())
            writes, deleted = {}, [(hashes[page], part)]
            before_io = lambda p=part, hh=hashes[page]: objects.write(hh, p, None)  # noqa: E731
        else:
            writes = lf.make_fault(
                kind, rng, objects, layouts, hashes, page, foreign_objects
            )
            if writes is None:  # e.g. no metadata record, or one object per page
                continue
        with lf.faulted(objects, writes, deleted):
            outcome = one_prefetch(
                l3, tokens, before_io, page, written_pages, EXPECTED[kind], kind
            )
        outcomes.setdefault(kind, []).append(outcome)
        TALLY.update(["tried", outcome])
    # Every fault here changes the page's bytes, so each one is refused.
    for kind, seen in outcomes.items():
        assert set(seen) == {"refused"}, (kind, seen)
    assert len(outcomes) >= 9, outcomes
    # And the store still serves every page afterwards.
    check_restored_to_device(l3, tokens, reference, PAGES)


def page_records(pool, index: int, records) -> list[bytes]:
    """The L2 bytes of the page at host token `index`, record by record."""
    ps = pool.page_size
    if pool.layout == "layer_first":
        return [raw(buf[:, index : index + ps]) for buf in records.values()]
    return [raw(buf[index // ps]) for buf in records.values()]


def one_prefetch(l3, tokens, before_io, page, written_pages, allowed, kind):
    """One prefetch over a faulted store: 'refused' (that page a miss, counted
    once with an allowed reason, the pages before it bit-identical, L1 and the
    refused page's L2 slot untouched) or 'identical' (every page as written)."""
    pool = l3.controller.mem_pool_host
    ps = pool.page_size
    refused_before = Counter(pool.storage_integrity.counts())
    l1_before = device_snapshot(l3)
    l2_before = {name: buf.clone() for name, buf in pool.host_records.items()}
    hit, completed, host = lf.prefetch_all(l3, tokens + [7], before_io)
    try:
        refused = Counter(pool.storage_integrity.counts())
        refused.subtract(refused_before)
        new = {k: v for k, v in refused.items() if v}
        delivered = completed // ps
        assert hit == len(tokens), f"{kind}: hit query found {hit} tokens"
        for p in range(delivered):
            assert page_bytes(pool, host, p) == written_pages[p], (kind, p)
        assert l1_before == device_snapshot(l3), f"{kind}: L1 changed"
        if delivered == PAGES:
            assert not new, f"{kind}: counted {new} yet delivered every page"
            return "identical"
        assert delivered == page, f"{kind}: stopped at page {delivered}, not {page}"
        assert sum(new.values()) == 1, f"{kind}: refusals counted {new}"
        assert set(new) <= allowed, f"{kind}: refused as {new}, expected {allowed}"
        # No byte of the refused page is in L2: zeroed after a zero-copy get,
        # never written by the copy mode (the slot was never filled here).
        index = int(host[page * ps])
        slot = page_records(pool, index, pool.host_records)
        if lf.objects_for(l3).zero_copy:
            assert all(r == bytes(len(r)) for r in slot), f"{kind}: bytes left in L2"
        else:
            before = page_records(pool, index, l2_before)
            assert slot == before, f"{kind}: refused page changed L2"
        return "refused"
    finally:
        pool.free(host)
