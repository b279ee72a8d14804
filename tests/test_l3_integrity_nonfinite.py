"""The non-finite statistic (issue 21, items 2 and 5): at backup, the torch
and the fused paths count the same scale groups for every format, and that
count is exactly the groups the pool stored as non-finite, in the unit the
metric's help states; on the way in from L3 the pool counts pages.

The fused kernels run under Triton's interpreter on CPU (conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from scripts.rigs import l3_harness as h
from tests.support.metrics import Scrape
from scripts.rigs.hicache_harness import (
    Geometry,
    MLAGeometry,
    make_device_pool,
    make_host_pool,
)
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.host_format import HOST_DTYPES, host_format_cls

pytestmark = pytest.mark.usefixtures("host_ram_not_under_test")

MHA_FORMATS = ("int8", "int4", "k8v4", "int4r", "k8v4r", "int8c")
# (host dtype, model kind); MLA models take int8 only.
FORMATS = [(name, "mha") for name in MHA_FORMATS] + [("int8", "mla")]
FORMAT_IDS = [f"{kind}-{name}" for name, kind in FORMATS]
# page_first with 16-token pages groups int4 keys per channel over the page;
# layer_first encodes one token per unit (int4 keys per token).
LAYOUTS = [("page_first", 16), ("layer_first", 1)]


def _geometry(kind: str, page_size: int):
    if kind == "mla":
        return MLAGeometry(
            layer_num=2, kv_lora_rank=256, qk_rope_head_dim=64, page_size=page_size
        )
    return Geometry(layer_num=2, head_num=2, head_dim=64, page_size=page_size)


def _poison(device_pool, dev: torch.Tensor) -> None:
    """Non-finite values placed so that counting elements, tokens or pages
    instead of groups gives another number: two in one head row, two in one
    RoPE row, one per side, one in another layer."""
    nan, inf = float("nan"), float("inf")
    if isinstance(device_pool, MLATokenToKVPool):
        rank = device_pool.kv_lora_rank
        kv = device_pool.kv_buffer
        kv[0][dev[1], 0, 3] = nan  # latent tile 0 ...
        kv[0][dev[1], 0, 100] = inf  # ... the same tile again
        kv[0][dev[1], 0, 200] = nan  # tile 1 of the same token
        kv[1][dev[2], 0, rank + 1] = nan  # a RoPE row ...
        kv[1][dev[2], 0, rank + 9] = -inf  # ... twice
        kv[1][dev[5], 0, rank + 63] = inf
        return
    k, v = device_pool.k_buffer, device_pool.v_buffer
    k[0][dev[1], 0, 3] = nan  # one key row ...
    k[0][dev[1], 0, 5] = inf  # ... twice (int4 keys per channel: two channels)
    k[0][dev[2], 0, 3] = nan  # the same key channel, another token
    k[1][dev[4], 1, 60] = -inf
    v[0][dev[1], 1, 0] = nan  # a value row: channels 0 and 1, one group
    v[0][dev[1], 1, 1] = nan
    v[1][dev[7], 0, 63] = inf


def _stored_nonfinite_groups(pool) -> int:
    """Groups the pool's records hold as non-finite, read from its bytes: a
    non-finite scale (int8 rows, MLA tiles, k8v4 keys), a non-finite
    (scale, zero point) pair (4-bit groups), a RoPE row holding NaN/Inf."""
    total = 0
    for name, record in pool.host_records.items():
        if name == "scale" or name.endswith("_scale"):
            total += int((~torch.isfinite(record.float())).sum())
        elif name.endswith("_meta"):
            total += int((~torch.isfinite(record[..., 0].float())).sum())
        elif name == "rope":
            total += int((~torch.isfinite(record.float())).any(dim=-1).sum())
    return total


def _backed_up_pool(name, kind, layout, page_size, path):
    geo = _geometry(kind, page_size)
    device_pool = make_device_pool(geo, device_tokens=64)
    pool = make_host_pool(
        device_pool, host_tokens=64, layout=layout, host_dtype=name,
        fused_transfer="direct" if path == "fused" else "off",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    dev = torch.arange(page_size, page_size + 32)
    buffers = (
        device_pool.kv_buffer
        if kind == "mla"
        else [*device_pool.k_buffer, *device_pool.v_buffer]
    )
    for buf in buffers:
        buf[dev] = torch.randn(buf[dev].shape, generator=gen).to(buf.dtype)
    _poison(device_pool, dev)
    host = torch.arange(32, 64)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    return pool


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("layout,page_size", LAYOUTS)
@pytest.mark.parametrize("name,kind", FORMATS, ids=FORMAT_IDS)
def test_torch_and_fused_paths_count_the_same_groups(name, kind, layout, page_size):
    torch_pool = _backed_up_pool(name, kind, layout, page_size, "torch")
    assert torch_pool.transfer_path == "torch"
    stored = _stored_nonfinite_groups(torch_pool)
    assert stored > 0
    assert torch_pool.nonfinite_group_count() == stored
    # Every format has fused kernels (int4r/k8v4r: their base format's, with
    # the rotation in the tiles), so each has a second count to compare.
    assert torch_pool.host_format.fused_available(torch.device("cpu")), name
    fused_pool = _backed_up_pool(name, kind, layout, page_size, "fused")
    assert fused_pool.transfer_path == "fused_direct"
    for record, buf in torch_pool.host_records.items():
        assert torch.equal(
            fused_pool.host_records[record].view(torch.uint8), buf.view(torch.uint8)
        ), record
    assert fused_pool.nonfinite_group_count() == stored


@pytest.mark.usefixtures("collectors")
def test_metric_help_states_the_unit_of_every_format():
    """The counter's help says what one group is for each format (the rotated
    ones count as their base format): rates compare only within one format."""
    doc = Scrape().families["sglang:hicache_host_nonfinite_groups"].documentation
    # One unit per codec family: int8 rows (k8v4 keys too), 4-bit groups
    # (int4, k8v4 values; the rotated formats alike), int8c key groups, MLA
    # tiles and RoPE rows.
    for unit in (
        "int8/k8v4-key head row",
        "4-bit channel group",
        "int8c key channel or 32-channel key group",
        "MLA tile",
        "RoPE row",
    ):
        assert unit in doc, unit
    codecs = {getattr(host_format_cls(n), "base_name", n) for n in HOST_DTYPES}
    assert codecs == {"int8", "int4", "k8v4", "int8c"}, (
        "a new format needs its unit in the help"
    )


# --- load side: pages restored from L3 holding non-finite scales ------------


@pytest.fixture
def rigs():
    made = []
    yield made
    for l3 in made:
        l3.close()


@pytest.mark.parametrize("name,kind", FORMATS, ids=FORMAT_IDS)
def test_nonfinite_pages_loaded_from_l3_are_counted_in_pages(
    tmp_path, rigs, request, name, kind
):
    """Three non-finite groups in page 1 and one in page 4: two pages, for
    every format, whatever unit the backup-side count uses."""
    geo = (
        MLAGeometry(layer_num=2, page_size=4)
        if kind == "mla"
        else Geometry(layer_num=2, head_num=2, head_dim=64, page_size=4)
    )
    l3 = h.make_l3_rig(
        "file",
        h.file_storage_config(tmp_path),
        host_dtype=name,
        geo=geo,
        model_name=f"hiq/{request.node.name}",
    )
    rigs.append(l3)
    pool = l3.controller.mem_pool_host
    tokens = list(range(9000, 9000 + 6 * geo.page_size))
    ps = geo.page_size

    def poison(device_pool, dev):
        nan, inf = float("nan"), float("inf")
        if kind == "mla":
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
