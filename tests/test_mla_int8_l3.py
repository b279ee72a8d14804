"""The MLA INT8 page in SGLang's MooncakeStore against a real mooncake_master
on 127.0.0.1: MLA's rank-replicated key path stores one `_k` object per page,
the L2 records unchanged. (Every format's L3 round trips, MLA's included, are
in tests/test_conformance.py.)"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES
from scripts.rigs import l3_harness as h
from scripts.rigs.hicache_harness import MLAGeometry

GEO = MLAGeometry(layer_num=3, page_size=4)
PAGES = 6
TOKENS = list(range(2000, 2000 + PAGES * GEO.page_size))


def test_mooncake_object_is_the_l2_page(mooncake_master, l3_rigs, request):
    """No re-encoding: the page's one object is byte for byte the pool's
    records ("kv", "scale", "rope"), under a key carrying the format tag and
    no tp rank."""
    l3 = h.make_l3_rig(
        "mooncake",
        mooncake_master.storage_config(),
        host_dtype="int8",
        geo=GEO,
        layout="page_first_direct",
        model_name=f"hiq/{request.node.name}",
    )
    l3_rigs.append(l3)
    assert type(l3.controller.mem_pool_host) is host_pool_cls("int8", "mla")
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
