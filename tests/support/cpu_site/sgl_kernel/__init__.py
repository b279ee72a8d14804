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
  line, so a test can tell "loaded, never called" from "never loaded".
"""

from __future__ import annotations

import json
import os

LOG_ENV = "HIQ_SGL_KERNEL_LOG"

# The names SGLang 0.5.23 imports from sgl_kernel at module level when is_cpu().
CPU_OP_NAMES = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
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


def _op(name: str):
    def call(*args, **kwargs):
        _log("call", op=name)
        raise NotImplementedError(
            f"sgl_kernel.{name} is an import-only CPU test stand-in "
            f"(tests/support/cpu_site/sgl_kernel); this server path needs the real op"
        )

    call.__name__ = call.__qualname__ = name
    return call


for _name in CPU_OP_NAMES:
    globals()[_name] = _op(_name)
del _name

__all__ = list(CPU_OP_NAMES)
_log("load", file=__file__)
