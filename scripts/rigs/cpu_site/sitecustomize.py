"""CPU stand-ins for every process of a live SGLang server (tools and tests only).

``scripts/rigs/server.py`` puts this folder first on PYTHONPATH of the
server it starts, so Python runs this file at start-up in the launcher and
in the tokenizer, scheduler and detokenizer processes it spawns (stand-ins
installed in the test process would not reach them). It installs:

- the ``sgl_kernel`` import-only stand-in (the ``sgl_kernel/`` package next to
  this file; replaces the CUDA-only sgl-kernel wheel);
- the torchvision import stub, before ``sglang`` runs (replaces PyPI
  torchvision, which is built for CUDA torch);
- pure-torch host<->device KV copies on ``pool_host.mha`` and ``.mla`` right
  after they import (replace sgl_kernel.kvcacheio, imported there only on
  CUDA/HIP);
- a no-op ``pool_host.common._cuda_host_register`` and ``pin_memory``
  False on every host pool once built (pinning host memory calls the CUDA
  runtime; the L3 prefetch's page buffers ask torch for pinned memory);
- with ``HIQ_SGL_KERNEL_TORCH_OPS=1`` (the speculative-decoding live tests),
  the platform fact ``has_amx`` overridden to True, so ``--attention-backend
  intel_amx`` (the only CPU backend with a draft path) is kept instead of
  falling back to torch_native; its AMX attention ops are then the pure-torch
  stand-ins the ``sgl_kernel`` stand-in binds, and ``cpu_has_amx_support()``
  (what the layers ask) stays False;
- ``pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES`` from
  ``HIQ_HOST_MEMORY_RESERVE_BYTES`` when set (the 10 GiB reserve is sized for
  GPU hosts; on this 24 GiB machine shared by parallel test runs it refuses
  even a 0.1 GB host pool).

The stand-ins come from ``scripts/rigs/standins.py``, loaded by path so the
repository root need not be on the server's path (the install-path tests
run SGLang from a venv, not from build/sglang).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

_STANDINS_FILE = Path(__file__).resolve().parents[1] / "standins.py"
_STANDINS_NAME = "_hiq_cpu_standins"


def _standins():
    module = sys.modules.get(_STANDINS_NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(_STANDINS_NAME, _STANDINS_FILE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_STANDINS_NAME] = module
        spec.loader.exec_module(module)
    return module


def _before_sglang(module) -> None:
    # sglang's config package imports torchvision.transforms at module level.
    _standins().install_torchvision_stub()


def _after_mha(module) -> None:
    s = _standins()
    module.transfer_kv_direct = s.transfer_kv_direct
    module.transfer_kv_all_layer_direct_lf_pf = s.transfer_kv_all_layer_direct_lf_pf
    module.transfer_kv_per_layer_direct_pf_lf = s.transfer_kv_per_layer_direct_pf_lf
    for name in KERNEL_IO_OPS:
        if hasattr(s, name):
            setattr(module, name, getattr(s, name))


def _after_mla(module) -> None:
    s = _standins()
    module.transfer_kv_direct = s.transfer_kv_direct
    module.transfer_kv_all_layer_direct_lf_pf = s.transfer_kv_all_layer_direct_lf_pf_mla
    module.transfer_kv_per_layer_direct_pf_lf = s.transfer_kv_per_layer_direct_pf_lf


def _after_common(module) -> None:
    module._cuda_host_register = lambda *args, **kwargs: None


def _after_base(module) -> None:
    reserve = os.environ.get("HIQ_HOST_MEMORY_RESERVE_BYTES")
    if reserve:
        module.HICACHE_HOST_MEMORY_RESERVE_BYTES = int(reserve)
    init = module.HostKVCache.__init__

    @functools.wraps(init)
    def init_unpinned(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # Later page buffers (L3 prefetch) ask torch for pinned memory.
        self.pin_memory = False

    module.HostKVCache.__init__ = init_unpinned


def _after_runtime_context(module) -> None:
    if os.environ.get("HIQ_SGL_KERNEL_TORCH_OPS") == "1":
        # Replaces the AMX CPU feature check of attention-backend selection only.
        module.get_platform()._install(has_amx=True)


# The stock MHA pool's `kernel` io backend ops, bound where standins.py has them.
KERNEL_IO_OPS = (
    "transfer_kv_per_layer",
    "transfer_kv_all_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_all_layer_lf_pf",
)

_BEFORE = {"sglang": _before_sglang}
_AFTER = {
    "sglang.srt.mem_cache.pool_host.mha": _after_mha,
    "sglang.srt.mem_cache.pool_host.mla": _after_mla,
    "sglang.srt.mem_cache.pool_host.common": _after_common,
    "sglang.srt.mem_cache.pool_host.base": _after_base,
    "sglang.srt.runtime_context": _after_runtime_context,
}


class _HookFinder(importlib.abc.MetaPathFinder):
    """Finds the hooked modules with the other finders, then wraps their
    loader's exec_module to run the hook around the module body."""

    def find_spec(self, fullname, path, target=None):
        before, after = _BEFORE.get(fullname), _AFTER.get(fullname)
        if before is None and after is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_with_hooks(module):
            if before is not None:
                before(module)
            exec_module(module)
            if after is not None:
                after(module)

        # Each source module has its own loader instance, so this stays local.
        loader.exec_module = exec_with_hooks
        return spec


if os.environ.get("HIQ_CPU_STANDINS", "1") != "0":
    sys.meta_path.insert(0, _HookFinder())
