"""Random faults (lf.FAULT_KINDS, and objects deleted between the hit query and
the read) in stored L3 pages of every format on `file`, Mooncake and NIXL, through
SGLang's real storage threads: each is refused or restored bit-identical."""

from __future__ import annotations

import os
import random
from collections import Counter, defaultdict

import pytest

from scripts.rigs import l3_harness as h
from tests.support import l3_faults as lf
from tests.support.l3_faults import (
    FORMATS,
    check_restored_to_device,
    device_snapshot,
    page_bytes,
    raw,
    reference_restore,
)

pytestmark = pytest.mark.usefixtures("host_ram_not_under_test")

PAGES = 6
KINDS = lf.FAULT_KINDS + ("delete",)
# backend id -> (backend, layout, faults per row): file and Mooncake give
# >= 1000 faults each (Mooncake rewrites wait out the read lease), NIXL two a kind.
BACKENDS = {
    "file": ("file", "page_first_direct", 160),
    "mooncake": ("mooncake", "page_first_direct", 96),
    "nixl": ("nixl", "page_first_direct", 2 * len(KINDS)),
    "nixl-copy": ("nixl", "layer_first", 2 * len(KINDS)),
}
SCALE = float(os.environ.get("HIQ_L3_FAULTS_SCALE", "1"))
# Mooncake and NIXL refuse an object of the wrong size before the seal is
# read (patch 0011 and the store; HiCacheNixl._whole_pages): a miss.
DELIVERS_NO_WRONG_SIZE = {
    "truncate": {"missing"},
    "extend": {"missing"},
    "foreign": {"missing", "tag"},
    "swap_parts": {"missing", "tag"},
}
EXPECTED = {
    "file": {"truncate": {"size"}, "extend": {"size"}, "foreign": {"size", "tag"}},
    "mooncake": DELIVERS_NO_WRONG_SIZE,
    "nixl": DELIVERS_NO_WRONG_SIZE,
}

TALLY: dict = defaultdict(Counter)
COLUMNS = ("tried", "refused", "identical", "silent")


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if not TALLY:
        return
    total = sum(TALLY.values(), Counter())
    lines = [f"{'fault kind':<16}" + "".join(f"{c:>10}" for c in COLUMNS)]
    for kind, c in [*((k, TALLY[k]) for k in KINDS), ("all", total)]:
        lines.append(f"{kind:<16}" + "".join(f"{c[col]:>10}" for col in COLUMNS))
    reasons = ", ".join(
        f"{k[2:]} {v}" for k, v in sorted(total.items()) if k.startswith("r:")
    )
    print("\nL3 fault injection:\n" + "\n".join(lines))
    print(f"refused by reason: {reasons}")


@pytest.mark.parametrize("backend_id", list(BACKENDS))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_random_faults_are_refused_or_restored_exactly(
    tmp_path, request, l3_rigs, backend_id, fmt
):
    backend, layout, faults = BACKENDS[backend_id]
    geo, host_dtype, foreign_dtype = FORMATS[fmt]
    tokens = list(range(5000, 5000 + PAGES * geo.page_size))
    kw = dict(geo=geo, layout=layout)
    foreign = lf.make_l3(request, tmp_path, backend, host_dtype=foreign_dtype, **kw)
    fdev, fhost, _, stored = h.write_through(foreign, tokens, seed=7)
    assert stored == PAGES
    h.evict_everywhere(foreign, fdev, fhost)
    l3 = lf.make_l3(request, tmp_path, backend, host_dtype=host_dtype, **kw)
    if backend == "nixl":
        assert l3.backend.__class__.__name__ == "HiCacheNixl"
    pool = l3.controller.mem_pool_host
    dev, host, hashes, stored = h.write_through(l3, tokens, seed=3)
    assert stored == PAGES
    reference = reference_restore(pool, h.device_rows(l3.rig, dev))
    written_pages = [page_bytes(pool, host, p) for p in range(PAGES)]
    h.evict_everywhere(l3, dev, host)
    # Clean read first: every page restores to the format's reference decode.
    check_restored_to_device(l3, tokens, reference, PAGES)

    objects, foreign_objects = lf.objects_for(l3), lf.objects_for(foreign)
    layouts = lf.object_layouts(pool, objects.zero_copy)
    expected = {**lf.SEAL_REFUSALS, **EXPECTED[backend]}
    rng = random.Random(f"{fmt}-{backend_id}")
    kinds, outcomes, done = list(KINDS), defaultdict(set), 0
    faults = max(len(KINDS), round(faults * SCALE))
    while done < faults:
        kind = kinds[done % len(kinds)]
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
                kinds.remove(kind)
                continue
        with lf.faulted(objects, writes, deleted):
            outcome = one_prefetch(
                l3, tokens, before_io, page, written_pages, expected[kind], kind
            )
        TALLY[kind].update(["tried", outcome])
        outcomes[kind].add(outcome)
        done += 1
        # Now and then, the restored prefix all the way to L1 as well.
        if done % 32 == 0:
            check_restored_to_device(l3, tokens, reference, PAGES)
    if backend == "nixl":
        # Every NIXL fault here changes the page's bytes: each one is refused.
        assert all(seen == {"refused"} for seen in outcomes.values()), outcomes
        assert len(outcomes) >= 9, outcomes
    # The store still serves every page afterwards.
    check_restored_to_device(l3, tokens, reference, PAGES)


def page_records(pool, index: int, records) -> list[bytes]:
    """The L2 bytes of the page at host token `index`, record by record."""
    ps = pool.page_size
    if pool.layout == "layer_first":
        return [raw(buf[:, index : index + ps]) for buf in records.values()]
    return [raw(buf[index // ps]) for buf in records.values()]


def one_prefetch(l3, tokens, before_io, page, written_pages, allowed, kind):
    ctl, pool = l3.controller, l3.controller.mem_pool_host
    ps = pool.page_size
    refused_before = Counter(pool.storage_integrity.counts())
    failed_before = ctl.prefetch_failed_pages
    l1_before = device_snapshot(l3)
    l2_before = {name: buf.clone() for name, buf in pool.host_records.items()}
    hit, completed, host = h.prefetch_to_host(
        l3, tokens + [7], before_io=before_io, stop_on_miss=False
    )
    refused = Counter(pool.storage_integrity.counts())
    refused.subtract(refused_before)
    new = {k: v for k, v in refused.items() if v}
    delivered = completed // ps
    try:
        assert hit == len(tokens), f"{kind}: hit query found {hit} tokens"
        for p in range(delivered):
            if page_bytes(pool, host, p) != written_pages[p]:
                TALLY[kind].update(["tried", "silent"])
                raise AssertionError(f"{kind}: page {p} restored with other bytes")
        assert l1_before == device_snapshot(l3), f"{kind}: L1 changed"
        failed = ctl.prefetch_failed_pages - failed_before
        if delivered == len(written_pages):
            # Not refused: allowed only where every page read back is exactly
            # the page written (checked above).
            assert not new and not failed, f"{kind}: counted {new}, {failed} failed"
            return "identical"
        assert delivered == page, f"{kind}: stopped at page {delivered}, not {page}"
        assert failed == len(written_pages) - page, (kind, failed)
        assert sum(new.values()) == 1, f"{kind}: refusals counted {new}"
        (reason,) = new
        assert reason in allowed, f"{kind}: refused as {reason}, expected {allowed}"
        TALLY[kind]["r:" + reason] += 1
        # No byte of the refused page in L2: zeroed after a zero-copy get,
        # untouched otherwise (refused before the copy).
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
