"""CPU stand-ins for the parts of SGLang that need CUDA hardware.

Test fixtures only: nothing here ships in the product. Each stand-in replaces
exactly one thing a CPU-only machine lacks and says which.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCHED_TREE = (
    Path(os.environ.get("HIQ_SGLANG_TREE") or REPO_ROOT / "build" / "sglang") / "python"
)


def install_torchvision_stub() -> None:
    """PyPI torchvision is built for CUDA torch and fails to import on the CPU
    wheel, yet sglang's config package imports torchvision.transforms at module
    level. Let transformers cache "torchvision unavailable" first, then stub."""
    if "torchvision" in sys.modules:
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()

    class InterpolationMode:
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        LANCZOS = "lanczos"

    # Only module attributes are touched at import time; calling into a stub
    # (any image transform) would be a test bug and fails loudly.
    names = (
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.functional",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    )
    for name in names:
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so submodule imports resolve
        # importlib.util.find_spec (datasets asks at import) needs a spec.
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.InterpolationMode = InterpolationMode
        sys.modules[name] = module
    for name in names[1:]:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, sys.modules[name])
    sys.modules["torchvision"].__version__ = "0.0.0-stub"


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Pure-torch stand-in for sgl_kernel.kvcacheio.transfer_kv_direct (absent
    without CUDA): copy rows src[src_indices] -> dst[dst_indices] per layer."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        rows = src.index_select(0, src_indices.to(src.device))
        dst.index_copy_(0, dst_indices.to(dst.device), rows.to(dst.device))


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, page_size
):
    """Pure-torch stand-in for sgl_kernel's device (layer-first) -> host
    (page_first_direct, [page, layer, token_in_page, ...]) copy of every layer.
    src_ptrs lists the K layers then the V layers."""
    layer_num = len(src_ptrs) // 2
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64).cpu()
    pages, offsets = dst_indices // page_size, dst_indices % page_size
    for kv, host in enumerate(dst_ptrs):
        for layer in range(layer_num):
            src = src_ptrs[kv * layer_num + layer]
            rows = src.index_select(0, src_indices.to(src.device))
            host[pages, layer, offsets] = rows.to(host.device)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
):
    """Pure-torch stand-in for the host (page_first_direct) -> device
    (layer-first) copy of one layer."""
    src_indices = src_indices.to(torch.int64).cpu()
    dst_indices = dst_indices.to(torch.int64)
    pages, offsets = src_indices // page_size, src_indices % page_size
    for host, dst in zip(src_ptrs, dst_ptrs):
        rows = host[pages, layer_id, offsets]
        dst.index_copy_(0, dst_indices.to(dst.device), rows.to(dst.device))


def transfer_kv_all_layer_direct_lf_pf_mla(
    src_ptrs, dst_ptrs, src_indices, dst_indices, page_size
):
    """The same copy for the MLA host pool: src_ptrs lists one latent row
    tensor per layer and dst_ptrs holds its one page_first_direct host buffer."""
    (host,) = dst_ptrs
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64).cpu()
    pages, offsets = dst_indices // page_size, dst_indices % page_size
    for layer, src in enumerate(src_ptrs):
        rows = src.index_select(0, src_indices.to(src.device))
        host[pages, layer, offsets] = rows.to(host.device)


def install_sglang_standins() -> None:
    """Patch the sglang modules that reference CUDA-only kernels or calls."""
    import sglang

    assert Path(sglang.__file__).resolve().is_relative_to(PATCHED_TREE.resolve()), (
        f"tests must run against the patched tree {PATCHED_TREE}, "
        f"but sglang comes from {sglang.__file__}; use `make test`"
    )
    from sglang.srt.mem_cache.pool_host import common, mha, mla

    mha.transfer_kv_direct = transfer_kv_direct
    mha.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
    mha.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    # The MLA host pool's direct io backend (layer_first, page_first_direct).
    mla.transfer_kv_direct = transfer_kv_direct
    mla.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf_mla
    mla.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    # Pinned memory calls into the CUDA runtime.
    common._cuda_host_register = lambda *args, **kwargs: None


# -- the stock MHA pool's `kernel` io backend (sgl_kernel.kvcacheio) ------------
# Those ops take device layers as int64 tables of data pointers; on CPU the
# pointers are host addresses, so a ctypes view turns each back into rows.


def _rows_at(ptr, rows: int, row_bytes: int) -> torch.Tensor:
    """Byte rows [rows, row_bytes] over the memory at address ptr (no copy)."""
    import ctypes

    buf = (ctypes.c_uint8 * (rows * row_bytes)).from_address(int(ptr))
    return torch.frombuffer(buf, dtype=torch.uint8).view(rows, row_bytes)


def transfer_kv_per_layer(
    src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, **_
):
    """Stand-in for kvcacheio.transfer_kv_per_layer: one layer's rows
    src[src_indices] -> dst[dst_indices], both layer-first tensors."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        rows = src.view(torch.uint8).view(-1, item_size).index_select(0, src_indices)
        dst.view(torch.uint8).view(-1, item_size).index_copy_(0, dst_indices, rows)


def transfer_kv_per_layer_pf_lf(
    src_k,
    dst_k,
    src_v,
    dst_v,
    src_indices,
    dst_indices,
    layer_id,
    item_size,
    src_layout_dim,
    **_,
):
    """Stand-in for kvcacheio.transfer_kv_per_layer_pf_lf: host page_first
    ([token, layer, ...]) rows of one layer -> the device layer."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    lo = layer_id * item_size
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        tokens = src.view(torch.uint8).view(-1, src_layout_dim)
        rows = tokens.index_select(0, src_indices)[:, lo : lo + item_size]
        dst.view(torch.uint8).view(-1, item_size).index_copy_(0, dst_indices, rows)


def transfer_kv_all_layer(
    src_k_layers,
    dst_k_layers,
    src_v_layers,
    dst_v_layers,
    src_indices,
    dst_indices,
    item_size,
    num_layers,
    **_,
):
    """Stand-in for kvcacheio.transfer_kv_all_layer: every layer's rows,
    layer-first on both sides, layers given as data-pointer tables."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    n_src = int(src_indices.max()) + 1 if src_indices.numel() else 0
    n_dst = int(dst_indices.max()) + 1 if dst_indices.numel() else 0
    for src_ptrs, dst_ptrs in (
        (src_k_layers, dst_k_layers),
        (src_v_layers, dst_v_layers),
    ):
        for layer in range(num_layers):
            src = _rows_at(src_ptrs[layer], n_src, item_size)
            dst = _rows_at(dst_ptrs[layer], n_dst, item_size)
            dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))


def transfer_kv_all_layer_lf_pf(
    src_k_layers,
    dst_k,
    src_v_layers,
    dst_v,
    src_indices,
    dst_indices,
    item_size,
    dst_layout_dim,
    num_layers,
    **_,
):
    """Stand-in for kvcacheio.transfer_kv_all_layer_lf_pf: device layers
    (data-pointer tables) -> host page_first ([token, layer, ...]) rows."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    n_src = int(src_indices.max()) + 1 if src_indices.numel() else 0
    for src_ptrs, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        tokens = dst.view(torch.uint8).view(-1, dst_layout_dim)
        for layer in range(num_layers):
            rows = _rows_at(src_ptrs[layer], n_src, item_size).index_select(
                0, src_indices
            )
            lo = layer * item_size
            tokens[dst_indices, lo : lo + item_size] = rows


# -- the Mamba state host pool (pool_host/mamba.py) ----------------------------
# Its copies are the MHA/MLA direct ops and two JIT CUDA kernels; on CPU the
# page-first state buffers ([slot, layer, 1, *state]) take the same torch copies.


def transfer_kv_mamba_lf_pf(
    src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, **_
):
    """Stand-in for transfer_mamba.transfer_kv_mamba_lf_pf: every layer's state
    rows (layers as a data-pointer table) -> host page-first slots."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64).cpu()
    n_src = int(src_indices.max()) + 1 if src_indices.numel() else 0
    slots = dst.view(torch.uint8).view(-1, dst_layout_dim)
    for layer in range(num_layers):
        rows = _rows_at(src_ptrs[layer], n_src, item_size).index_select(0, src_indices)
        lo = layer * item_size
        slots[dst_indices, lo : lo + item_size] = rows.cpu()


def transfer_kv_mamba_pf_lf(
    src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, **_
):
    """Stand-in for transfer_mamba.transfer_kv_mamba_pf_lf: one layer's state
    rows from host page-first slots -> the device layer."""
    src_indices = src_indices.to(torch.int64).cpu()
    dst_indices = dst_indices.to(torch.int64)
    lo = layer_id * item_size
    rows = src.view(torch.uint8).view(-1, src_layout_dim).index_select(0, src_indices)
    dst.view(torch.uint8).view(-1, item_size).index_copy_(
        0, dst_indices, rows[:, lo : lo + item_size].to(dst.device)
    )


def mamba_standins() -> dict:
    """What MambaPoolHost's module needs bound to copy on CPU with either io
    backend (the page-first layouts it accepts): name -> stand-in."""
    return {
        "transfer_kv_direct": transfer_kv_direct,
        "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf_mla,
        "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
        "transfer_kv_mamba_lf_pf": transfer_kv_mamba_lf_pf,
        "transfer_kv_mamba_pf_lf": transfer_kv_mamba_pf_lf,
    }
