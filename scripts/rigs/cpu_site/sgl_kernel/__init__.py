"""Import-only stand-in for sgl-kernel (SGLang's compiled CUDA/CPU op wheel).

Replaces: the sgl-kernel wheel, which does not import without CUDA libraries.
On CPU, SGLang imports a few ``*_cpu`` names from it at module level but the
server paths the tests run never call them. This stand-in is strict so that
SGLang's own fallbacks still run:

- only the names in ``CPU_OP_NAMES`` exist; ``from sgl_kernel import X`` of
  any other name raises ImportError, and submodules (``sgl_kernel.kvcacheio``)
  do not exist;
- nothing is registered in ``torch.ops.sgl_kernel``, so ``cpu_has_amx_support()``
  stays False and layers take ``forward_native``;
- every call is logged as a JSON line to the file named by
  ``HIQ_SGL_KERNEL_LOG`` and then raises NotImplementedError (no silent
  wrong answers); each process that imports the stand-in logs one ``load``
  line, so a test can tell "loaded, never called" from "never loaded";
- with ``HIQ_SGL_KERNEL_TORCH_OPS=1`` (the speculative-decoding live tests),
  a logged call runs the pure-torch op of the same name in
  scripts/rigs/standins.py instead of raising (CPU speculative decoding
  calls these ops every step).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

LOG_ENV = "HIQ_SGL_KERNEL_LOG"
TORCH_OPS_ENV = "HIQ_SGL_KERNEL_TORCH_OPS"

# The names SGLang 0.5.23 imports from sgl_kernel at module level when is_cpu().
CPU_OP_NAMES = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)


def _log(event: str, **fields) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), **fields})
    # One short O_APPEND write per line keeps lines whole across processes.
    with open(path, "a", encoding="utf-8") as log:
        log.write(line + "\n")


def _torch_op(name: str):
    """The pure-torch op of this name from scripts/rigs/standins.py, loaded by
    path under the name cpu_site/sitecustomize.py uses (one copy per process)."""
    import sys

    module = sys.modules.get("_hiq_cpu_standins")
    if module is None:
        path = Path(__file__).resolve().parents[2] / "standins.py"
        spec = importlib.util.spec_from_file_location("_hiq_cpu_standins", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["_hiq_cpu_standins"] = module
        spec.loader.exec_module(module)
    return getattr(module, name, None)


def _op(name: str):
    def call(*args, **kwargs):
        _log("call", op=name)
        if os.environ.get(TORCH_OPS_ENV) == "1":
            op = _torch_op(name)
            if op is not None:
                return op(*args, **kwargs)
        raise NotImplementedError(
            f"sgl_kernel.{name} is an import-only CPU test stand-in "
            f"(scripts/rigs/cpu_site/sgl_kernel); this server path needs the real op"
        )

    call.__name__ = call.__qualname__ = name
    return call


# torch.ops.sgl_kernel ops the intel_amx attention backend looks up; bound as
# plain attributes (nothing registered) only with HIQ_SGL_KERNEL_TORCH_OPS=1.
TORCH_OPS_NAMES = ("decode_attention_cpu", "extend_attention_cpu")

for _name in CPU_OP_NAMES:
    globals()[_name] = _op(_name)
if os.environ.get(TORCH_OPS_ENV) == "1":
    import torch

    for _name in TORCH_OPS_NAMES:
        setattr(torch.ops.sgl_kernel, _name, _op(_name))
del _name

__all__ = list(CPU_OP_NAMES)
_log("load", file=__file__)
