#!/usr/bin/env python3
"""Quality of KV restored from the HiCache host (L2) pool: CPU mode (`make quality`).

Exits 2 if a prefix did not come back from L2, 1 with --check-targets on a miss."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from scripts.common.cpu_sglang import install_cpu_standins
from scripts.quality import harness as hq
from scripts.quality import texts

LONG_PREFIX = 2048


def _layouts(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        arm, sep, layout = item.partition("=")
        if not sep or not arm or not layout:
            raise argparse.ArgumentTypeError(f"--layout wants ARM=LAYOUT, got {item!r}")
        out[arm] = layout
    return out


def _arm_list(text: str) -> tuple[str, ...] | None:
    return tuple(a.strip() for a in text.split(",") if a.strip()) or None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.quality", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--text-file", default=None, help="WikiText-2's test split")
    p.add_argument(
        "--mla-random",
        action="store_true",
        help="MLA latent KV of a random-weight DeepSeek-V2 (not a quality figure)",
    )
    p.add_argument(
        "--mla-layers", dest="layers", type=int, default=3, metavar="MLA_LAYERS"
    )
    p.add_argument(
        "--code-text", choices=[*texts.CODE_TEXTS, "none"], default="python-stdlib"
    )
    p.add_argument("--doc-text", choices=[*texts.DOC_TEXTS, "none"], default="none")
    p.add_argument(
        "--model",
        default=None,
        help="%s, an HF causal LM or a .gguf file" % ", ".join(hq.PACKAGED_MODELS),
    )
    p.add_argument("--windows", type=int, default=None, help=f"{hq.TARGET_WINDOWS}")
    p.add_argument("--prefix-len", type=int, default=None, help=f"{hq.TARGET_PREFIX}")
    p.add_argument(
        "--long",
        action="store_true",
        help=f"one window of {LONG_PREFIX} prefix tokens "
        f"(= --prefix-len {LONG_PREFIX} --windows 1; past Gemma 3's 512-token window)",
    )
    p.add_argument("--score-len", type=int, default=hq.TARGET_SCORED)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="window sampling seed")
    p.add_argument("--kv-dtype", choices=sorted(hq.KV_DTYPES), default="bf16")
    p.add_argument("--page-size", type=int, default=None, help="every arm's")
    p.add_argument("--arms", type=_arm_list, default=None, help="comma list")
    p.add_argument("--layout", action="append", default=[], metavar="ARM=LAYOUT")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out-dir", default="results")
    p.add_argument("--name", default=None, help="output file stem")
    p.add_argument("--check-targets", action="store_true")
    p.add_argument("--no-restore", action="store_true", help="must refuse to report")
    args = p.parse_args(argv)
    if args.text_file is None and not args.mla_random:
        p.error("--text-file is required (or pass --mla-random)")
    if args.long:
        given = [
            f
            for f, v in (("--prefix-len", args.prefix_len), ("--windows", args.windows))
            if v is not None
        ]
        if given:
            p.error(
                f"--long sets --prefix-len {LONG_PREFIX} --windows 1; drop {' '.join(given)}"
            )
        args.prefix_len, args.windows = LONG_PREFIX, 1
    args.windows = hq.TARGET_WINDOWS if args.windows is None else args.windows
    args.prefix_len = hq.TARGET_PREFIX if args.prefix_len is None else args.prefix_len
    if args.name is None:
        args.name = "quality_mla_random" if args.mla_random else "quality_cpu"
    return args


def _log(line: str) -> None:
    print(line, flush=True)


def _config(cls, args, **override):
    """A `cls` config of the options named as its fields, unset ones at defaults."""
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in given.items() if v is not None}, **override})


def main_mla_random(args, command: str, layouts: dict, standins: list[str]) -> int:
    """--mla-random: the MLA restore path on a random-weight DeepSeek-V2."""
    from scripts.quality import mla_random

    layouts = {**mla_random.MLARandomConfig().layouts, **layouts}
    cfg = _config(mla_random.MLARandomConfig, args, layouts=layouts)
    try:
        report = mla_random.run_mla_random(cfg, standins, log=_log)
    except hq.RestoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    paths = hq.write_json_and_markdown(
        report, args.out_dir, args.name, command, mla_random.markdown_report
    )
    print(f"\n{mla_random.markdown_report(report, command)}")
    print("wrote " + ", ".join(paths.values()))
    if report["control_bit_identical"] is False:
        print("error: the stock BF16 control differs from exact", file=sys.stderr)
        return 1
    return 0


def text_sources(args) -> dict[str, texts.TextSource]:
    """Output-name suffix -> text: WikiText-2 keeps the plain name."""
    sources = {"": texts.wikitext(args.text_file)}
    if args.code_text != "none":
        sources["_code"] = texts.CODE_TEXTS[args.code_text]()
    if args.doc_text != "none":
        sources["_docs"] = texts.DOC_TEXTS[args.doc_text]()
    return sources


def main(argv=None, bundle: hq.ModelBundle | None = None) -> int:
    args = parse_args(argv)
    command = "-m scripts.quality " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    try:
        layouts = _layouts(args.layout)
    except argparse.ArgumentTypeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    standins = install_cpu_standins()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.mla_random:
        return main_mla_random(args, command, layouts, standins)
    if bundle is None:
        _log("loading model ...")
        bundle = hq.load_model(args.model)
        _log(f"model: {bundle.info['model']} ({bundle.info['load_seconds']} s)")
    reports, written = {}, []
    for suffix, source in text_sources(args).items():
        restore = not args.no_restore
        cfg = _config(
            hq.QualityConfig, args, text_file=source, layouts=layouts, restore=restore
        )
        _log(f"== {source.name} ({source.kind})")
        try:
            report = hq.run_quality(cfg, bundle, standins, log=_log)
        except (hq.RestoreError, ValueError, FileNotFoundError) as exc:
            print(f"error: {source.name}: {exc}", file=sys.stderr)
            return 2
        paths = hq.write_outputs(report, args.out_dir, args.name + suffix, command)
        print(f"\n{hq.markdown_report(report, command)}")
        reports[source.name] = report
        written += paths.values()
    summary_path = Path(args.out_dir) / f"{args.name}_summary.md"
    summary_path.write_text(hq.summary_markdown(reports))
    print(summary_path.read_text())
    print("wrote " + ", ".join([*written, str(summary_path)]))
    print("\nTargets per model x text cell:\n" + "\n".join(hq.verdict_lines(reports)))
    missed = [name for name, r in reports.items() if not hq.targets_met(r)]
    if args.check_targets and missed:
        print(f"error: quality targets missed on {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
