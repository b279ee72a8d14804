"""Per-layer plans (HostRecord.layers) through real pools with the planned toy
(support/plan_format.py) and int4c, and the start-up choice of the plan or the sink page
(layer_plan.py, sink_page.host_plan) from real HF configs."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from sglang.srt.mem_cache.pool_host import backup_verify
from sglang.srt.mem_cache.pool_host import host_format as hf
from sglang.srt.mem_cache.pool_host import layer_plan, sink_page
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES
from scripts.rigs import l3_harness as h
from scripts.rigs.hicache_harness import (
    Geometry,
    MLAGeometry,
    make_device_pool,
    make_host_pool,
)
from tests.support import plan_format as toy
from tests.support.conformance import LAYOUTS, bits, rows_at, side_buffers, spread

PLAN = (1,)
SINK_ENV = sink_page.SINK_ENV
KEY8_ENV = layer_plan.KEY8_ENV
AUTO_SINK = sink_page.AUTO_SINK_PAGE_TOKENS
GEO = dict(layer_num=3, head_num=2, head_dim=64, v_head_dim=32)
PATHS = {
    "torch": dict(fused_transfer="off"),
    "runs": dict(fused_transfer="off", run_copies=True),
    "fused_direct": dict(fused_transfer="direct"),
    "fused_staged": dict(fused_transfer="staged"),
}


@pytest.fixture(autouse=True)
def plan_format():
    """The toy, registered through the registry alone, for every test here."""
    hf.register_host_dtype(toy.ENTRY)
    yield toy.PlanHostFormat
    del hf.HOST_DTYPES[toy.ENTRY.name]


# The planned formats under test and their page size: the toy, and int4c (8-bit
# keys on its key8_layers; 16-token pages give it per-channel keys).
PAGE = {"plan": 4, "int4c": 16}
FORMAT_PATHS = [(name, p) for name in PAGE for p in PATHS]


def make_pool(
    layout, page_size=4, key8_layers=PLAN, tokens=16, host_dtype="plan", **extra
):
    geo = Geometry(**GEO, page_size=page_size)
    device_pool = make_device_pool(geo, 16 * page_size)
    pool = make_host_pool(
        device_pool,
        host_tokens=tokens * page_size,
        layout=layout,
        host_dtype=host_dtype,
        key8_layers=key8_layers,
        **extra,
    )
    return device_pool, pool


def unit_tokens_of(units, ut):
    return (torch.tensor(units)[:, None] * ut + torch.arange(ut)).flatten()


def per_layer_reference(pool, rows, layer, dtype=None):
    """(records, restored in `dtype`) of one layer's rows by that layer's format."""
    fmt = pool.host_format.for_layer(layer)
    ut = 1 if pool.layout == "layer_first" else pool.page_size
    units = [r.view(-1, ut, *r.shape[1:]) for r in rows]
    records = fmt.encode_reference(units)
    restored = fmt.decode_reference(records, dtype or rows[0].dtype)
    return records, [x.reshape(r.shape) for x, r in zip(restored, rows)]


def expected_bytes_per_token(page_size, layers=3, plan=PLAN, layout="page_first"):
    ut = 1 if layout == "layer_first" else page_size
    heads, dk, dv = GEO["head_num"], GEO["head_dim"], GEO["v_head_dim"]
    per_unit = ut * heads * dk + ut * heads * dv * 2 + 8  # k, v, unit_amax
    k_lo = ut * heads * dk
    return (per_unit * layers + k_lo * len(plan)) / ut


# (host_dtype, geometry, layout, plan, B/token): the toy's from its records' sizes;
# int4c's the spec's at Qwen3-8B (36 layers, 8 KV heads of 128, page 64): 1,152 B per
# token and layer, +512 on a plan layer.
QWEN3_8B = Geometry(layer_num=36, head_num=8, head_dim=128, page_size=64)
BYTES = [
    ("plan", Geometry(**GEO, page_size=4), layout, plan,
     expected_bytes_per_token(4, plan=plan, layout=layout))
    for layout in LAYOUTS for plan in (PLAN, ())
] + [
    ("int4c", QWEN3_8B, "page_first", (), 36 * 1152),
    ("int4c", QWEN3_8B, "page_first", (0, 1, 2), 43008),
]  # fmt: skip


@pytest.mark.usefixtures("host_ram_not_under_test")
@pytest.mark.parametrize("host_dtype,geo,layout,plan,want", BYTES)
def test_plan_records_are_allocated_and_counted_on_their_layers_only(
    caplog, host_dtype, geo, layout, plan, want
):
    caplog.set_level(logging.INFO)
    device_pool = make_device_pool(geo, 128)
    pool = make_host_pool(
        device_pool, host_tokens=128, layout=layout, host_dtype=host_dtype,
        key8_layers=plan,
    )  # fmt: skip
    assert pool.get_size_per_token() == want
    assert pool.storage_page_bytes == want * geo.page_size
    host = sum(b.numel() * b.element_size() for b in pool.host_records.values())
    assert host == want * pool.size
    info = device_pool.get_device_pool_infos()[0].buffer_info
    ratio = type(pool).host_bytes_per_device_byte(
        info, page_size=geo.page_size, layout=layout, key8_layers=plan
    )
    dims = geo.head_dim + (geo.v_head_dim or geo.head_dim)
    device = dims * geo.head_num * 2 * geo.layer_num
    assert ratio == pytest.approx(want / device, rel=1e-12)
    if not plan:
        assert "k_lo" not in pool.host_records
        return
    # k_lo on its plan layers only, k on every layer.
    units = pool.size if layout == "layer_first" else pool.page_num
    ut = 1 if layout == "layer_first" else geo.page_size
    for name, layers in (("k_lo", len(plan)), ("k", geo.layer_num)):
        shape = pool.host_records[name].shape[:2]
        assert shape == (
            (layers, units) if layout == "layer_first" else (units, layers)
        )
    if host_dtype == "plan":  # the toy's low key bytes
        k_lo = pool.host_records["k_lo"]
        assert k_lo.shape[2:] == (ut, geo.head_num, geo.head_dim)
    # The start-up log states the plan and the bytes per token.
    plan_line = f"k_lo on layers {list(plan)} of {geo.layer_num}; {want:g} B/token."
    assert f"host format plan: {plan_line}" in caplog.text


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("planned,path", FORMAT_PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_and_load_are_each_layers_reference(monkeypatch, layout, planned, path):
    """Each layer's host records and restore are its format's reference (k_lo on the
    plan layer only); the sampled restore check decodes each layer with its format."""
    monkeypatch.setenv(backup_verify.VERIFY_ENV, "1")
    ps = PAGE[planned]
    device_pool, pool = make_pool(
        layout, page_size=ps, host_dtype=planned, **PATHS[path]
    )
    assert pool.transfer_path == {"runs": "torch"}.get(path, path)
    ut = 1 if layout == "layer_first" else ps
    dev = torch.arange(ps, 3 * ps)
    spread(device_pool, dev, seed=5)
    # Layer 1's keys 1000x the others': its error, if decoded without k_lo,
    # would be the page's largest.
    # (int4c: 16x, its FP16 channel ranges stay finite).
    device_pool.k_buffer[1][dev] *= 1000 if planned == "plan" else 16
    written = rows_at(device_pool, dev)
    if ut == 1:
        host = torch.cat([torch.arange(5 * ps, 6 * ps), torch.arange(2 * ps, 3 * ps)])
    else:
        host = unit_tokens_of([5, 2], ut)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    units = host[::ut] // ut
    fresh = torch.arange(8 * ps, 10 * ps)
    for layer, rows in enumerate(written):
        records, want = per_layer_reference(pool, rows, layer)
        assert set(records) == {
            r.name for r in pool.host_format.records if r.stored_on(layer)
        }
        for name, value in records.items():
            got = pool.records.layer(name, layer)[units]
            assert torch.equal(bits(got), bits(value)), (layer, name)
        pool.load_to_device_per_layer(device_pool, host, fresh, layer, "direct")
        for side, w in zip(side_buffers(device_pool), want):
            assert torch.equal(bits(side[layer][fresh]), bits(w)), layer
    k = device_pool.k_buffer
    if planned == "plan":
        # The plan layer's keys come back exactly, the others' do not.
        assert torch.equal(bits(k[1][fresh]), bits(written[1][0]))
        assert not torch.equal(bits(k[0][fresh]), bits(written[0][0]))
    else:
        # 8-bit keys on the plan layer: a smaller relative error than 4-bit ones.
        def rel(layer):
            x = written[layer][0].float()
            return float((k[layer][fresh].float() - x).abs().max() / x.abs().max())

        assert rel(1) < rel(0) / 4, (rel(1), rel(0))

    errors = pool.backup_verify_errors()
    pages = len(host) // ps
    assert len(errors) == pages
    # The check decodes in fp32.
    restored = [
        per_layer_reference(pool, w, i, torch.float32)[1] for i, w in enumerate(written)
    ]
    for p, error in enumerate(errors):
        tokens = slice(ps * p, ps * (p + 1))
        # [layers * units, unit tokens, heads, dim] per side, as the check reads.
        rows, ref = [], []
        for s in range(2):
            x = torch.stack([w[s][tokens] for w in written])
            y = torch.stack([r[s][tokens].float() for r in restored])
            rows.append(x.view(-1, ut, *x.shape[2:]))
            ref.append(y.view(-1, ut, *y.shape[2:]))
        want = float(backup_verify.relative_error(pool.host_format, rows, ref))
        assert math.isclose(error, want, rel_tol=1e-6), (p, error, want)


def page_payload(pool, rows_per_layer, page):
    """The flat page from each layer's reference: each record over its stored layers."""
    ps = pool.page_size
    ut = 1 if pool.layout == "layer_first" else ps
    per_layer = [
        pool.host_format.for_layer(layer).encode_reference(
            [r[page * ps : (page + 1) * ps].view(-1, ut, *r.shape[1:]) for r in rows]
        )
        for layer, rows in enumerate(rows_per_layer)
    ]
    parts = []
    for record in pool.host_format.records:
        layers = torch.stack(
            [enc[record.name] for enc in per_layer if record.name in enc]
        )
        if pool.layout != "layer_first":
            layers = layers.transpose(0, 1)
        parts.append(layers.contiguous().view(torch.uint8).flatten())
    return torch.cat(parts)


@pytest.mark.parametrize("planned", list(PAGE))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_storage_pages_carry_each_record_on_its_layers(layout, planned):
    """get_data_page is each record over its stored layers, then the seal; zero-copy
    pieces tile every record's block once; another plan's pool refuses the page."""
    ps = PAGE[planned]
    device_pool, pool = make_pool(layout, page_size=ps, host_dtype=planned)
    dev, host = torch.arange(ps, 3 * ps), unit_tokens_of([3, 1], ps)
    spread(device_pool, dev, seed=4)
    written = rows_at(device_pool, dev)
    pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
    page = pool.get_data_page(3 * ps)
    assert page.numel() == pool.storage_page_bytes + SEAL_BYTES
    assert torch.equal(page[:-SEAL_BYTES], page_payload(pool, written, 0))

    pool.set_from_flat_data_page(6 * ps, page)
    fresh = torch.arange(10 * ps, 11 * ps)
    for layer, rows in enumerate(written):
        pool.load_to_device_per_layer(
            device_pool, unit_tokens_of([6], ps), fresh, layer, "direct"
        )
        _, want = per_layer_reference(pool, [r[:ps] for r in rows], layer)
        for side, w in zip(side_buffers(device_pool), want):
            assert torch.equal(bits(side[layer][fresh]), bits(w)), layer

    _, other = make_pool(layout, page_size=ps, host_dtype=planned, key8_layers=(2,))
    if planned == "plan":
        # Same tag and size: the seal, bound to the plan, refuses the page.
        assert other.storage_format_tag == pool.storage_format_tag
    assert other.storage_page_bytes == pool.storage_page_bytes
    with pytest.raises(ValueError, match="seal"):
        other.set_from_flat_data_page(0, page, key=None)

    if layout == "layer_first":
        return
    ptrs, sizes = pool.get_page_buffer_meta(host)
    per_object = pool.storage_buffers_per_object
    for p, unit in enumerate((3, 1)):
        first = p * 2 * per_object
        pieces = sorted(
            (ptr, size)
            for i, (ptr, size) in enumerate(zip(ptrs, sizes))
            if first <= i < first + 2 * per_object and (i + 1 - first) % per_object
        )
        records = sorted(
            (b[unit].data_ptr(), b[unit].nbytes) for b in pool.host_records.values()
        )
        merged = []
        for ptr, size in pieces:
            if (
                merged
                and merged[-1][0] + merged[-1][1] == ptr
                and not any(r[0] == ptr for r in records)
            ):
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((ptr, size))
        assert merged == records


@pytest.mark.parametrize("planned", list(PAGE))
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_l3_file_round_trip_with_a_plan(request, tmp_path, l3_rigs, layout, planned):
    """device -> L2 -> L3 (file) -> L2 -> device: each page one file of the plan's
    bytes (without a plan plus k_lo's), restored as each layer's reference."""
    ps = PAGE[planned]
    geo = Geometry(**GEO, page_size=ps)
    plain = make_pool(layout, page_size=ps, host_dtype=planned, key8_layers=())[1]
    l3 = h.make_l3_rig(
        "file",
        h.file_storage_config(tmp_path),
        host_dtype=planned,
        geo=geo,
        layout=layout,
        device_tokens=16 * ps,
        host_tokens=32 * ps,
        model_name=f"hiq/{request.node.name}",
        key8_layers=PLAN,
    )
    l3_rigs.append(l3)
    pool = l3.controller.mem_pool_host
    assert pool.host_format.describe_plan() == "k_lo on layers [1]"
    tokens = list(range(1000, 1000 + 4 * ps))
    dev, host, hashes, stored = h.write_through(
        l3, tokens, edit=lambda p, idx: spread(p, idx, 6)
    )
    assert stored == 4
    written = rows_at(l3.rig.device_pool, dev)
    h.evict_everywhere(l3, dev, host)
    files = list(tmp_path.glob("*.bin"))
    assert len(files) == 4
    k_lo = pool.host_format.record("k_lo")
    ut = 1 if layout == "layer_first" else ps
    per_token = plain.get_size_per_token() + k_lo.nbytes * len(k_lo.layers) / ut
    assert pool.get_size_per_token() == per_token
    assert {f.stat().st_size for f in files} == {per_token * ps + SEAL_BYTES}
    pf = h.prefetch(l3, tokens + [7])
    assert pf.hit_tokens == pf.completed_tokens == len(tokens)
    dev = h.load_to_device(l3, pf.host_indices)
    for layer, (rows, got) in enumerate(zip(written, rows_at(l3.rig.device_pool, dev))):
        _, want = per_layer_reference(pool, rows, layer)
        for g, w in zip(got, want):
            assert torch.equal(bits(g), bits(w)), layer


# --- refusals -------------------------------------------------------------------


@pytest.mark.usefixtures("host_ram_not_under_test")
def test_a_plan_is_refused_where_it_cannot_work():
    env = layer_plan.KEY8_ENV
    # A format without a plan: the variable and the formats that take one.
    device_pool = make_device_pool(Geometry(**GEO, page_size=4), 64)
    with pytest.raises(ValueError, match=rf"{env}.*int8 has no 8-bit key plan.*plan"):
        make_host_pool(device_pool, host_tokens=64, host_dtype="int8", key8_layers=PLAN)
    # MLA: one latent per token.
    mla = make_device_pool(MLAGeometry(layer_num=2, page_size=4), 64)
    with pytest.raises(ValueError, match=rf"{env}.*MLA host pool"):
        make_host_pool(mla, host_tokens=64, host_dtype="int8", key8_layers=PLAN)
    # Layers the pool does not have.
    with pytest.raises(ValueError, match=r"layers \[1, 3\].*\[0, 3\)"):
        make_pool("page_first", key8_layers=(1, 3))
    # The format's own refusal (page size 2 here) reaches the caller.
    with pytest.raises(NotImplementedError, match=env):
        make_pool("page_first", page_size=2)
    # A format whose layers disagree with its plan.
    broken = toy.PlanHostFormat((64, 32), 2, 4, torch.bfloat16, key8_layers=PLAN)
    broken.for_layer(0).records += (broken.record("k_lo"),)
    from sglang.srt.mem_cache.pool_host.transfer import HostRecords

    with pytest.raises(ValueError, match="layer 0's format stores records"):
        HostRecords(broken, 4, 3, True, lambda s, d: torch.empty(s, dtype=d))


# --- the start-up choice (layer_plan.py) ------------------------------------------


@pytest.fixture(scope="module")
def gemma3_config():
    """Gemma 3 270M's HF config, read from its GGUF (no weights loaded)."""
    import importlib
    import sys

    from scripts.rigs.model import GEMMA_MODULE, QUALITY_MODELS

    sys.path.insert(0, str(QUALITY_MODELS))
    try:
        gguf = importlib.import_module(GEMMA_MODULE).assemble()
    except ImportError:
        pytest.skip("Gemma 3 270M package not in build/quality-models")
    finally:
        sys.path.remove(str(QUALITY_MODELS))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# Model families' HF configs by the fields the rule reads.
CONFIGS = {
    "qwen3-8b": ("Qwen3Config", dict(
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, hidden_size=4096,
    )),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_hidden_layers=48, num_key_value_heads=4)),
    "olmo2": ("Olmo2Config", dict(num_hidden_layers=16)),
    "llama": ("LlamaConfig", dict(num_hidden_layers=32, num_key_value_heads=8)),
}  # fmt: skip


def hf_config(name):
    import transformers

    cls, fields = CONFIGS[name]
    return getattr(transformers, cls)(**fields)


def test_rule_on_gemma3_270m_is_its_full_attention_layers(monkeypatch, gemma3_config):
    assert gemma3_config.num_hidden_layers == 18
    assert layer_plan.auto_key8_layers(gemma3_config) == (5, 11, 17)
    kinds = gemma3_config.layer_types
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == [5, 11, 17]
    # Its hybrid SWA pools: every layer of the full-attention pool, none of the
    # sliding-window pool's.
    monkeypatch.delenv(layer_plan.KEY8_ENV, raising=False)
    full = {5: 0, 11: 1, 17: 2}
    swa = {i: i - i // 6 for i in range(18) if i not in full}
    fmt = toy.PlanHostFormat
    assert layer_plan.pool_key8_layers(gemma3_config, fmt, 0, 3, full) == (0, 1, 2)
    assert layer_plan.pool_key8_layers(gemma3_config, fmt, 0, 15, swa) == ()


@pytest.mark.parametrize(
    "config,want",
    [
        ("qwen3-8b", (0, 1, 2)),
        ("qwen3-moe", (0, 1, 2, 3)),
        ("olmo2", (0,)),
        ("llama", ()),
    ],
)
def test_rule_by_model_family(config, want):
    assert layer_plan.auto_key8_layers(hf_config(config)) == want


def test_env_overrides_the_rule_and_is_checked(monkeypatch):
    env = layer_plan.KEY8_ENV
    plan, int8 = toy.PlanHostFormat, hf.host_format_cls("int8")
    cfg = hf_config("qwen3-8b")

    def chosen(value, fmt=plan, start=0, layers=36, mapping=None):
        monkeypatch.setenv(env, value)
        return layer_plan.pool_key8_layers(cfg, fmt, start, layers, mapping)

    assert chosen("auto") == (0, 1, 2)
    assert chosen("") == (0, 1, 2)
    assert chosen("none") == ()
    assert chosen("7, 3") == (3, 7)
    # Pipeline stage [2, 18): its pool layers count from 0.
    assert chosen("auto", start=2, layers=16) == (0,)
    # A hybrid SWA pool holding some of the layers (stage layer -> pool layer).
    assert chosen("5,11,17", mapping={5: 0, 11: 1, 17: 2}) == (0, 1, 2)
    assert (
        chosen("5,11,17", mapping={i: i - i // 6 for i in range(18) if i % 6 != 5})
        == ()
    )
    # auto means none for a format without a plan; an explicit list is refused.
    assert chosen("auto", fmt=int8) == ()
    with pytest.raises(ValueError, match=rf"{env}.*int8 has no 8-bit key plan.*plan"):
        chosen("3", fmt=int8)
    with pytest.raises(ValueError, match=rf"{env}: layers \[36\].*36 layers"):
        chosen("1,36")
    for bad in ("x", "1,,2", "-1", "2,2"):
        with pytest.raises(ValueError, match=rf"{env}=.*auto, none"):
            chosen(bad)


# --- through SGLang: the assembler and the start-up check ------------------------

QWEN3_TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 24,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "rope_theta": 10000.0,
}


@pytest.mark.parametrize(
    "value,host_dtype,model,match",
    [
        ("1", "int8", "mha", r"int8 has no 8-bit key plan.*--hicache-host-dtype int4c"),
        ("1", "auto", "mha", r"auto stores the device KV as it is"),
        ("1", "int8", "mla", r"MLA host pool"),
        ("0,2", "int4", "mha", r"layers \[2\] are not layers of this model"),
        ("x", "int4", "mha", r"=.x. is not a plan"),
    ],
)
def test_start_up_refuses_an_explicit_plan_it_cannot_keep(
    tmp_path, monkeypatch, value, host_dtype, model, match
):
    from tests.support import server_args as sa

    paths = sa.write_models(tmp_path)
    # An MLA latent the int8 format tiles (128-value tiles).
    mla = dict(sa.DEEPSEEK_V2_MLA, kv_lora_rank=128)
    paths["mla"] = sa.model_dir(tmp_path, "mla128", mla)
    monkeypatch.setenv(layer_plan.KEY8_ENV, value)
    with pytest.raises(ValueError, match=rf"{layer_plan.KEY8_ENV}.*{match}"):
        sa.resolve(paths[model], hicache_host_dtype=host_dtype)
    # auto and none start, and so does int4c with a list of the model's layers.
    for ok in ("auto", "none"):
        monkeypatch.setenv(layer_plan.KEY8_ENV, ok)
        sa.resolve(paths[model], hicache_host_dtype=host_dtype)
    if model == "mha":
        monkeypatch.setenv(layer_plan.KEY8_ENV, "1")
        sa.resolve(paths[model], hicache_host_dtype="int4c")


@pytest.mark.parametrize("access", ["direct", "staged"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_fused_self_check_passes_with_a_plan(layout, access):
    """The start-up self-check of the fused path (run on CUDA) compares each
    layer's stored records and restore with that layer's reference, and puts the
    borrowed host rows back: k_lo only on its layer."""
    from sglang.srt.mem_cache.pool_host import encoded_fused

    device_pool, pool = make_pool(layout, fused_transfer=access)
    assert pool.transfer_path == f"fused_{access}"
    before = {n: bits(b).clone() for n, b in pool.host_records.items()}
    assert encoded_fused.self_check(pool.transfer_context, pool.transfer) is None
    for name, buf in pool.host_records.items():
        assert torch.equal(bits(buf), before[name]), name


# --- plan or sink page: the per-model choice (sink_page.host_plan) ----------------


@pytest.mark.parametrize(
    "config,host_dtype,env,want",
    [
        # Beside the assembler test's rows (the same choices through the server):
        # int4c: the plan on a QK-normed model, else the sink page; an explicit sink
        # page wins; an explicit plan is the operator's, with no sink page behind it.
        ("llama", "int4c", {SINK_ENV: "", KEY8_ENV: "auto"}, ((), AUTO_SINK)),
        ("qwen3-8b", "int4c", {SINK_ENV: "4096"}, ((0, 1, 2), 4096)),
        ("llama", "int4c", {KEY8_ENV: "none"}, ((), 0)),
        ("llama", "int4c", {KEY8_ENV: "3"}, ((3,), 0)),
        # Formats without a plan: no automatic sink page.
        ("llama", "int4r", {SINK_ENV: "4096"}, ((), 4096)),
        ("qwen3-8b", "int8", {}, ((), 0)),
    ],
)
def test_host_plan_is_the_plan_or_the_sink_page(config, host_dtype, env, want):
    fmt = hf.host_format_cls(host_dtype, "mha")
    plan = sink_page.host_plan(fmt, hf_config(config), env, page_size=64)
    assert (plan.key8_layers, plan.sink_page_tokens) == want
    # The process's environment is not read when one is given.
    again = sink_page.host_plan(fmt, hf_config(config), {**env, "X": "1"}, page_size=64)
    assert again == plan


@pytest.mark.parametrize(
    "page_size,device_dtype,why",
    [
        (8192, torch.bfloat16, "page size 8192 is over its 4096 host tokens"),
        (64, torch.float8_e4m3fn, "stores BF16/FP16 device KV, not FP8"),
    ],
)
def test_automatic_sink_page_is_off_where_it_cannot_work(page_size, device_dtype, why):
    """Where the sink page would be refused, the automatic one is off, saying why."""
    fmt = hf.host_format_cls("int4c", "mha")
    plan = sink_page.host_plan(
        fmt, hf_config("llama"), {}, page_size=page_size, device_dtype=device_dtype
    )
    assert (plan.key8_layers, plan.sink_page_tokens) == ((), 0)
    assert why in plan.why and "not QK-normed" in plan.why
    ok = sink_page.host_plan(fmt, hf_config("llama"), {}, page_size=4096)
    assert ok.sink_page_tokens == AUTO_SINK


LLAMA_TINY = {
    **QWEN3_TINY,
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
}


@pytest.mark.usefixtures("host_ram_not_under_test")
@pytest.mark.parametrize(
    "model,host_dtype,env,sink,plan",
    [
        # The toy's plan: the rule's, none, or the variable's.
        ("qwen3", "plan", {}, 0, [0, 1]),
        ("qwen3", "plan", {KEY8_ENV: "none"}, 0, None),
        ("qwen3", "plan", {KEY8_ENV: "3,7"}, 0, [3, 7]),
        ("llama", "int4c", {}, AUTO_SINK, None),
        ("qwen3", "int4c", {}, 0, [0, 1]),
        ("llama", "int4c", {SINK_ENV: "0"}, 0, None),
        ("llama", "int4c", {SINK_ENV: "8192"}, 8192, None),
        ("qwen3", "int4c", {KEY8_ENV: "none"}, 0, None),
        ("llama", "int4", {}, 0, None),
        ("llama", "int4r", {}, 0, None),
    ],
)
def test_assembler_gives_the_pool_the_plan_or_the_sink_page(
    tmp_path, monkeypatch, caplog, model, host_dtype, env, sink, plan
):
    """build_kv_host_pool over a tiny Llama (not QK-normed) and Qwen3 (24 layers: the
    first 2): the pool gets the sink page or the plan, never both unless asked, and
    int4c's start-up log says which, why, and B/token."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        build_kv_host_pool,
    )
    from sglang.srt.runtime_context import publish, reset_context
    from sglang.srt.server_args import ServerArgs
    from tests.support.server_args import model_dir

    for name in (SINK_ENV, KEY8_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = {"llama": LLAMA_TINY, "qwen3": QWEN3_TINY}[model]
    server_args = ServerArgs(
        model_path=model_dir(tmp_path, model, config),
        device="cpu",
        page_size=16,
        enable_hierarchical_cache=True,
        hicache_mem_layout="page_first_direct",
        hicache_host_dtype=host_dtype,
        skip_tokenizer_init=True,
    )
    reset_context()
    publish(server_args, role="scheduler")
    geo = Geometry(layer_num=24, head_num=2, head_dim=16, page_size=16)
    with caplog.at_level(logging.INFO, logger="sglang.srt.mem_cache.pool_host"):
        pool = build_kv_host_pool(
            kv_pool=make_device_pool(geo, 256), page_size=16, host_size=0.0005
        )
    stores = pool.sink_pages
    assert (stores.tokens_per_slot if stores else 0) == sink
    records = {r.name: r for r in pool.host_format.records}
    assert (list(records["k_lo"].layers) if "k_lo" in records else None) == plan
    assert pool.records.stored.get("k_lo") == (None if plan is None else tuple(plan))
    if host_dtype != "int4c":
        return
    lines = [r.getMessage() for r in caplog.records]
    (choice,) = [line for line in lines if "HiCache host KV plan:" in line]
    if sink and not env:
        assert "the sink page" in choice and "llama is not QK-normed" in choice
    elif plan:
        assert "8-bit keys on model layers [0, 1]" in choice
        assert "qwen3 is QK-normed" in choice
    else:
        assert ("the sink page" if sink else "no plan and no sink page") in choice
        assert "as set" in choice
    assert any(
        f"stores INT4C KV: {round(pool.get_size_per_token())} B/token" in line
        for line in lines
    )


@pytest.mark.parametrize("env", [{}, {SINK_ENV: "0"}, {KEY8_ENV: "none"}])
def test_quality_harness_arms_mirror_the_servers_choice(monkeypatch, env):
    """The quality harness's arms get what host_plan gives the server; the explicit
    int4c_sink arm its sink page on both models."""
    from scripts.quality import harness as hq

    for name in (SINK_ENV, KEY8_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _, offloaded = hq._selected_arms(
        hq.QualityConfig(
            text_file="unused", arms=("int4c", "int4c_sink", "int4r", "int4")
        )
    )
    for config in (hf_config("llama"), hf_config("qwen3-8b")):
        for arm in offloaded:
            got = hq.with_model_plan(arm, config)
            server = sink_page.host_plan(
                hf.host_format_cls(arm.host_dtype, "mha"),
                config,
                page_size=arm.page_size,
                device_dtype=torch.bfloat16,
            )
            if arm.name == "int4c_sink":
                assert got.sink_page_tokens == hq.SINK_PAGE_TOKENS
                assert got.key8_layers == server.key8_layers
                continue
            assert (got.key8_layers, got.sink_page_tokens) == (
                server.key8_layers,
                server.sink_page_tokens,
            )
    plain = next(a for a in offloaded if a.name == "int4c")
    got = hq.with_model_plan(plain, hf_config("llama"))
    assert got.sink_page_tokens == (AUTO_SINK if not env else 0)
    assert hq.capacity_vs_bf16(got) < hq.capacity_vs_bf16(plain) or env
