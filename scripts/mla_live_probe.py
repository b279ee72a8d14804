"""Start the live CPU SGLang server on a tiny random-weight MLA model and
report how far it gets (a reproduction tool, not a test).

The model is scripts/rigs/mla_model.py's tiny DeepSeek-V3; the server is
scripts/rigs/server.py's LiveServer (CPU flags, stand-ins) with HiCache on.

    PYTHONPATH=build/sglang/python .venv/bin/python -m scripts.mla_live_probe \
        [--attention-backend intel_amx] [--tp 2] [--dedup] [--host-dtype int8]

With CPU_FLAGS' torch_native attention the first prefill fails (an MLA
model's MHA prefill against the pool's latent rows: docs/mla-dedup.md);
intel_amx (with the rigs' pure-torch AMX attention ops) serves, at --tp 2 too.

On start-up failure it prints the log's traceback; on success it sends one
prompt and prints the reply. One server at a time; it is stopped on exit.
"""

from __future__ import annotations

import argparse
import os
import sys

from scripts.rigs.mla_model import deepseek_v3_tiny_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument(
        "--dedup", action="store_true", help="add --enable-mla-hicache-host-dedup"
    )
    p.add_argument("--host-dtype", default="int8")
    p.add_argument(
        "--attention-backend", default=None, help="override CPU_FLAGS' torch_native"
    )
    p.add_argument(
        "--extra", nargs=argparse.REMAINDER, default=[], help="more server flags, last"
    )
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)

    from scripts.rigs.server import (
        CPU_FLAGS,
        SPEC_ENV,
        LiveServer,
        ServerStartError,
        hicache_flags,
        to_stderr,
        tp_env,
    )

    model = deepseek_v3_tiny_dir()
    print(f"[probe] model {model}", flush=True)
    extra = ["--tp", str(args.tp)]
    if args.dedup:
        extra.append("--enable-mla-hicache-host-dedup")
    if args.attention_backend:
        extra += ["--attention-backend", args.attention_backend]
    flags = [*CPU_FLAGS, *hicache_flags(args.host_dtype), *extra, *args.extra]
    name = f"mla-probe-tp{args.tp}{'-dedup' if args.dedup else ''}"
    # intel_amx needs the pure-torch AMX attention ops and platform override.
    env = dict(SPEC_ENV) if args.attention_backend == "intel_amx" else {}
    if args.tp > 1:
        env.update(tp_env(args.tp))
    server = LiveServer(
        flags,
        name=name,
        model=model,
        progress=to_stderr,
        env=env,
        startup_timeout=args.timeout,
    )
    print("[probe] flags: " + " ".join(flags), flush=True)
    try:
        server.start()
    except ServerStartError as exc:
        print(f"[probe] START FAILED, log {server.log_path}\n{exc}", flush=True)
        return 1
    try:
        reply = server.generate("The capital of France is", max_new_tokens=8)
        print(f"[probe] generate: {reply}", flush=True)
    except Exception as exc:  # the probe reports, it does not judge
        print(f"[probe] GENERATE FAILED: {exc!r}\n{server.log_tail(60)}")
        return 1
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
