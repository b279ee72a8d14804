"""Sealed L3 pages (pool_host/page_integrity.py) through SGLang's real
HiCacheController storage threads, on the `file` backend and on MooncakeStore
against a real mooncake_master: a page whose bytes do not match its seal
never reaches L2, the pages before it still do, and each refusal is counted
by reason, logged once per reason and exported as a metric. Pages restored
with non-finite scales are counted on the way in.
"""

from __future__ import annotations

import logging
import struct

import pytest
import torch

from scripts.rigs import l3_harness as h
from scripts.rigs.hicache_harness import Geometry, MLAGeometry
from sglang.srt.mem_cache.pool_host import page_integrity
from sglang.srt.mem_cache.pool_host.page_integrity import (
    SEAL_BYTES,
    StoragePageRefused,
)
from tests.support import l3_faults as lf
from tests.support.l3_faults import reference_restore

GEO = Geometry(layer_num=3, head_num=2, head_dim=16, page_size=4)
GEO_MLA = MLAGeometry(layer_num=2, page_size=4)
PAGES = 6
TOKENS = list(range(7000, 7000 + PAGES * GEO.page_size))
BAD = 3  # the page a test corrupts

pytestmark = pytest.mark.usefixtures("host_ram_not_under_test")


def make(request, tmp_path, backend, geo=GEO, host_dtype="int8"):
    if backend == "mooncake":
        config = request.getfixturevalue("short_lease_master").storage_config()
    else:
        config = h.file_storage_config(tmp_path)
    return h.make_l3_rig(
        backend,
        config,
        host_dtype=host_dtype,
        geo=geo,
        model_name=f"hiq/{request.node.name}",
    )


def corrupt(l3, hashes, page, edit):
    """Apply edit(bytes) -> bytes to the first object of a stored page."""
    objects = lf.objects_for(l3)
    part = objects.parts()[0]
    objects.write(hashes[page], part, edit(objects.read(hashes[page], part)))


def flip_payload_byte(data: bytes) -> bytes:
    out = bytearray(data)
    out[5] ^= 0x10
    return bytes(out)


@pytest.mark.parametrize("backend", ["file", "mooncake"])
@pytest.mark.parametrize("fmt", ["int8", "mla-int8"])
def test_page_with_a_wrong_checksum_never_reaches_l2(
    tmp_path, l3_rigs, request, backend, fmt
):
    geo = GEO_MLA if fmt == "mla-int8" else GEO
    tokens = list(range(7000, 7000 + PAGES * geo.page_size))
    l3 = make(request, tmp_path, backend, geo=geo)
    l3_rigs.append(l3)
    ctl, pool = l3.controller, l3.controller.mem_pool_host
    dev, host, hashes, stored = h.write_through(l3, tokens)
    assert stored == PAGES
    written = h.device_rows(l3.rig, dev)
    h.evict_everywhere(l3, dev, host)
    corrupt(l3, hashes, BAD, flip_payload_byte)
    l2_before = {n: b.clone() for n, b in pool.host_records.items()}

    hit, completed, slots = lf.prefetch_all(l3, tokens + [7])
    assert hit == len(tokens)  # the object is there; its bytes lie
    # A miss for that page only: the pages before it are restored.
    assert completed == BAD * geo.page_size
    counts = pool.storage_integrity.counts()
    assert counts["checksum"] == 1 and sum(counts.values()) == 1
    assert ctl.prefetch_failed_pages == PAGES - BAD
    # The host rows the refused page was fetched into hold none of its bytes:
    # untouched (file: refused before the copy) or zeroed (zero-copy get).
    slot = int(slots[BAD * geo.page_size]) // geo.page_size
    for name, buf in pool.host_records.items():
        want = l2_before[name][slot] if backend == "file" else 0 * buf[slot]
        assert torch.equal(buf[slot], want), name
    pool.free(slots[completed:])
    pf = h.Prefetch(hit, completed, slots[:completed])
    dev2 = h.load_to_device(l3, pf.host_indices)
    n = len(dev2)
    for got, want in zip(h.device_rows(l3.rig, dev2), reference_restore(pool, written)):
        assert torch.equal(got.view(torch.int16), want[:n].view(torch.int16))


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_each_reason_is_counted_and_logged_once(
    tmp_path, l3_rigs, request, backend, caplog, monkeypatch
):
    monkeypatch.setattr(page_integrity, "_logged_reasons", set())
    l3 = make(request, tmp_path, backend)
    l3_rigs.append(l3)
    pool = l3.controller.mem_pool_host
    dev, host, hashes, _ = h.write_through(l3, TOKENS)
    h.evict_everywhere(l3, dev, host)
    objects = lf.objects_for(l3)
    part = objects.parts()[0]
    good = objects.read(hashes[BAD], part)
    other = objects.read(hashes[BAD + 1], part)
    faults = [flip_payload_byte(good), flip_payload_byte(good), other, bytes(len(good))]
    caplog.set_level(logging.WARNING, logger=page_integrity.__name__)
    for data in faults:
        objects.write(hashes[BAD], part, data)
        pf = h.prefetch(l3, TOKENS + [7])
        assert pf.completed_tokens == BAD * GEO.page_size
        pool.free(pf.host_indices)
    objects.write(hashes[BAD], part, good)
    assert h.prefetch(l3, TOKENS + [7]).completed_tokens == len(TOKENS)
    counts = pool.storage_integrity.counts()
    assert counts == {
        "missing": 0,
        "size": 0,
        "seal": 1,
        "tag": 0,
        "key": 1,
        "checksum": 2,
    }
    logged = [r for r in caplog.records if "L3 page refused" in r.getMessage()]
    assert [r.getMessage().split("(")[1].split(")")[0] for r in logged] == [
        "checksum",
        "key",
        "seal",
    ]


def test_file_of_the_wrong_length_is_a_miss_for_that_page_only(
    tmp_path, l3_rigs, request
):
    l3 = make(request, tmp_path, "file")
    l3_rigs.append(l3)
    pool = l3.controller.mem_pool_host
    dev, host, hashes, _ = h.write_through(l3, TOKENS)
    h.evict_everywhere(l3, dev, host)
    objects = lf.objects_for(l3)
    good = objects.read(hashes[BAD], "")
    for data in (good + b"\0", good[:-1], b""):
        objects.write(hashes[BAD], "", data)
        pf = h.prefetch(l3, TOKENS + [7])
        assert pf.completed_tokens == BAD * GEO.page_size, len(data)
        pool.free(pf.host_indices)
    assert pool.storage_integrity.counts()["size"] == 3


def test_flat_page_refusals_name_the_reason(tmp_path, l3_rigs):
    l3 = h.make_l3_rig("file", h.file_storage_config(tmp_path))
    l3_rigs.append(l3)
    pool = l3.controller.mem_pool_host
    dev, host, _, _ = h.write_through(l3, TOKENS)
    page = pool.get_data_page(int(host[0]), key="page-a")
    assert page.numel() == pool.storage_page_bytes + SEAL_BYTES
    free = int(pool.alloc(GEO.page_size)[0])
    before = [b.clone() for b in pool.kv_buffer]
    cases = {
        "key": (page, "page-b"),
        "size": (page[:-1], "page-a"),
        "checksum": (_flipped(page, 0), "page-a"),
        "seal": (_flipped(page, pool.storage_page_bytes), "page-a"),
    }
    for reason, (data, key) in cases.items():
        with pytest.raises(StoragePageRefused, match=reason) as err:
            pool.set_from_flat_data_page(free, data.clone(), key=key)
        assert err.value.reason.value == reason
    # Nothing reached the pool.
    assert all(torch.equal(a, b) for a, b in zip(before, pool.kv_buffer))
    pool.set_from_flat_data_page(free, page, key="page-a")
    assert torch.equal(pool.get_data_page(free, key="page-a"), page)


def _flipped(t: torch.Tensor, at: int) -> torch.Tensor:
    out = t.clone()
    out[at] ^= 1
    return out


def test_sealed_pages_have_their_own_storage_tag(tmp_path, l3_rigs):
    """Pages written before sealing (unsealed tag) are a miss by key."""
    l3 = h.make_l3_rig("file", h.file_storage_config(tmp_path))
    l3_rigs.append(l3)
    pool = l3.controller.mem_pool_host
    base = pool.host_format.storage_format_tag
    assert pool.storage_format_tag == f"{base}-{page_integrity.SEAL_TAG}"
    h.write_through(l3, TOKENS)
    names = [p.name for p in tmp_path.glob("*.bin")]
    assert names and all(pool.storage_format_tag in n for n in names)


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_nonfinite_scales_are_counted_on_the_way_in(
    tmp_path, l3_rigs, request, backend
):
    l3 = make(request, tmp_path, backend)
    l3_rigs.append(l3)
    pool = l3.controller.mem_pool_host

    def poison(device_pool, dev):
        # One NaN in page 2 (layer 1, K): its row's scale is stored non-finite.
        device_pool.k_buffer[1][dev[2 * GEO.page_size + 1], 0, 3] = float("nan")

    dev, host, hashes, _ = h.write_through(l3, TOKENS, edit=poison)
    h.evict_everywhere(l3, dev, host)
    pf = h.prefetch(l3, TOKENS + [7])
    assert pf.completed_tokens == len(TOKENS)
    stats = pool.storage_integrity_counts()
    assert stats["nonfinite_pages_loaded"] == 1
    assert stats["verified"] == PAGES


def _with_seal_field(page: torch.Tensor, payload: int, offset: int, fmt: str, value):
    """`page` with one seal field (at `offset` in the seal) re-packed to `value`."""
    out = page.clone()
    raw = bytearray(out.numpy().tobytes())
    struct.pack_into(fmt, raw, payload + offset, value)
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


@pytest.mark.parametrize(
    "reason, offset, fmt, delta",
    [
        # Only the stated payload length is wrong; the object length is right.
        ("size", 24, "<Q", 1),
        # Only the seal version is wrong; magic and every other field are right.
        ("seal", 4, "<H", 1),
    ],
)
def test_each_seal_field_is_checked_alone(
    tmp_path, l3_rigs, reason, offset, fmt, delta
):
    l3 = h.make_l3_rig("file", h.file_storage_config(tmp_path))
    l3_rigs.append(l3)
    pool = l3.controller.mem_pool_host
    _, host, _, _ = h.write_through(l3, TOKENS)
    page = pool.get_data_page(int(host[0]), key="page-a")
    payload = pool.storage_page_bytes
    (value,) = struct.unpack_from(fmt, page.numpy().tobytes(), payload + offset)
    bad = _with_seal_field(page, payload, offset, fmt, value + delta)
    assert bad.numel() == page.numel() and not torch.equal(bad, page)
    free = int(pool.alloc(GEO.page_size)[0])
    before = [b.clone() for b in pool.kv_buffer]
    with pytest.raises(StoragePageRefused, match=reason) as err:
        pool.set_from_flat_data_page(free, bad, key="page-a")
    assert err.value.reason.value == reason
    assert pool.storage_integrity.counts()[reason] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, pool.kv_buffer))
