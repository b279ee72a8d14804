"""How faithfully the encoded host tier stores KV, on /metrics: the per-layer
scale amax and the sampled restore check (SGLANG_HICACHE_VERIFY_SAMPLE_RATE)
with its relative-error histogram, fed by real pools, backups and reporter."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from scripts.rigs.hicache_harness import (
    Geometry,
    MLAGeometry,
    fill_random,
    finish_transfers,
    make_rig,
)
from tests.support.metrics import TIER_GEO, TierRig
from sglang.srt.mem_cache.pool_host import backup_verify
from sglang.srt.mem_cache.pool_host.backup_verify import VERIFY_ENV
from sglang.srt.mem_cache.pool_host.host_format import HOST_DTYPES, host_format_cls

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "docs" / "prometheus" / "hicache_rules.yml"
HIST = "sglang:hicache_host_verify_relative_error"
AMAX = "sglang:hicache_host_scale_amax"
# Pages of 16 tokens, so 4-bit keys group per channel; head dim 32 rotates.
PAGED = Geometry(layer_num=2, head_num=2, head_dim=32, page_size=16)


def finite_amax(tier: TierRig, layer: int, side: int) -> float:
    """Largest |x| over the head rows backed up that hold no NaN/Inf."""
    rows = torch.cat([batch[layer][side] for batch in tier.written]).float()
    rows = rows.reshape(-1, tier.geo.head_dim)
    return rows[torch.isfinite(rows).all(dim=1)].abs().max().item()


def over(scrape, fmt: str, threshold: float) -> float:
    """Sampled pages of `fmt` whose error is above `threshold` (a bucket edge)."""
    count = scrape.value(f"{HIST}_count", format=fmt)
    return count - scrape.value(f"{HIST}_bucket", format=fmt, le=str(threshold))


def expected_errors(pool, host_indices, written) -> list[float]:
    """max|x - x^| / max|x| per page (a token) by the format's reference decode."""
    fmt = pool.host_format
    units = host_indices.to(torch.int64)
    records = {
        r.name: pool.records.all_layers(r.name)[units].flatten(0, 1)
        for r in fmt.records
    }
    restored = fmt.decode_reference(records, torch.float32)
    out = []
    for token in range(len(units)):
        errors = []
        for side, x_hat in enumerate(restored):
            x = torch.stack(
                [written[layer][side][token] for layer in range(len(written))]
            )
            x_hat = x_hat.unflatten(0, (len(units), -1))[token].reshape(x.shape)
            x = x.float()
            errors.append(((x - x_hat).abs().max() / x.abs().max()).item())
        out.append(max(errors))
    return out


@pytest.fixture(autouse=True)
def verify_every_page(monkeypatch):
    """Every page is sampled unless a test sets the rate itself."""
    monkeypatch.setenv(VERIFY_ENV, "1")


def test_scale_amax_per_layer_and_side(collectors, monkeypatch):
    monkeypatch.setenv(VERIFY_ENV, "0")
    tier = TierRig("int8", collectors, layout="page_first")
    tier.backup(20)
    scrape = tier.collect()
    amax = tier.pool.scale_amax_by_layer()
    assert amax.shape == (TIER_GEO.layer_num, 2)
    assert len(scrape.all(AMAX)) == 2 * TIER_GEO.layer_num
    for layer in range(TIER_GEO.layer_num):
        for side, kv in enumerate("kv"):
            exported = scrape.value(AMAX, layer=str(layer), kv=kv)
            # The largest |x| backed up, exactly: BF16 values are exact in fp32.
            assert exported == finite_amax(tier, layer, side)
            assert exported == amax[layer, side].item()

    # Rows stored as non-finite do not raise it; larger finite rows do.
    tier.backup(8, nan_rows=5)
    scrape = tier.collect()
    for layer in range(TIER_GEO.layer_num):
        for side, kv in enumerate("kv"):
            assert scrape.value(AMAX, layer=str(layer), kv=kv) == finite_amax(
                tier, layer, side
            )


def test_stock_pool_exports_no_quality_series(collectors):
    tier = TierRig("auto", collectors)
    tier.backup(8)
    scrape = tier.collect()
    assert scrape.all(AMAX) == []
    assert scrape.all(f"{HIST}_count") == []


def test_sampled_errors_in_the_exposition(collectors):
    tier = TierRig("int8", collectors)
    host = tier.backup(20)
    expected = expected_errors(tier.pool, host, tier.written[0])
    scrape = tier.collect()
    assert scrape.value(f"{HIST}_count", format="int8") == 20
    assert scrape.value(f"{HIST}_sum", format="int8") == pytest.approx(
        sum(expected), rel=1e-6
    )
    assert over(scrape, "int8", 0.004) == 0
    # Each sample is read once: a second collection adds nothing.
    assert tier.collect().value(f"{HIST}_count", format="int8") == 20


def paged_int8_rig(device_tokens: int = 64):
    return make_rig(
        PAGED,
        device_tokens=device_tokens,
        host_tokens=2 * device_tokens,
        layout="page_first",
        host_dtype="int8",
    )


def backup_pages(pool_rig, pages: int, seed: int = 0, outlier: float = 30.0):
    """Random KV with an outlier channel in every K head, backed up."""
    dev = pool_rig.allocator.alloc(pages * pool_rig.device_pool.page_size)
    fill_random(pool_rig.device_pool, dev, seed=seed)
    pool = pool_rig.device_pool
    if hasattr(pool, "k_buffer"):
        for layer in range(pool.layer_num):
            pool.k_buffer[layer][dev, :, 3] *= outlier
    pool_rig.controller.write(dev)
    finish_transfers(pool_rig.controller)
    return dev


def bound_cases():
    for name in HOST_DTYPES:
        for layout in ("page_first", "layer_first"):
            for dtype in (torch.bfloat16, torch.float16):
                yield pytest.param(
                    name, layout, dtype, "off", id=f"{name}-{layout}-{str(dtype)[6:]}"
                )
    yield pytest.param("int4", "page_first", torch.float8_e4m3fn, "off", id="int4-fp8")
    yield pytest.param("k8v4", "page_first", torch.float8_e5m2, "off", id="k8v4-fp8")
    yield pytest.param("int8", "page_first", "mla", "off", id="mla-int8")
    for name in ("int8", "int4r"):
        yield pytest.param(name, "page_first", torch.bfloat16, "direct", id=name)


@pytest.mark.parametrize("host_dtype,layout,dtype,fused", list(bound_cases()))
def test_sampled_error_within_the_formats_bound(
    request, host_dtype, layout, dtype, fused
):
    """Each page's error is within the format's bound and far from 0 (the
    check measures something)."""
    mla, fp8 = dtype == "mla", dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fused != "off":
        request.getfixturevalue("triton_interpreter")

    geo = (
        dataclasses.replace(PAGED, dtype=dtype)
        if not mla
        else MLAGeometry(
            layer_num=2, kv_lora_rank=256, qk_rope_head_dim=64, page_size=4
        )
    )
    extra = {"device_kv_dtype": dtype} if fp8 else {}
    if fused != "off":
        extra["fused_transfer"] = fused
    rig = make_rig(geo, device_tokens=64, host_tokens=128, layout=layout,
                   host_dtype=host_dtype, **extra)  # fmt: skip
    assert rig.host_pool.transfer_path.startswith("fused") == (fused != "off")
    pages = 4 if mla else 3
    if not fp8:
        backup_pages(rig, pages)
    else:
        dev = rig.allocator.alloc(pages * geo.page_size)
        gen = torch.Generator().manual_seed(0)
        shape = (len(dev), geo.head_num, geo.head_dim)
        for layer in range(geo.layer_num):
            for buf in (rig.device_pool.k_buffer, rig.device_pool.v_buffer):
                rows = torch.randn(shape, generator=gen)
                buf[layer][dev] = rows.to(dtype).view(torch.uint8)
        rig.controller.write(dev)
        finish_transfers(rig.controller)
    errors = rig.host_pool.backup_verify_errors()
    threshold = host_format_cls(
        host_dtype, "mla" if mla else "mha"
    ).relative_error_threshold
    assert len(errors) == pages
    assert all(threshold / 20 < e <= threshold for e in errors), errors


@pytest.mark.parametrize("host_dtype", list(HOST_DTYPES))
def test_broken_decode_drives_the_error_over_the_threshold(collectors, host_dtype):
    """A format whose decode is off by 10% on one side (a corrupted restore)."""
    tier = TierRig(host_dtype, collectors, layout="page_first", geo=PAGED)
    fmt = tier.pool.host_format
    decode_into = fmt.decode_into

    def broken_decode_into(records, out):
        decode_into(records, out)
        out[-1].mul_(1.1)

    fmt.decode_into = broken_decode_into
    tier.backup(2 * PAGED.page_size)
    scrape = tier.collect()
    threshold = fmt.relative_error_threshold
    assert scrape.value(f"{HIST}_count", format=host_dtype) == 2
    assert over(scrape, host_dtype, threshold) == 2


def test_finite_page_restoring_nan_reports_inf():
    rig = paged_int8_rig()
    fmt = rig.host_pool.host_format
    decode_into = fmt.decode_into

    def nan_decode_into(records, out):
        decode_into(records, out)
        out[0][0, 0, 0, 0] = float("nan")

    fmt.decode_into = nan_decode_into
    backup_pages(rig, pages=1)
    assert rig.host_pool.backup_verify_errors() == [float("inf")]


def test_page_holding_nan_is_left_to_the_nonfinite_counter():
    rig = paged_int8_rig()
    dev = rig.allocator.alloc(2 * PAGED.page_size)
    fill_random(rig.device_pool, dev)
    rig.device_pool.k_buffer[0][dev[0], 0, 0] = float("nan")
    rig.controller.write(dev)
    finish_transfers(rig.controller)
    (error,) = rig.host_pool.backup_verify_errors()  # the second page only
    assert 0 < error <= 0.004


class Event:
    """A CUDA event as drain() sees it: query() says whether it completed."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_drain_takes_completed_samples_in_order_without_waiting():
    rig = paged_int8_rig()
    verifier = rig.host_pool.backup_verifier
    late = Event(False)
    verifier._pending.extend(
        [(torch.tensor(1.0), Event(True)), (torch.tensor(2.0), late)]
        + [(torch.tensor(3.0), Event(True))]
    )
    # The second sample's copy is still in flight: it and the ones after wait.
    assert verifier.drain() == [1.0]
    assert verifier.drain() == []
    late.done = True
    assert verifier.drain() == [2.0, 3.0]


def test_unread_samples_are_capped(monkeypatch):
    monkeypatch.setattr(backup_verify, "MAX_PENDING", 4)
    rig = paged_int8_rig(device_tokens=128)
    backup_pages(rig, pages=6)
    verifier = rig.host_pool.backup_verifier
    assert (verifier.pages_checked, verifier.samples_dropped) == (6, 2)
    assert len(verifier.drain()) == 4


def test_rate_zero_adds_no_work(collectors, monkeypatch):
    monkeypatch.setenv(VERIFY_ENV, "0")

    def no_check(*args):
        raise AssertionError("sampled a page at rate 0")

    monkeypatch.setattr(backup_verify.BackupVerifier, "_check_page", no_check)
    monkeypatch.setattr(backup_verify, "relative_error", no_check)
    tier = TierRig("int8", collectors, layout="page_first")
    assert tier.pool.backup_verifier is None
    decodes = []
    decode_into = tier.pool.host_format.decode_into
    tier.pool.host_format.decode_into = lambda *a: decodes.append(decode_into(*a))
    tier.backup(32)
    scrape = tier.collect()
    assert decodes == []
    assert scrape.value(f"{HIST}_count", format="int8") == 0


def test_default_rate_samples_about_one_page_in_a_thousand(monkeypatch):
    monkeypatch.delenv(VERIFY_ENV)
    checked = []
    monkeypatch.setattr(
        backup_verify.BackupVerifier,
        "_check_page",
        lambda self, h, d: checked.append(h),
    )
    rig = paged_int8_rig()
    verifier = rig.host_pool.backup_verifier
    assert verifier.rate == 0.001
    page = PAGED.page_size
    # About 200,000 pages in backups of 1 to 64 pages.
    sizes = torch.randint(1, 65, (6250,), generator=torch.Generator().manual_seed(1))
    total = 0
    for n in sizes.tolist():
        indices = torch.arange(n * page)
        verifier.after_backup(indices, indices)
        total += n
    assert all(len(h) == page and int(h[0]) % page == 0 for h in checked)
    # Binomial(total, 0.001): mean total/1000, sd about sqrt(total/1000).
    mean = total / 1000
    assert abs(len(checked) - mean) < 5 * mean**0.5, (len(checked), mean)


@pytest.mark.parametrize("raw", ["abc", "-0.1", "1.5", "nan", "inf", "1e-3%"])
def test_bad_rate_fails_at_start_up(raw, monkeypatch):
    monkeypatch.setenv(VERIFY_ENV, raw)
    with pytest.raises(ValueError, match=f"{VERIFY_ENV}=.*between 0 and 1"):
        make_rig(TIER_GEO, device_tokens=16, host_tokens=32, host_dtype="int8")


@pytest.mark.parametrize("raw,rate", [("0", None), (" 0.25 ", 0.25), ("1", 1.0)])
def test_good_rates(raw, rate, monkeypatch):
    monkeypatch.setenv(VERIFY_ENV, raw)
    rig = make_rig(TIER_GEO, device_tokens=16, host_tokens=32, host_dtype="int8")
    verifier = rig.host_pool.backup_verifier
    assert (verifier and verifier.rate) == rate


def test_alert_thresholds_are_the_formats_and_bucket_edges():
    rules = RULES.read_text()
    block = rules[rules.index("alert: HiCacheHostKVRestoreError") :]
    block = block[: block.index("labels:")]
    pairs = re.findall(r'format=~?"([\w|]+)",\s*le="([\d.]+)"', block)
    stated = {name: float(le) for names, le in pairs for name in names.split("|")}
    thresholds = {
        name: host_format_cls(name).relative_error_threshold for name in HOST_DTYPES
    }
    assert stated == thresholds
    assert host_format_cls("int8", "mla").relative_error_threshold == stated["int8"]
    # The count above a threshold is exact only where it is a bucket edge.
    from sglang.srt.observability import metrics_collector

    source = Path(metrics_collector.__file__).read_text()
    edges = re.search(r"buckets=\(([^)]*)\)", source[source.index(HIST) :])
    assert set(thresholds.values()) <= {float(b) for b in edges.group(1).split(",")}
