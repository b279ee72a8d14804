"""key_scales.py's byte model of the 4-bit candidates is the registered formats'
records at Qwen3-8B; its layer plan rule picks docs/quality-int8c.md's layers."""

from __future__ import annotations

import pytest
import torch

from scripts.quality import key_scales as ks

HEADS, DIM = 8, 128


def _fmt(name: str, unit_tokens: int):
    from sglang.srt.mem_cache.pool_host import host_format as hf

    cls = hf.host_format_cls(name)
    return cls((DIM, DIM), HEADS, unit_tokens, torch.bfloat16)


def _side_bytes(fmt, side: str) -> float:
    """A format's host bytes per token and layer of one side's records."""
    nbytes = sum(r.nbytes for r in fmt.records if r.name.split("_")[0] == side)
    return nbytes / fmt.unit_tokens


@pytest.mark.parametrize("arm,unit", (("int4", 64), ("int4_k32", 32)))
def test_uniform_arms_cost_what_int4_records_cost(arm, unit):
    layers = len(ks.QWEN3_8B[0])
    want = layers * _fmt("int4", unit).bytes_per_token()
    assert ks.bytes_per_token(arm, *ks.QWEN3_8B) == want


def test_an_8bit_key_layer_costs_int8c_keys_plus_int4_values():
    # k8_first3: three layers of int8c keys + int4 values, 33 layers of int4.
    int4, int8c = _fmt("int4", 64), _fmt("int8c", 64)
    k8_layer = _side_bytes(int8c, "k") + _side_bytes(int4, "v")
    want = 33 * int4.bytes_per_token() + 3 * k8_layer
    assert ks.bytes_per_token("k8_first3", *ks.QWEN3_8B) == want
    # The capacity target's arithmetic: 3 such layers fit 3.4x, 4 do not.
    assert 4 * DIM * HEADS * 36 / want >= 3.4
    assert 4 * DIM * HEADS * 36 / (want + k8_layer - int4.bytes_per_token()) < 3.4


def test_layer_plan_rule():
    qwen = [i for i in range(36) if ks.plan_keys8(i, ks.QWEN3_8B[0])]
    gemma = [i for i in range(18) if ks.plan_keys8(i, ks.GEMMA3_270M[0])]
    assert qwen == [0, 1, 2]
    assert gemma == [5, 11, 17]


def _int4_side(side: str, value_group: int = 64) -> float:
    """int4's bytes for one side per token and layer (one FP16 scale and zero
    point per `value_group` values)."""
    bytes_ = _side_bytes(_fmt("int4", 64), side)
    if side == "v":
        bytes_ += HEADS * 4 * (DIM // value_group - DIM // 64)
    return bytes_


# Key metadata per token and layer of the cheaper-metadata arms, from what
# each stores (codes are int4's 4 bits per value either way).
_CODES = HEADS * DIM / 2
_KEY_META = {
    "k32s": HEADS * DIM * 2 / 32,  # FP16 scale per channel per 32 tokens
    "k32z8": HEADS * DIM * 3 / 32,  # + INT8 zero point
    "k16s": HEADS * DIM * 2 / 16,
    "k16e4": HEADS * DIM * 1 / 16 + HEADS * 2 / 64,  # E4M3 + FP16 base/head/page
    "k16l2": HEADS * DIM * 1 / 16,  # 8-bit exponent
    "k2l16": HEADS * DIM * (2 / 64 + 0.5 / 16),  # FP16 per page + 4 bits per 16
    "k2l32": HEADS * DIM * (2 / 64 + 0.5 / 32),
    "k2l16b8": HEADS * DIM * (2 / 64 + 1 / 16),
    "k32z8n": HEADS * DIM * 3 / 32,
    "k2l32a": HEADS * DIM * (4 / 64 + 1 / 32),  # FP16 min + range, 2 x 4 bits
    "rk32z8": HEADS * DIM * 3 / 32,
    "rk2l32a": HEADS * DIM * (4 / 64 + 1 / 32),
}


@pytest.mark.parametrize("keys", sorted(_KEY_META))
@pytest.mark.parametrize("vgroup", (64, 128))
def test_cheaper_key_metadata_bytes(keys, vgroup):
    vname = "rot_v" if vgroup == 64 else "rot_v128"
    layer = _CODES + _KEY_META[keys] + _int4_side("v", vgroup)
    assert ks.bytes_per_token(f"int4_{keys}_{vname}", *ks.QWEN3_8B) == 36 * layer
    # The plan rule's 3 layers store int8c's keys beside the same values.
    k8 = _side_bytes(_fmt("int8c", 64), "k") + _int4_side("v", vgroup)
    want = 33 * layer + 3 * k8
    assert ks.bytes_per_token(f"k8_plan_{keys}_{vname}", *ks.QWEN3_8B) == want


def test_cheaper_metadata_buys_the_layer_plan_within_3_4x():
    def ratio(name):
        return 4 * DIM * HEADS * 36 / ks.bytes_per_token(name, *ks.QWEN3_8B)

    assert ratio("k8_plan_k32_rot_v128") < 3.4  # FP16 scale + zero point
    for name in (
        "k8_plan_k32z8_rot_v128",
        "k8_plan_k2l32a_rot_v128",
        "k8_plan_k32s_rot_v",
        "k8_plan_k2l16_rot_v",
    ):
        assert ratio(name) >= 3.4, name


@pytest.mark.parametrize("keys", sorted(set(_KEY_META) - {"rk32z8", "rk2l32a"}))
def test_cheaper_key_quantizers_are_4_bit_and_keep_zero_channels(keys):
    # QK-normed-like keys: per-channel gains, offsets, one channel all zero.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(128, 2, 64, generator=gen) * torch.rand(64, generator=gen) * 3
    x += torch.randn(64, generator=gen) * 0.5
    x[:, :, 5] = 0
    fn = ks._KEYS[keys][0]
    y = fn(x)
    unit = 32 if "32" in keys else 16
    groups = y.reshape(128 // unit, unit, 2, 64).permute(0, 2, 3, 1).reshape(-1, unit)
    assert max(len(torch.unique(g)) for g in groups) <= 16
    assert (y[:, :, 5] == 0).all()
    # Within one symmetric 4-bit step (amax / 7) of each unit's channel: no
    # code clips by more than half a step, log2's rounded-up scale included.
    step = x.reshape(128 // unit, unit, 2, 64).abs().amax(1) / 7
    err = (y - x).abs().reshape(128 // unit, unit, 2, 64).amax(1)
    assert (err <= step + 1e-6).all()


@pytest.mark.parametrize("keys", ("k2l32a", "rk2l32a", "k32z8n", "rk32z8"))
def test_sink_page_on_cheaper_keys_adds_one_int8c_key_page_per_sequence(keys):
    # One 64-token page of int8c keys per 4,096-token sequence, every layer.
    sink = _side_bytes(_fmt("int8c", 64), "k") * 64 / 4096
    layer = _CODES + _KEY_META[keys] + _int4_side("v", 128) + sink
    got = ks.bytes_per_token(f"int4_{keys}_rot_v128_sink", *ks.QWEN3_8B)
    assert got == pytest.approx(36 * layer, rel=1e-12)
    assert 4 * DIM * HEADS * 36 / got >= 3.4


def test_text_flag_names_its_choices(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["key_scales", "--text", "novels"])
    with pytest.raises(SystemExit):
        ks.main()
    err = capsys.readouterr().err
    assert "--text" in err and "invalid choice" in err and "python-docs" in err
