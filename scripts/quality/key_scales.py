"""Which key scaling keeps QK-normed models lossless: candidate 8-bit and 4-bit
schemes applied to a real model's prefix KV in torch (fake quantization, no
host pool), scored like the harness against the BF16 KV (docs/quality-int8c.md).

    PYTHONPATH=build/sglang/python:build/quality-models .venv/bin/python \
        -m scripts.quality.key_scales --model gemma3-270m --windows 2

The candidates are sketches of a scheme's arithmetic (scales rounded to fp16,
round half to even), not the formats' bytes: the registered formats are
measured through the real pools by `make quality` / `make quality-gemma`.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from scripts.quality import harness as hq
from scripts.quality import texts

PAGE = 64


def _half(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _fp16(s: torch.Tensor) -> torch.Tensor:
    """A scale rounded to fp16, kept away from 0 (an all-zero group)."""
    return _half(s).clamp_min(1e-30)


def sym8_tokens(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """INT8 per token in groups of `group` channels (None: the whole head)."""
    t, h, d = x.shape
    g = x.reshape(t, h, d // (group or d), group or d)
    s = _fp16(g.abs().amax(-1, keepdim=True) / 127)
    return ((g / s).round().clamp(-127, 127) * s).reshape(t, h, d)


def _per_channel(
    x: torch.Tensor, levels: int, symmetric: bool, unit: int = PAGE
) -> torch.Tensor:
    """One group per channel over each `unit` tokens."""
    t, h, d = x.shape
    g = x.reshape(t // unit, unit, h, d)
    if symmetric:
        s = _fp16(g.abs().amax(1, keepdim=True) / (levels // 2))
        q = (g / s).round().clamp(-(levels // 2), levels // 2) * s
    else:
        lo = _half(g.amin(1, keepdim=True))
        s = _fp16((g.amax(1, keepdim=True) - lo) / (levels - 1))
        q = ((g - lo) / s).round().clamp(0, levels - 1) * s + lo
    return q.reshape(t, h, d)


def _asym4_tokens(x: torch.Tensor, group: int = 64) -> torch.Tensor:
    t, h, d = x.shape
    g = x.reshape(t, h, d // min(group, d), min(group, d))
    lo = _half(g.amin(-1, keepdim=True))
    s = _fp16((g.amax(-1, keepdim=True) - lo) / 15)
    return (((g - lo) / s).round().clamp(0, 15) * s + lo).reshape(t, h, d)


def _rotated(fn):
    """fn in a Walsh-Hadamard-rotated basis (a fixed sign flip), undone after."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(0))
        m = (signs * 2 - 1).float()[:, None] * h / math.sqrt(d)
        return fn(x @ m) @ m.T

    return apply


def _none(x):
    return x


def _k4(unit: int = PAGE):
    return lambda k: _per_channel(k, 16, False, unit)


def _k8c(k: torch.Tensor) -> torch.Tensor:
    return _per_channel(k, 256, False)


def _k4s(unit: int = 32):
    """4-bit symmetric per channel over `unit` tokens: an FP16 scale, no zero
    point (codes -7..7), for QK-normed keys that may be centred."""
    return lambda k: _per_channel(k, 15, True, unit)


def _k4z8(unit: int = 32, noclip: bool = False):
    """4-bit asymmetric per channel over `unit` tokens with an FP16 scale and an
    INT8 zero point in scale steps (codes 0..15 decode as (q - z) * s).
    noclip: scale (hi - lo) / 14 and z rounded up, so no value clips."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        t, h, d = x.shape
        g = x.reshape(t // unit, unit, h, d)
        lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
        # The scale grows where a narrow channel far from 0 needs |z| > 127.
        s = _fp16(torch.maximum((hi - lo) / (14 if noclip else 15), lo.abs() / 127))
        z = (-lo / s).ceil() if noclip else (-lo / s).round()
        z = z.clamp(-128, 127)
        q = ((g / s).round() + z).clamp(0, 15)
        return ((q - z) * s).reshape(t, h, d)

    return apply


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(torch.float32)


def _k4_sub8(unit: int = 16, kind: str = "e4m3"):
    """4-bit symmetric per channel over `unit` tokens with an 8-bit scale:
    E4M3 relative to one FP16 base per head and page (round to nearest), or
    log2 (an 8-bit power-of-two exponent, rounded up: nothing clips)."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        t, h, d = x.shape
        g = x.reshape(t // PAGE, PAGE // unit, unit, h, d)
        s = g.abs().amax(2, keepdim=True) / 7
        if kind == "e4m3":
            base = _fp16(s.amax((1, 4), keepdim=True) / 448)
            s = _e4m3(s / base) * base
        else:
            s = torch.exp2(torch.log2(s.clamp_min(2.0**-126)).ceil())
        s = s.clamp_min(1e-30)
        return ((g / s).round().clamp(-7, 7) * s).reshape(t, h, d)

    return apply


def _k4_two_level_asym(unit: int = 32):
    """4-bit asymmetric per channel: an FP16 minimum L and range R per channel
    and page, and per `unit` tokens two 4-bit codes a, b (range L + R * a / 16
    to L + R * (b + 1) / 16, rounded outward so nothing clips)."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        t, h, d = x.shape
        g = x.reshape(t // PAGE, PAGE // unit, unit, h, d)
        lo = _half(g.amin((1, 2), keepdim=True))
        rng = _fp16(g.amax((1, 2), keepdim=True) - lo)
        a = ((g.amin(2, keepdim=True) - lo) / rng * 16).floor().clamp(0, 15)
        b = ((g.amax(2, keepdim=True) - lo) / rng * 16).ceil()
        b = torch.maximum(b, a + 1).clamp_max(16)
        sub_lo = lo + rng * a / 16
        s = (rng * (b - a) / 16 / 15).clamp_min(1e-30)
        q = ((g - sub_lo) / s).round().clamp(0, 15)
        return (q * s + sub_lo).reshape(t, h, d)

    return apply


def _k4_two_level(unit: int = 16, bits: int = 4):
    """4-bit symmetric per channel: an FP16 scale S per channel and page, and a
    `bits`-bit sub-scale c per `unit` tokens (scale S * c / 2**bits, c rounded
    up so nothing clips)."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        t, h, d = x.shape
        g = x.reshape(t // PAGE, PAGE // unit, unit, h, d)
        top = _fp16(g.abs().amax((1, 2), keepdim=True) / 7)
        n = 2**bits
        c = (g.abs().amax(2, keepdim=True) / (7 * top) * n).ceil().clamp(1, n)
        s = top * c / n
        return ((g / s).round().clamp(-7, 7) * s).reshape(t, h, d)

    return apply


def _sink(fn):
    """fn, with the first page's keys at 8 bits per channel (the sink page;
    the shipped sink store keeps INT8 per head row, int8's loss on Gemma)."""

    def apply(k: torch.Tensor) -> torch.Tensor:
        out = fn(k)
        out[:PAGE] = _k8c(k[:PAGE])
        return out

    return apply


# Per-layer plans: (layer index, each layer's attention kind) -> 8-bit keys.
def _full_layers(i: int, kinds: list) -> bool:
    return kinds[i] == "full"


def _first(count: int):
    return lambda i, kinds: i < count


def _layers(*which: int):
    return lambda i, kinds: i in which


def plan_keys8(i: int, kinds: list) -> bool:
    """The layer plan rule: 8-bit keys on the full-attention layers of a model
    with sliding-window layers, else on the first len(kinds) // 12 (3 of 36)."""
    if any(k is not None and k != "full" for k in kinds):
        return kinds[i] == "full"
    return i < max(1, len(kinds) // 12)


def _planned(rule, values=_asym4_tokens, keys4=None, keys8=_k8c):
    keys4 = keys4 or _k4()
    return lambda i, kinds: (keys8 if rule(i, kinds) else keys4, values)


# Bytes per token of the 4-bit candidates: (4-bit key unit, sink page, plan,
# value group, key metadata bytes per channel per page, per head per page).
SPECS = {}


def _spec(
    name: str,
    unit: int = PAGE,
    sink: bool = False,
    plan=None,
    vgroup: int = 64,
    kmeta: float | None = None,
    khead: float = 0.0,
) -> str:
    # kmeta defaults to an FP16 scale and an FP16 zero point per `unit` tokens.
    kmeta = 4.0 * PAGE / unit if kmeta is None else kmeta
    SPECS[name] = (unit, sink, plan, vgroup, kmeta, khead)
    return name


def bytes_per_token(
    name: str, kinds: list, heads: int, dim: int, seq_tokens: int = 4096
) -> float:
    """Host bytes per token of arm `name` (page 64), all layers."""
    unit, sink, plan, vgroup, kmeta, khead = SPECS[name]
    total = 0.0
    for i in range(len(kinds)):
        values = heads * dim / 2 + heads * (dim // vgroup) * 4
        if plan is not None and plan(i, kinds):
            keys = heads * dim + heads * dim * 4 / PAGE
        else:
            keys = heads * dim / 2 + (heads * dim * kmeta + heads * khead) / PAGE
            if sink:
                # The sink page's 8-bit keys (_k8c's bytes), one page per
                # sequence, beside the page's 4-bit copy.
                keys += (heads * dim + heads * dim * 4 / PAGE) * PAGE / seq_tokens
        total += keys + values
    return total


# (layer kinds, KV heads, head dim) of the capacity target's model and Gemma.
QWEN3_8B = (["full"] * 36, 8, 128)
GEMMA3_270M = ((["sliding (512)"] * 5 + ["full"]) * 3, 1, 256)


CANDIDATES = {
    # (keys, values)
    "int8_head": (sym8_tokens, sym8_tokens),
    "int8_head_keys_only": (sym8_tokens, _none),
    "int8_g32": (lambda k: sym8_tokens(k, 32), sym8_tokens),
    "int8_channel_sym": (lambda k: _per_channel(k, 255, True), sym8_tokens),
    "int8_channel_asym": (lambda k: _per_channel(k, 256, False), sym8_tokens),
    "int8_channel_asym_values_bf16": (lambda k: _per_channel(k, 256, False), _none),
    "int8_channel_asym_values_g64": (
        lambda k: _per_channel(k, 256, False),
        lambda v: sym8_tokens(v, 64),
    ),
    _spec("int4"): (lambda k: _per_channel(k, 16, False), _asym4_tokens),
    _spec("int4_rot_kv"): (
        _rotated(lambda k: _per_channel(k, 16, False)),
        _rotated(_asym4_tokens),
    ),
    _spec("int4_rot_v"): (
        lambda k: _per_channel(k, 16, False),
        _rotated(_asym4_tokens),
    ),
    "int4_v8": (lambda k: _per_channel(k, 16, False), sym8_tokens),
    # 4-bit candidates for QK-normed models (issue 35, items 2 and 3)
    _spec("int4_k32", 32): (_k4(32), _asym4_tokens),
    _spec("int4_k16", 16): (_k4(16), _asym4_tokens),
    _spec("int4_k32_rot_v", 32): (_k4(32), _rotated(_asym4_tokens)),
    _spec("int4_sink", sink=True): (_sink(_k4()), _asym4_tokens),
    _spec("int4_rot_v_sink", sink=True): (_sink(_k4()), _rotated(_asym4_tokens)),
    _spec("int4r_sink", sink=True): (_sink(_rotated(_k4())), _rotated(_asym4_tokens)),
    _spec("k8_full", plan=_full_layers): _planned(_full_layers),
    _spec("k8_full_rot_v", plan=_full_layers): _planned(
        _full_layers, _rotated(_asym4_tokens)
    ),
    _spec("k8_full_rot_v_sink", sink=True, plan=_full_layers): _planned(
        _full_layers, _rotated(_asym4_tokens), _sink(_k4())
    ),
    _spec("k8_first3", plan=_first(3)): _planned(_first(3)),
    _spec("k8_first3_rot_v_sink", sink=True, plan=_first(3)): _planned(
        _first(3), _rotated(_asym4_tokens), _sink(_k4())
    ),
    _spec("k8_full_k32_rot_v", 32, plan=_full_layers): _planned(
        _full_layers, _rotated(_asym4_tokens), _k4(32)
    ),
}
# The layer plan rule (plan_keys8): on Gemma 3 the same layers as k8_full.
CANDIDATES[_spec("k8_plan", plan=plan_keys8)] = _planned(plan_keys8)
CANDIDATES[_spec("k8_plan_rot_v", plan=plan_keys8)] = _planned(
    plan_keys8, _rotated(_asym4_tokens)
)
# Keys per channel over 32 tokens paid for with 128-channel value groups.
_v128 = _rotated(lambda v: _asym4_tokens(v, 128))
CANDIDATES[_spec("int4_k32_rot_v128", 32, vgroup=128)] = (_k4(32), _v128)
CANDIDATES[_spec("k8_plan_k32_rot_v128", 32, plan=plan_keys8, vgroup=128)] = _planned(
    plan_keys8, _v128, _k4(32)
)
CANDIDATES[_spec("k8_first3_k32_rot_v", 32, plan=_first(3))] = _planned(
    _first(3), _rotated(_asym4_tokens), _k4(32)
)
CANDIDATES[_spec("int4_k16_rot_v", 16)] = (_k4(16), _rotated(_asym4_tokens))
# Cheaper key metadata (issue 35: metadata is what costs capacity); kmeta is
# the key metadata bytes per channel per 64-token page.
_v64 = _rotated(_asym4_tokens)
_KEYS = {
    # name: (4-bit keys, kmeta, khead)
    "k32s": (_k4s(32), 4.0, 0.0),  # FP16 scale per 32 tokens
    "k32z8": (_k4z8(32), 6.0, 0.0),  # FP16 scale + INT8 zero per 32 tokens
    "k16s": (_k4s(16), 8.0, 0.0),  # FP16 scale per 16 tokens
    "k16e4": (_k4_sub8(16, "e4m3"), 4.0, 2.0),  # E4M3 per 16, FP16 base
    "k16l2": (_k4_sub8(16, "log2"), 4.0, 0.0),  # log2 exponent per 16
    "k2l16": (_k4_two_level(16, 4), 4.0, 0.0),  # FP16/page + 4-bit per 16
    "k2l32": (_k4_two_level(32, 4), 3.0, 0.0),  # FP16/page + 4-bit per 32
    "k2l16b8": (_k4_two_level(16, 8), 6.0, 0.0),  # FP16/page + 8-bit per 16
    "k32z8n": (_k4z8(32, noclip=True), 6.0, 0.0),  # k32z8, nothing clips
    "k2l32a": (_k4_two_level_asym(32), 6.0, 0.0),  # FP16 min+range/page, 2x4 bits/32
    # k32z8 in the rotated basis (int4r's keys, per model: no QK-norm)
    "rk32z8": (_rotated(_k4z8(32)), 6.0, 0.0),
    "rk2l32a": (_rotated(_k4_two_level_asym(32)), 6.0, 0.0),
}
for _k, (_fn, _meta, _head) in _KEYS.items():
    for _vname, _vfn, _vg in (("rot_v", _v64, 64), ("rot_v128", _v128, 128)):
        _unit = 32 if "32" in _k else 16
        CANDIDATES[
            _spec(f"int4_{_k}_{_vname}", _unit, False, None, _vg, _meta, _head)
        ] = (_fn, _vfn)
        _name = _spec(
            f"k8_plan_{_k}_{_vname}", _unit, False, plan_keys8, _vg, _meta, _head
        )
        CANDIDATES[_name] = _planned(plan_keys8, _vfn, _fn)
# The sink page (8-bit keys of each sequence's first page) on the cheaper keys:
# Llama-style models' 4-bit pick (int4r_sink) keeps one.
for _k in ("k2l32a", "rk2l32a", "k32z8n", "rk32z8"):
    _fn, _meta, _head = _KEYS[_k]
    for _vname, _vfn, _vg in (("rot_v", _v64, 64), ("rot_v128", _v128, 128)):
        _name = _spec(f"int4_{_k}_{_vname}_sink", 32, True, None, _vg, _meta, _head)
        CANDIDATES[_name] = (_sink(_fn), _vfn)
for _i in range(18):
    # One layer's keys at 8 bits: where the 4-bit keys' loss sits.
    _name = _spec(f"k8_layer{_i}", plan=_layers(_i))
    CANDIDATES[_name] = _planned(_layers(_i))
DEFAULT_ARMS = [n for n in CANDIDATES if not n.startswith("k8_layer")]


def _layer_fns(candidate, i: int, kinds: list):
    return candidate if isinstance(candidate, tuple) else candidate(i, kinds)


def _ratio(name: str) -> str:
    if name not in SPECS:
        return "- | -"
    return " | ".join(
        f"{4 * h * d * len(kinds) / bytes_per_token(name, kinds, h, d):.3f}x"
        for kinds, h, d in (QWEN3_8B, GEMMA3_270M)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--score-len", type=int, default=512)
    p.add_argument("--text-file", default="../shared/data/wikitext-2/test.txt")
    p.add_argument(
        "--text",
        default="wikitext-2",
        choices=["wikitext-2", *texts.CODE_TEXTS, *texts.DOC_TEXTS],
        help="wikitext-2 reads --text-file; the others read the installed Python",
    )
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="comma list")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.prefix_len % PAGE:
        p.error(f"--prefix-len must be a multiple of {PAGE}")
    torch.set_num_threads(args.threads)
    names = ["bf16", *args.arms.split(",")]
    bundle = hq.load_model(args.model)
    named = {**texts.CODE_TEXTS, **texts.DOC_TEXTS}
    text = named[args.text]() if args.text in named else texts.wikitext(args.text_file)
    ids, _ = hq.tokenize_text(bundle.tokenizer, text)
    bos = bundle.info.get("bos_token_id")
    span = args.prefix_len + args.score_len + 1
    scored = {n: [] for n in [*names, "fp32_kv"]}
    start = time.perf_counter()
    for offset in hq.pick_windows(len(ids), span, args.windows, 0):
        window = ids[offset : offset + span]
        if bos is not None:
            window = [bos, *window[:-1]]
        prefix = window[: args.prefix_len]
        kv = hq.prefill_kv(bundle.model, prefix, torch.bfloat16)
        arms = [kv]
        kinds = hq.layer_kinds(bundle.model, len(kv))
        for name in names[1:]:
            arm = []
            for i, (k, v) in enumerate(kv):
                fk, fv = _layer_fns(CANDIDATES[name], i, kinds)
                arm.append((fk(k.float()).bfloat16(), fv(v.float()).bfloat16()))
            arms.append(arm)
        arms.append(hq.prefill_kv(bundle.model, prefix, torch.float32))
        inputs = window[args.prefix_len : args.prefix_len + args.score_len]
        outs = hq.score_and_generate(bundle.model, arms, inputs, 0)
        targets = torch.tensor(window[args.prefix_len + 1 :])
        for name, (logits, _) in zip(scored, outs):
            scored[name].append(hq.compare_logits(outs[0][0], logits, targets))
        print(f"window @ {offset}: {time.perf_counter() - start:.0f} s", flush=True)
    base = torch.cat([c["lp_arm"] for c in scored["bf16"]]).neg().mean()
    print(f"\n{args.model}, {args.text}, {args.windows} windows, vs the BF16 KV")
    print(
        "| arm | top-1 | flips | mean KL | PPL delta | BF16 / host bytes, "
        "Qwen3-8B | Gemma 3 |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for name, parts in scored.items():
        top1 = torch.cat([c["top1"] for c in parts]).float()
        kl = torch.cat([c["kl"] for c in parts]).mean()
        nll = torch.cat([c["lp_arm"] for c in parts]).neg().mean()
        print(
            f"| {name} | {100 * top1.mean():.2f}% | {int((top1 == 0).sum())} "
            f"| {kl:.2e} | {100 * (math.exp(nll - base) - 1):+.3f}% | {_ratio(name)} |"
        )


if __name__ == "__main__":
    main()
