"""MLA INT8 host pages in HiCache's L3 tier through SGLang's real
HiCacheController storage threads: the `file` backend, and SGLang's
MooncakeStore against a real mooncake_master on 127.0.0.1 taking MLA's
rank-replicated key path (one `_k` object per page, no tp rank in the key).

The stock BF16 MLA host pool is the control (bit-exact). An INT8 round trip
restores exactly the format reference's values of what was written, because
L3 holds the L2 records unchanged.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import l3_harness as h
from tests.support.hicache_harness import MLAGeometry
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES

MLATokenToKVPoolINT8Host = host_pool_cls("int8", "mla")

GEO = MLAGeometry(layer_num=3, page_size=4)
PAGES = 6
TOKENS = list(range(2000, 2000 + PAGES * GEO.page_size))
POOL_CLS = {"auto": MLATokenToKVPoolHost, "int8": MLATokenToKVPoolINT8Host}


def expected_restore(rows: list[torch.Tensor], host_dtype: str):
    if host_dtype == "auto":
        return rows
    out = []
    for r in rows:
        f = MLAInt8HostFormat((r.shape[-1],), 1, 1, r.dtype)
        x = r.view(-1, 1, 1, r.shape[-1])
        (y,) = f.decode_reference(f.encode_reference([x]), r.dtype)
        out.append(y.view_as(r))
    return out


@pytest.fixture
def rigs():
    made = []
    yield made
    for l3 in made:
        l3.close()


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    h.require_mooncake()
    m = h.MooncakeMaster(
        tmp_path_factory.mktemp("mooncake") / "master.log",
        extra_args=("--default_kv_lease_ttl=100",),
    ).start()
    yield m
    m.stop()


def make(request, backend, config, host_dtype, layout="page_first_direct"):
    l3 = h.make_l3_rig(
        backend,
        config,
        host_dtype=host_dtype,
        geo=GEO,
        layout=layout,
        model_name=f"hiq/{request.node.name}",
    )
    assert type(l3.controller.mem_pool_host) is POOL_CLS[host_dtype]
    return l3


def round_trip(l3, host_dtype, seed=0):
    """Write-through to L3, evict L1 and L2, prefetch L3 -> L2 -> L1."""
    dev, host, hashes, stored = h.write_through(l3, TOKENS, seed=seed)
    assert stored == len(hashes) == PAGES
    written = h.device_rows(l3.rig, dev)
    h.evict_everywhere(l3, dev, host)
    fetch_and_check(l3, host_dtype, written)
    return written


def fetch_and_check(l3, host_dtype, written):
    pf = h.prefetch(l3, TOKENS + [7])
    assert pf.hit_tokens == pf.completed_tokens == len(TOKENS)
    dev = h.load_to_device(l3, pf.host_indices)
    for got, want in zip(
        h.device_rows(l3.rig, dev), expected_restore(written, host_dtype)
    ):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    h.evict_everywhere(l3, dev, pf.host_indices)


@pytest.mark.parametrize(
    "host_dtype,layout",
    [
        ("auto", "page_first_direct"),
        ("int8", "page_first_direct"),
        ("int8", "page_first"),
        ("int8", "layer_first"),
    ],
)
def test_file_round_trip(tmp_path, rigs, request, host_dtype, layout):
    l3 = make(request, "file", h.file_storage_config(tmp_path), host_dtype, layout)
    rigs.append(l3)
    round_trip(l3, host_dtype)
    files = list(tmp_path.glob("*.bin"))
    assert len(files) == PAGES  # one object per page
    page_bytes = l3.controller.mem_pool_host.get_size_per_token() * GEO.page_size
    seal = SEAL_BYTES if host_dtype == "int8" else 0
    assert {f.stat().st_size for f in files} == {page_bytes + seal}
    if host_dtype == "int8":
        assert page_bytes == 648 * GEO.layer_num * GEO.page_size


@pytest.mark.parametrize(
    "host_dtype,layout",
    [
        ("auto", "page_first_direct"),
        ("int8", "page_first_direct"),
        ("int8", "page_first"),
    ],
)
def test_mooncake_round_trip_rank_replicated_zero_copy(
    master, rigs, request, host_dtype, layout
):
    l3 = make(request, "mooncake", master.storage_config(), host_dtype, layout)
    rigs.append(l3)
    backend = l3.backend
    # MLA pages take the rank-replicated key path: one object per page.
    assert backend.is_mla_backend
    assert l3.controller.page_get_func == l3.controller._page_get_zero_copy
    before = master.metrics()
    round_trip(l3, host_dtype)
    after = master.metrics()
    assert after["master_key_count"] - before["master_key_count"] == PAGES
    stored = after["master_allocated_bytes"] - before["master_allocated_bytes"]
    seals = PAGES * SEAL_BYTES if host_dtype == "int8" else 0
    assert (
        stored == len(TOKENS) * l3.controller.mem_pool_host.get_size_per_token() + seals
    )


def test_mooncake_object_is_the_l2_page(master, rigs, request):
    """No re-encoding: the page's one object is byte for byte the pool's
    records ("kv", "scale", "rope"), under a key carrying the format tag and
    no tp rank."""
    l3 = make(request, "mooncake", master.storage_config(), "int8")
    rigs.append(l3)
    dev, host, hashes, stored = h.write_through(l3, TOKENS)
    pool, backend = l3.controller.mem_pool_host, l3.backend
    key = backend._tag_keys([hashes[2]])[0] + f"_{backend.mla_suffix}_k"
    obj = torch.frombuffer(bytearray(backend.store.get(key)), dtype=torch.uint8)
    flat = pool.get_data_page(int(host[2 * GEO.page_size]))
    assert torch.equal(obj[:-SEAL_BYTES], flat[:-SEAL_BYTES])
    page = int(host[2 * GEO.page_size]) // GEO.page_size
    assert torch.equal(obj[-SEAL_BYTES:], pool.pages.seals[page, 0])
    assert pool.storage_format_tag in key
    assert "mla-int8-t128-fp16scale-rope16-v1" in key


def test_mooncake_bf16_and_int8_never_read_each_others_pages(master, rigs, request):
    config = master.storage_config()
    name = f"hiq/{request.node.name}"
    bf16 = h.make_l3_rig(
        "mooncake", config, host_dtype="auto", geo=GEO, model_name=name
    )
    rigs.append(bf16)
    int8 = h.make_l3_rig(
        "mooncake", config, host_dtype="int8", geo=GEO, model_name=name
    )
    rigs.append(int8)
    bf16_written = round_trip(bf16, "auto", seed=1)
    assert h.prefetch(int8, TOKENS + [7]).hit_tokens == 0
    int8_written = round_trip(int8, "int8", seed=2)
    fetch_and_check(bf16, "auto", bf16_written)
    fetch_and_check(int8, "int8", int8_written)
