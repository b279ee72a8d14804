"""Shared by tests/gpu/ and scripts/gpu_bench.py (imported from the repository
root, as scripts.rigs.gpu): stand-ins for what a bare
CUDA machine lacks, and builders for real SGLang pools on a chosen device.

A bare CUDA machine (PyTorch + Triton, sglang installed --no-deps) lacks
sglang-kernel. With CUDA present, sglang imports `sgl_kernel` (and
`sgl_kernel.kvcacheio`, the host pools' transfer kernels) at module level,
unguarded. install_gpu_standins() therefore puts a stub package in place when
the real one does not import: any attribute is a function that raises
NotImplementedError naming itself (none of the code under test calls one),
except kvcacheio.transfer_kv_direct, the pure-torch stand-in from
scripts/rigs/standins.py. `sgl_kernel.scalar_type` is left missing on purpose:
sglang falls back to its own mock for it, and a stub would break that.
torchvision is stubbed the same way as on CPU only if the real one fails to
import. Nothing else is replaced: pinned memory (cudaHostRegister) is real.

Dry run: with HIQ_GPU_TEST_DEVICE=cpu (and TRITON_INTERPRET=1 in the
environment before triton is imported), the same code runs on CPU, which is
how scripts/gpu_check.sh --dry-run checks everything but CUDA itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch

# The host layouts the GPU tests cover (tests/support/conformance.py's, kept
# here: the GPU phase imports no SGLang module before its stand-ins).
LAYOUTS = ("page_first", "page_first_direct", "layer_first")
QWEN3_8B = dict(layer_num=36, head_num=8, head_dim=128, v_head_dim=128)
CARRIED_PACKAGES = (
    Path(__file__).resolve().parents[2] / "tests" / "gpu" / "carried_packages.txt"
)
# What the machine must provide itself (too large to carry).
PROVIDED_PACKAGES = {"torch": "torch", "triton": "triton", "numpy": "numpy"}
# The modules the GPU check exercises, imported once by each phase.
MODULES_UNDER_TEST = (
    "pytest",
    "triton",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.host_format",
    "sglang.srt.mem_cache.pool_host.encoded",
    "sglang.srt.mem_cache.pool_host.encoded_fused",
    "sglang.srt.mem_cache.pool_host.mha_encoded",
    "sglang.kernels.ops.kvcache.kv_int8_triton",
    "sglang.srt.mem_cache.pool_host.kv_mla_int8_codec",
    "sglang.srt.mem_cache.pool_host.mla_encoded",
    "sglang.kernels.ops.kvcache.kv_mla_int8_triton",
    "sglang.kernels.ops.kvcache.kv_int4_triton",
    "sglang.srt.mem_cache.allocator.token",
    "sglang.srt.managers.cache_controller",
)


def gpu_test_device() -> str | None:
    """The device GPU tests run on: HIQ_GPU_TEST_DEVICE, else cuda if present."""
    forced = os.environ.get("HIQ_GPU_TEST_DEVICE")
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else None


DEVICE = gpu_test_device()
CUDA = DEVICE == "cuda"
# GPU clock cycles for torch.cuda._sleep: ~0.25-0.5 s on current parts.
DELAY = int(5e8)


def gpu_test_marks() -> list:
    """The marks of every GPU test (tests/gpu/conftest.py): skipped without a
    device; numpy (the dry run's interpreter) warns about the lanes kernels
    mask out."""
    import pytest

    return [
        pytest.mark.skipif(
            DEVICE is None, reason="needs CUDA (or HIQ_GPU_TEST_DEVICE)"
        ),
        pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    ]


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def big_tiles_when_interpreted(monkeypatch, kernels, tile: int) -> None:
    """Dry run: fewer, larger programs in the kernel module `kernels` (the
    interpreter's cost is per program; tile sizes do not change results, see
    the module's CPU tests in tests/test_kv_*_triton.py)."""
    if not CUDA:
        monkeypatch.setattr(kernels, "ENCODE_TILE", tile)
        monkeypatch.setattr(kernels, "DECODE_TILE", tile)


# --------------------------------------------------------------------------
# what the machine has


class MissingPackage(Exception):
    """A package the GPU check needs is not installed (message: which)."""


def carried_packages() -> dict[str, str]:
    """module -> distribution for every package gpu_check.sh carries."""
    pairs = {}
    for line in CARRIED_PACKAGES.read_text().splitlines():
        line = line.split("#", 1)[0].split()
        if line:
            dist, module = line
            pairs[module] = dist
    return pairs


def missing_packages() -> list[str]:
    """'dist (module)' for each needed top-level module this Python cannot
    find, without importing anything."""
    wanted = {**PROVIDED_PACKAGES, **carried_packages()}
    return [
        f"{dist} ({module})"
        for module, dist in wanted.items()
        if importlib.util.find_spec(module) is None
    ]


def import_modules_under_test() -> None:
    """Import what the check exercises (stand-ins first). A module missing from
    the environment raises MissingPackage naming it, not a traceback."""
    install_gpu_standins()
    carried = carried_packages()
    for name in MODULES_UNDER_TEST:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not e.name or e.name.startswith("sglang"):
                raise
            top = e.name.split(".")[0]
            dist = carried.get(top, PROVIDED_PACKAGES.get(top, top))
            raise MissingPackage(
                f"{dist} (module {top}, imported by {name}); add it to "
                f"{CARRIED_PACKAGES.name} and run 'gpu_check.sh prepare'"
            ) from None


# --------------------------------------------------------------------------
# stand-ins


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        qualified = f"{self.__name__}.{name}"

        def missing(*args, **kwargs):
            raise NotImplementedError(
                f"{qualified} is a stand-in: sglang-kernel is not installed here"
            )

        missing.__name__ = name
        setattr(self, name, missing)
        return missing


class _SglKernelStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ABSENT = ("sgl_kernel.scalar_type",)

    def find_spec(self, fullname, path, target=None):
        if fullname != "sgl_kernel" and not fullname.startswith("sgl_kernel."):
            return None
        if fullname in self.ABSENT:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__hiq_stub__ = True
        if spec.name == "sgl_kernel.kvcacheio":
            from scripts.rigs.standins import transfer_kv_direct

            module.transfer_kv_direct = transfer_kv_direct
        return module

    def exec_module(self, module):
        pass


def _drop_modules(prefix: str) -> None:
    for name in list(sys.modules):
        if name == prefix or name.startswith(prefix + "."):
            del sys.modules[name]


def install_gpu_standins() -> dict[str, str]:
    """Stand-ins for what this machine lacks; returns what was used."""
    used = {}
    if "torchvision" not in sys.modules:
        try:
            import torchvision.transforms  # noqa: F401

            used["torchvision"] = "real"
        except Exception as e:  # missing, or built for another torch
            _drop_modules("torchvision")
            from scripts.rigs.standins import install_torchvision_stub

            install_torchvision_stub()
            used["torchvision"] = f"stub ({type(e).__name__})"
    else:
        used["torchvision"] = "already imported"
    if any(isinstance(f, _SglKernelStubFinder) for f in sys.meta_path):
        used["sgl_kernel"] = "stub"
        return used
    try:
        import sgl_kernel.kvcacheio  # noqa: F401

        used["sgl_kernel"] = "real"
    except Exception as e:
        _drop_modules("sgl_kernel")
        sys.meta_path.insert(0, _SglKernelStubFinder())
        used["sgl_kernel"] = f"stub ({type(e).__name__})"
    return used


# --------------------------------------------------------------------------
# pools


def make_device_pool(
    *,
    layer_num: int,
    head_num: int,
    head_dim: int,
    v_head_dim: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 1,
    tokens: int,
    device: str,
):
    from scripts.rigs import hicache_harness as hh

    geo = hh.Geometry(layer_num, head_num, head_dim, v_head_dim, dtype, page_size)
    return hh.make_device_pool(geo, tokens, device=device)


def make_host_pool(
    device_pool, *, cls, layout: str, host_tokens: int, pin_memory: bool, **extra
):
    """extra: the pool's own constructor keywords (fused_transfer, run_copies)."""
    from scripts.rigs import hicache_harness as hh

    return hh.make_host_pool(
        device_pool,
        host_tokens=host_tokens,
        layout=layout,
        host_pool_cls=cls,
        pin_memory=pin_memory,
        **extra,
    )


def make_mla_device_pool(
    *,
    layer_num: int,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 1,
    tokens: int,
    device: str,
):
    """SGLang's MLA latent pool; DeepSeek V2/V3 widths by default."""
    from scripts.rigs import hicache_harness as hh

    geo = hh.MLAGeometry(layer_num, kv_lora_rank, qk_rope_head_dim, dtype, page_size)
    return hh.make_device_pool(geo, tokens, device=device)


def make_mla_host_pool(device_pool, *, layout: str, host_tokens: int, pin_memory: bool):
    """The MLA INT8 host pool as hybrid_pool_assembler builds it."""
    from scripts.rigs import hicache_harness as hh

    return hh.make_host_pool(
        device_pool,
        host_tokens=host_tokens,
        layout=layout,
        host_dtype="int8",
        pin_memory=pin_memory,
    )


def destroy_host_pool(pool) -> None:
    """Unregister pinned host memory now (tests build many pools)."""
    destroy = getattr(pool, "destroy", None)
    if destroy is not None:
        try:
            destroy()
        except Exception:
            pass


def pages_to_tokens(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype/shape, same NaN positions, same bits elsewhere."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        if not torch.equal(na, nb):
            return False
        a, b = a.masked_fill(na, 0), b.masked_fill(nb, 0)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}
    return torch.equal(
        a.contiguous().view(ints[a.element_size()]),
        b.contiguous().view(ints[b.element_size()]),
    )


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def env_summary() -> dict:
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:
        info["triton"] = f"missing ({e})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["sm_count"] = props.multi_processor_count
    try:
        import sglang

        info["sglang_file"] = sglang.__file__
    except Exception:
        pass
    info["cpu_count"] = os.cpu_count()
    info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "")
    return info


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
