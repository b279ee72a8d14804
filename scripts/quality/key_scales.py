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


def _per_channel(x: torch.Tensor, levels: int, symmetric: bool) -> torch.Tensor:
    """One group per channel over each PAGE tokens."""
    t, h, d = x.shape
    g = x.reshape(t // PAGE, PAGE, h, d)
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
    "int4": (lambda k: _per_channel(k, 16, False), _asym4_tokens),
    "int4_rot_kv": (
        _rotated(lambda k: _per_channel(k, 16, False)),
        _rotated(_asym4_tokens),
    ),
    "int4_rot_v": (lambda k: _per_channel(k, 16, False), _rotated(_asym4_tokens)),
    "int4_v8": (lambda k: _per_channel(k, 16, False), sym8_tokens),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--score-len", type=int, default=512)
    p.add_argument("--text-file", default="../shared/data/wikitext-2/test.txt")
    p.add_argument("--arms", default=",".join(CANDIDATES), help="comma list")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.prefix_len % PAGE:
        p.error(f"--prefix-len must be a multiple of {PAGE}")
    torch.set_num_threads(args.threads)
    names = ["bf16", *args.arms.split(",")]
    bundle = hq.load_model(args.model)
    ids, _ = hq.tokenize_text(bundle.tokenizer, texts.wikitext(args.text_file))
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
        for name in names[1:]:
            fk, fv = CANDIDATES[name]
            arms.append(
                [(fk(k.float()).bfloat16(), fv(v.float()).bfloat16()) for k, v in kv]
            )
        arms.append(hq.prefill_kv(bundle.model, prefix, torch.float32))
        inputs = window[args.prefix_len : args.prefix_len + args.score_len]
        outs = hq.score_and_generate(bundle.model, arms, inputs, 0)
        targets = torch.tensor(window[args.prefix_len + 1 :])
        for name, (logits, _) in zip(scored, outs):
            scored[name].append(hq.compare_logits(outs[0][0], logits, targets))
        print(f"window @ {offset}: {time.perf_counter() - start:.0f} s", flush=True)
    base = torch.cat([c["lp_arm"] for c in scored["bf16"]]).neg().mean()
    print(f"\n{args.model}, {args.windows} windows, vs the BF16 KV")
    print("| arm | top-1 | flips | mean KL | PPL delta |\n|---|---:|---:|---:|---:|")
    for name, parts in scored.items():
        top1 = torch.cat([c["top1"] for c in parts]).float()
        kl = torch.cat([c["kl"] for c in parts]).mean()
        nll = torch.cat([c["lp_arm"] for c in parts]).neg().mean()
        print(
            f"| {name} | {100 * top1.mean():.2f}% | {int((top1 == 0).sum())} "
            f"| {kl:.2e} | {100 * (math.exp(nll - base) - 1):+.3f}% |"
        )


if __name__ == "__main__":
    main()
