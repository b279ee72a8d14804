"""Gloo ranks as spawned processes: this module imports no SGLang before the CPU
stand-ins, then runs `target` ("module:function", called as function(rank, group,
**kwargs) -> dict)."""

from __future__ import annotations

import importlib
import json
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path


def _rank_main(rank, world, port, out_dir, target, kwargs) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # A spawned rank starts bare: install conftest's stand-ins first.
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from scripts.rigs.standins import (
            install_sglang_standins,
            install_torchvision_stub,
        )

        install_torchvision_stub()
        install_sglang_standins()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        group = dist.new_group(list(range(world)), backend="gloo")
        module, function = target.split(":")
        results = getattr(importlib.import_module(module), function)(
            rank, group, **kwargs
        )
    except BaseException:  # noqa: BLE001 - reported to the parent
        results = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # Skip destroy_process_group: a peer that errored may be gone.
    os._exit(0)


def run_ranks(out_dir: Path, world: int, target: str, kwargs: dict, timeout_s):
    """Each rank's result dict; fails on a hang, a missing result or an error."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, world, port, str(out_dir), target, kwargs)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung past {timeout_s}s"
    results = []
    for r in range(world):
        path = Path(out_dir) / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result"
        res = json.loads(path.read_text())
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        results.append(res)
    return results
