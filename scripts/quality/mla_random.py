"""MLA latent KV through the HiCache restore path, on a random-weight DeepSeek-V2
(not a quality figure; docs/results.md, "--mla-random")."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from scripts.quality import harness as hq

KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Offloaded arms: name -> (host dtype for get_mla_host_pool_cls, default layout).
OFFLOAD_ARMS = {"bf16": ("auto", "layer_first"), "int8": ("int8", "page_first")}
ALL_ARMS = ("exact", *OFFLOAD_ARMS)


@dataclass
class MLARandomConfig:
    """A small DeepSeek-V2 (MLA + MoE) with DeepSeek's latent widths."""

    layers: int = 3
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    hidden_size: int = 256
    heads: int = 4
    vocab_size: int = 1024
    # Weight init std: transformers' default for DeepSeek-V2.
    init_std: float = 0.02
    windows: int = 4
    prefix_len: int = 256
    score_len: int = 64
    kv_dtype: str = "bf16"
    page_size: int = 1
    layouts: dict = field(
        default_factory=lambda: {a: v[1] for a, v in OFFLOAD_ARMS.items()}
    )
    arms: tuple[str, ...] = ALL_ARMS
    seed: int = 0


def build_model(cfg: MLARandomConfig):
    """transformers' DeepseekV2ForCausalLM, seeded random fp32 weights; one dense
    layer first, MoE after, as DeepSeek."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=2 * cfg.hidden_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=None,  # DeepSeek-V2-Lite projects q directly
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=cfg.hidden_size // 2,
        first_k_dense_replace=1,
        max_position_embeddings=cfg.prefix_len + cfg.score_len + 16,
        initializer_range=cfg.init_std,
    )
    torch.manual_seed(cfg.seed)
    return DeepseekV2ForCausalLM(config).eval()


@torch.no_grad()
def prefill_latent(model, ids: torch.Tensor, kv_dtype: torch.dtype) -> list:
    """The prefix's MLA cache as SGLang's device rows, rounded to the L1 dtype."""
    cache = model(ids[None], use_cache=True).past_key_values
    return [
        torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)[:, None].to(kv_dtype)
        for layer in cache.layers
    ]


@torch.no_grad()
def score_from_latent(model, rows: Sequence[torch.Tensor], suffix: torch.Tensor):
    """Logits [len(suffix), vocab] of the continuation after the prefix's device
    rows (widened to the model's dtype)."""
    from transformers import DynamicCache

    rank = model.config.kv_lora_rank
    cache = DynamicCache(config=model.config)
    dtype = next(model.parameters()).dtype
    for layer, r in enumerate(rows):
        r = r[:, 0].to(dtype)[None, None]  # [1, 1, tokens, rank + rope]
        cache.update(r[..., :rank].contiguous(), r[..., rank:].contiguous(), layer)
    return model(suffix[None], past_key_values=cache, use_cache=True).logits[0].float()


class MLAOffloadRig(hq.OffloadRig):
    """SGLang's MLATokenToKVPool + the dispatched MLA host pool + the real
    HiCacheController (write_through, io backend direct), on CPU."""

    def __init__(self, cfg: MLARandomConfig, host_dtype: str, layout: str):
        from scripts.rigs.hicache_harness import MLAGeometry

        geo = MLAGeometry(
            layer_num=cfg.layers,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            dtype=KV_DTYPES[cfg.kv_dtype],
            page_size=cfg.page_size,
        )
        super().__init__(geo, host_dtype, layout, cfg.prefix_len)
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.describe["device_bytes_per_token"] = (
            cfg.layers * width * geo.dtype.itemsize
        )

    def round_trip(self, rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The restored rows; RestoreError unless every token came back finite."""
        restored, stats = super().round_trip(
            [(r,) for r in rows], first_page_is_sink=False
        )
        n, loaded = rows[0].shape[0], stats["loaded_tokens"]
        # The source rows hold no NaN, so a NaN row here was not restored.
        if loaded != n or stats["restored_tokens"] != n:
            raise hq.RestoreError(
                f"{self.describe['host_pool']}: {loaded}/{n} tokens loaded, "
                f"{stats['restored_tokens']}/{n} tokens' rows finite after the load"
            )
        return [r for (r,) in restored]


def run_mla_random(
    cfg: MLARandomConfig,
    standins: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Every arm on the same windows; the report dict."""
    t_start = time.perf_counter()
    arms = tuple(a for a in ALL_ARMS if a in cfg.arms or a == "exact")
    unknown = set(cfg.arms) - set(ALL_ARMS)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; choose from {ALL_ARMS}")
    model = build_model(cfg)
    rigs = {
        arm: MLAOffloadRig(cfg, OFFLOAD_ARMS[arm][0], cfg.layouts[arm])
        for arm in arms[1:]
    }
    gen = torch.Generator().manual_seed(cfg.seed)
    # Per arm: each window's compare_logits figures, the latent's squared error.
    scored, latent = {arm: [] for arm in arms}, dict.fromkeys(arms, (0.0, 0.0))
    rope_exact, ref_logits, rank = True, [], cfg.kv_lora_rank
    for w in range(cfg.windows):
        n = cfg.prefix_len + cfg.score_len
        ids = torch.randint(cfg.vocab_size, (n,), generator=gen)
        suffix = ids[cfg.prefix_len :]
        rows = prefill_latent(model, ids[: cfg.prefix_len], KV_DTYPES[cfg.kv_dtype])
        ref = score_from_latent(model, rows, suffix)
        ref_logits.append(ref.flatten())
        line = []
        for arm in arms:
            restored = rigs[arm].round_trip(rows) if arm in rigs else rows
            logits = score_from_latent(model, restored, suffix) if arm in rigs else ref
            cmp = hq.compare_logits(ref, logits, suffix)
            cmp["abs_err"] = (logits - ref).abs().flatten()
            scored[arm].append(cmp)
            pairs = list(zip(rows, restored))
            latent[arm] = hq.squared_error(
                ((r0[..., :rank], r1[..., :rank]) for r0, r1 in pairs), *latent[arm]
            )
            rope_exact &= hq.same_bytes(
                (r0[..., rank:], r1[..., rank:]) for r0, r1 in pairs
            )
            line.append(
                f"{arm}: max|dlogit| {float(cmp['abs_err'].max()):.3g}, "
                f"top-1 {float(cmp['top1'].double().mean()):.4f}"
            )
        log(f"window {w + 1}/{cfg.windows}: " + ", ".join(line))
    logit_std = float(torch.cat(ref_logits).double().std())
    summary = {arm: _summarize(scored[arm], latent[arm]) for arm in arms}
    return _report(cfg, model, summary, rigs, rope_exact, logit_std, standins, t_start)


def _report(cfg, model, summary, rigs, rope_exact, logit_std, standins, t_start):
    control = summary.get(hq.CONTROL_ARM)
    return {
        "kind": "mla_random",
        "caveat": (
            "random weights: these are not quality figures, only the effect of the "
            "host format on a DeepSeek-V2-architecture model's logits"
        ),
        "config": asdict(cfg),
        "model": {
            "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "compute_dtype": str(next(model.parameters()).dtype),
            "exact_logit_std": logit_std,
        },
        "arms": summary,
        "rigs": {arm: rig.describe for arm, rig in rigs.items()},
        "control_bit_identical": (
            None if control is None else control["max_abs_logit_err"] == 0.0
        ),
        "rope_bits_exact": rope_exact,
        "restore_path": (
            "MLATokenToKVPool -> HiCacheController.write -> MLA host pool -> NaN-wipe"
            " + free -> HiCacheController.load/start_loading -> MLATokenToKVPool"
        ),
        "cpu_standins": standins or [],
        "versions": hq.versions(),
        "seconds": round(time.perf_counter() - t_start, 1),
    }


def _summarize(scored: list[dict], latent: tuple[float, float]) -> dict:
    err, kl = hq.cat_scored(scored, "abs_err").double(), hq.cat_scored(scored, "kl")
    num, den = latent
    return {
        "max_abs_logit_err": float(err.max()),
        "mean_abs_logit_err": float(err.mean()),
        "top1_agreement": float(hq.cat_scored(scored, "top1").double().mean()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "latent_rel_err": math.sqrt(num / den) if den else 0.0,
        "scored_tokens": int(kl.numel()),
    }


def markdown_report(report: dict, command: str | None = None) -> str:
    cfg, model = report["config"], report["model"]
    lines = [
        "# MLA latent KV restored from L2: random-weight DeepSeek-V2 (CPU)",
        "",
        f"**{report['caveat'][0].upper()}{report['caveat'][1:]}.**",
        "",
        f"Model: {model['class']}, {model['parameters']:,} "
        f"random parameters (seed {cfg['seed']}), {cfg['layers']} layers, "
        f"kv_lora_rank {cfg['kv_lora_rank']}, qk_rope_head_dim "
        f"{cfg['qk_rope_head_dim']}, computed in {model['compute_dtype']}; "
        f"L1 KV {cfg['kv_dtype']}. {cfg['windows']} windows of random tokens: "
        f"{cfg['prefix_len']} restored + {cfg['score_len']} scored. Exact logits "
        f"have std {model['exact_logit_std']:.3g} (scale for the errors).",
        "",
        f"Restore path: {report['restore_path']}.",
        "",
        "| arm | host pool | layout | B/token (host / L1) | max abs logit err "
        "| mean abs logit err | top-1 agreement | mean KL | latent rel err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, s in report["arms"].items():
        rig = report["rigs"].get(arm)
        pool, layout, size = "-", "-", "-"
        if rig:
            pool, layout = rig["host_pool"], rig["layout"]
            size = f"{rig['host_bytes_per_token']} / {rig['device_bytes_per_token']}"
        lines.append(
            f"| {arm} | {pool} | {layout} | {size} | {s['max_abs_logit_err']:.3g} "
            f"| {s['mean_abs_logit_err']:.3g} | {100 * s['top1_agreement']:.2f} % "
            f"| {s['mean_kl']:.3g} | {s['latent_rel_err']:.3g} |"
        )
    lines += [
        "",
        f"Control (stock BF16 MLA host pool) bit-identical to exact: "
        f"{report['control_bit_identical']}. RoPE part restored bit for bit in "
        f"every arm: {report['rope_bits_exact']}.",
        "",
        f"Run time {report['seconds']} s.",
    ]
    if command:
        lines += ["", f"Command: `python {command}`"]
    return "\n".join(lines) + "\n"
