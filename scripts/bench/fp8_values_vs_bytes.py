#!/usr/bin/env python3
"""Why int4/k8v4 encode an FP8 device KV by its values, not its bytes: the
restored error of both. Table: docs/fp8-device-kv.md."""

from __future__ import annotations

import torch

from scripts.common.cpu_sglang import install_cpu_standins

PAGE = 64
HEADS, DIM = 8, 128
PAGES = 32


def kv_rows(fp8: torch.dtype, keys: bool, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn((PAGES, PAGE, HEADS, DIM), generator=gen)
    if keys:
        gain = torch.ones(DIM)
        gain[::7] = 20.0
        x = x * gain + 2.0
    top = torch.finfo(fp8).max
    return x.clamp(-top, top).to(fp8)


def _reference(fmt: str):
    """The torch reference (encode, decode) of int4 or k8v4."""
    install_cpu_standins()
    from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec

    return (getattr(codec, f"{fmt}_{op}_reference") for op in ("encode", "decode"))


def by_values(fmt: str, k: torch.Tensor, v: torch.Tensor):
    encode, decode = _reference(fmt)
    return decode(encode(k, v), k.dtype)


def by_bytes(fmt: str, k: torch.Tensor, v: torch.Tensor):
    encode, decode = _reference(fmt)
    codes = [t.view(torch.uint8).to(torch.float32) for t in (k, v)]
    restored = decode(encode(*codes), torch.float32)
    return tuple(
        r.round().clamp(0, 255).to(torch.uint8).view(k.dtype) for r in restored
    )


def errors(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[float, float, int]:
    x, x_hat = x.double(), x_hat.double()
    finite = torch.isfinite(x_hat)
    lost = int((~finite).sum())
    diff = torch.where(finite, x_hat - x, torch.zeros_like(x))
    rel_rms = float(diff.norm() / x.norm())
    row_max = x.abs().amax(dim=-1, keepdim=True)
    rel_max = float((diff.abs() / row_max).max())
    return rel_rms, rel_max, lost


def main() -> None:
    print("fp8     fmt   side  encoding  rel RMS err  max err/row max  finite->NaN/Inf")
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        gen = torch.Generator().manual_seed(0)
        k, v = kv_rows(fp8, True, gen), kv_rows(fp8, False, gen)
        for fmt in ("int4", "k8v4"):
            for encoding, run in (("values", by_values), ("bytes", by_bytes)):
                for side, x, x_hat in zip("kv", (k, v), run(fmt, k, v)):
                    rms, worst, lost = errors(x, x_hat)
                    name = str(fp8).removeprefix("torch.float8_")
                    print(
                        f"{name:<7} {fmt:<5} {side:<5} {encoding:<8}  {rms:>11.4f}  "
                        f"{worst:>15.4f}  {lost:>15d}"
                    )


if __name__ == "__main__":
    main()
