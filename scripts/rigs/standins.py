"""CPU stand-ins for the parts of SGLang that need CUDA hardware.

Shared by tests and tools, never shipped in the product. Each stand-in
replaces exactly one thing a CPU-only machine lacks and says which.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
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


def run_fresh(code: str, timeout: float = 600) -> dict:
    """Run `code` in a fresh interpreter at the repo root, after the CPU
    stand-ins, and return the JSON its last output line prints."""
    prologue = (
        "from scripts.rigs import standins\n"
        "standins.install_torchvision_stub()\n"
        "standins.install_sglang_standins()\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", prologue + code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


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


# -- the MLA and DSA indexer host pools' `kernel` io backend (kvcacheio) --------
# One buffer per layer instead of K and V; `item_size` is a row's bytes (an
# MLA latent row, or a DSA indexer page). The rows' addressing is the MHA
# stand-ins' above.


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, **_):
    """Stand-in for kvcacheio.transfer_kv_per_layer_mla: one layer's rows
    src[src_indices] -> dst[dst_indices], both layer-first."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    rows = src.view(torch.uint8).view(-1, item_size).index_select(0, src_indices)
    dst.view(torch.uint8).view(-1, item_size).index_copy_(0, dst_indices, rows)


def transfer_kv_per_layer_mla_pf_lf(
    src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, **_
):
    """Stand-in for kvcacheio.transfer_kv_per_layer_mla_pf_lf: host
    page_first rows of one layer -> the device layer."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    lo = layer_id * item_size
    rows = src.view(torch.uint8).view(-1, src_layout_dim).index_select(0, src_indices)
    dst.view(torch.uint8).view(-1, item_size).index_copy_(
        0, dst_indices, rows[:, lo : lo + item_size]
    )


def transfer_kv_all_layer_mla(
    src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers, **_
):
    """Stand-in for kvcacheio.transfer_kv_all_layer_mla: every layer's rows,
    layer-first on both sides, layers given as data-pointer tables."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    n_src = int(src_indices.max()) + 1 if src_indices.numel() else 0
    n_dst = int(dst_indices.max()) + 1 if dst_indices.numel() else 0
    for layer in range(num_layers):
        src = _rows_at(src_layers[layer], n_src, item_size)
        dst = _rows_at(dst_layers[layer], n_dst, item_size)
        dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))


def transfer_kv_all_layer_mla_lf_pf(
    src_layers,
    dst,
    src_indices,
    dst_indices,
    item_size,
    dst_layout_dim,
    num_layers,
    **_,
):
    """Stand-in for kvcacheio.transfer_kv_all_layer_mla_lf_pf: device layers
    (a data-pointer table) -> host page_first rows."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    n_src = int(src_indices.max()) + 1 if src_indices.numel() else 0
    rows_out = dst.view(torch.uint8).view(-1, dst_layout_dim)
    for layer in range(num_layers):
        rows = _rows_at(src_layers[layer], n_src, item_size).index_select(
            0, src_indices
        )
        lo = layer * item_size
        rows_out[dst_indices, lo : lo + item_size] = rows


def mla_kernel_standins() -> dict:
    """The `kernel` io backend ops of the stock MLA host pool (pool_host/mla.py):
    name -> stand-in."""
    return {
        "transfer_kv_per_layer_mla": transfer_kv_per_layer_mla,
        "transfer_kv_per_layer_mla_pf_lf": transfer_kv_per_layer_mla_pf_lf,
        "transfer_kv_all_layer_mla": transfer_kv_all_layer_mla,
        "transfer_kv_all_layer_mla_lf_pf": transfer_kv_all_layer_mla_lf_pf,
    }


def dsa_indexer_standins() -> dict:
    """What DSAIndexerPoolHost's module (pool_host/dsa.py) needs bound to copy
    the indexer's pages on CPU with either io backend: name -> stand-in."""
    return {
        **mla_kernel_standins(),
        "transfer_kv_direct": transfer_kv_direct,
        "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf_mla,
        "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    }


# -- speculative decoding's sgl_kernel CPU ops ----------------------------------
# On CPU SGLang 0.5.23 calls these compiled ``sgl_kernel.*_cpu`` ops (the CPU
# build of the sgl-kernel wheel) where CUDA runs Triton kernels. The import-only
# stand-in (cpu_site/sgl_kernel) dispatches to these pure-torch versions only
# when HIQ_SGL_KERNEL_TORCH_OPS=1; each follows the Triton kernel of the same
# name in sglang/kernels/ops (cited per op), which is the upstream reference.


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Replaces sgl_kernel.copy_all_layer_kv_cache_cpu (cache_move.py's
    copy_all_layer_kv_cache_tiled): rows src_loc -> tgt_loc in every KV buffer,
    buffers given as a data-pointer table with their row strides in bytes."""
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    if src.numel() == 0:
        return
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buf = _rows_at(ptr, rows, int(stride))
        # Gather before scatter: the kernel is safe for overlapping src/tgt.
        buf.index_copy_(0, tgt, buf.index_select(0, src).clone())


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Replaces sgl_kernel.assign_req_to_token_pool_cpu (allocation.py's
    assign_req_to_token_pool): req_to_token[r, start:end] = the request's run
    of out_cache_loc, runs packed in batch order."""
    offset = 0
    for r, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        n = end - start
        req_to_token[r, start:end] = out_cache_loc[offset : offset + n].to(
            req_to_token.dtype
        )
        offset += n


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Replaces sgl_kernel.assign_extend_cache_locs_cpu (cache_locs.py's
    assign_extend_cache_locs): out_cache_loc = req_to_token[r, start:end] of
    each request, packed in batch order."""
    offset = 0
    for r, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        n = end - start
        out_cache_loc[offset : offset + n] = req_to_token[r, start:end].to(
            out_cache_loc.dtype
        )
        offset += n


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_cols
):
    """Replaces sgl_kernel.assign_draft_cache_locs_contiguous_cpu (cache_locs.py's
    assign_draft_cache_locs_contiguous): request b's topk * num_cols slots from
    seq_lens[b] on, at out_cache_loc[b * topk * num_cols]."""
    n = topk * num_cols
    for b, (r, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[b * n : (b + 1) * n] = req_to_token[r, start : start + n].to(
            out_cache_loc.dtype
        )


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """Replaces sgl_kernel.fill_bonus_tokens_cpu (eagle.py's fill_bonus_tokens):
    each request's last accepted token (accept_lens counts the bonus)."""
    flat = accept_tokens.reshape(-1)
    for b, n in enumerate(accept_lens.tolist()):
        bonus_tokens[b] = flat[accept_stride * b + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Replaces sgl_kernel.fill_accept_out_cache_loc_cpu (eagle.py's
    fill_accept_out_cache_loc): the cache slots of the accepted draft tokens
    (accept_index != -1), packed in order."""
    index = accept_index.reshape(-1).to(torch.int64)
    index = index[index != -1]
    accept_out_cache_loc[: index.numel()] = out_cache_loc[index].to(
        accept_out_cache_loc.dtype
    )


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
):
    """Replaces sgl_kernel.build_tree_kernel_efficient_cpu: a line-by-line
    Python form of spec_tree.py's sgl_build_tree_kernel_efficient_triton
    (the draft tree's mask, positions and retrieve links per request)."""
    n = draft_token_num
    parents = parent_list.reshape(parent_list.shape[0], -1).tolist()
    selected = selected_index.reshape(selected_index.shape[0], -1).tolist()
    seq_lens = verified_seq_len.tolist()
    mask = tree_mask.view(-1)
    next_token = retrieve_next_token.view(-1)
    next_sibling = retrieve_next_sibling.view(-1)
    prefix = 0
    for b, seq_len in enumerate(seq_lens):
        sel, par = selected[b], parents[b]
        seq_tree_idx = n * n * b + prefix * n
        prefix += seq_len
        positions[b * n] = seq_len

        def position_of(token_idx):
            for pp in range(n - 1):
                if sel[pp] == token_idx:
                    return pp
            return None

        for i in range(n - 1, 0, -1):
            retrieve_index.view(-1)[b * n + i] = b * n + i
            parent_tb_idx = sel[i - 1] // topk
            if parent_tb_idx == 0:
                parent_position = 0
            else:
                pp = position_of(par[parent_tb_idx])
                if pp is None:
                    continue
                parent_position = pp + 1
            slot = b * n + parent_position
            previous = int(next_token[slot])
            next_token[slot] = i
            if previous != -1:
                next_sibling[b * n + i] = previous
        retrieve_index.view(-1)[b * n] = b * n

        for x in range(n):
            if int(tree_mask_mode) == 0:  # FULL_MASK
                token_tree_idx = seq_tree_idx + (seq_len + n) * x + seq_len + 1
            else:
                token_tree_idx = n * n * b + n * x + 1
            mask[token_tree_idx - 1] = True
            mask[token_tree_idx : token_tree_idx + n - 1] = False
            if x == 0:
                continue
            cur, position = x - 1, 0
            for _ in range(depth):
                position += 1
                mask[token_tree_idx + cur] = True
                parent_tb_idx = sel[cur] // topk
                if parent_tb_idx == 0:
                    break
                cur = position_of(par[parent_tb_idx])
                if cur is None:
                    break
            positions[b * n + x] = position + seq_len


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
):
    """Replaces sgl_kernel.verify_tree_greedy_cpu: a Python form of
    spec_tree.py's verify_tree_greedy_kernel_triton (walk each request's draft
    tree, accepting the child whose token equals the target's greedy token)."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand = candidates.tolist()
    index = retrive_index.tolist()
    next_token = retrive_next_token.tolist()
    next_sibling = retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    pred = predicts.view(-1)
    for b in range(bs):
        last = index[b][0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = next_token[b][cur]
            wanted = target[last]
            while cur != -1 and cand[b][cur] != wanted:
                cur = next_sibling[b][cur]
            if cur == -1:
                break
            pred[last] = wanted
            accepted += 1
            accept_index[b, accepted] = index[b][cur]
            last = index[b][cur]
        accept_token_num[b] = accepted
        pred[last] = target[last]


# -- the intel_amx attention backend's sgl_kernel CPU ops -----------------------
# SGLang 0.5.23's only CPU attention backend with a speculative draft path is
# intel_amx (torch_native has none: draft_utils.py refuses it), and it is the
# one gpt-oss selects on an AMX CPU (model_overrides/gpt_oss.py), since
# torch_native takes neither attention sinks nor sliding-window KV pools'
# indices. It calls torch.ops.sgl_kernel.{decode,extend}_attention_cpu (AMX
# kernels of the CPU sgl-kernel build). These are plain float32 attention over
# the paged KV, bound as attributes of torch.ops.sgl_kernel by the stand-in,
# never registered as ops (so cpu_has_amx_support(), which asks for
# convert_weight_packed, stays False).


def _attend(q, keys, values, scaling, logit_cap, mask=None, sinks=None):
    """softmax(q k^T * scaling) v for q [Tq, H, D] over keys [Tk, Hkv, D]
    (grouped-query heads repeat), mask [Tq, Tk] True where visible; sinks [H]
    is one extra logit per head in the softmax whose probability is dropped
    (gpt-oss attention sinks, as transformers' eager_attention_forward)."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys = keys.float().repeat_interleave(heads // kv_heads, dim=1)
    values = values.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scaling
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(heads, 1, 1).expand(heads, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def _window_start(first_position: int, window) -> int:
    """The first key position a query at first_position sees: the kernels'
    ``window`` is the layer's sliding_window_size + 1 keys, the query's own
    included (0 for full-attention layers, whose sliding_window_size is -1)."""
    if window is None or window <= 0:
        return 0
    return max(0, first_position - window + 1)


def _visible(key_positions, query_positions, window, causal=True):
    """[Tq, Tk] True where a query sees a key: causal, and inside its window."""
    seen = torch.ones(len(query_positions), len(key_positions), dtype=torch.bool)
    if causal:
        seen &= key_positions[None, :] <= query_positions[:, None]
    if window is not None and window > 0:
        seen &= key_positions[None, :] > query_positions[:, None] - window
    return seen


def _check_attention_args(is_cross, window, tree_mask=None):
    if is_cross or (window is not None and window > 0 and tree_mask is not None):
        raise NotImplementedError(
            "the pure-torch attention stand-in covers causal self-attention "
            "(sliding windows and sinks included) and speculative tree masks "
            "without a sliding window"
        )


def decode_attention_cpu(
    q,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    o,
    k,
    v,
    cache_loc,
    attn_logits,
    req_to_token,
    req_pool_indices,
    seq_lens,
    scaling,
    logit_cap,
    is_cross,
    window,
    encoder_lens,
    sinks,
):
    """Replaces sgl_kernel's decode_attention_cpu: writes the new token's k/v
    (when given) at cache_loc, then one query row per sequence over its
    req_to_token row of seq_lens[b] slots, the last ``window`` of them on a
    sliding-window layer (a SWA pool keeps only those; its earlier slots are
    freed, so they are not read)."""
    _check_attention_args(is_cross, window)
    if k is not None and v is not None:
        loc = cache_loc.to(torch.int64)
        k_buffer[loc] = k.view(-1, *k_buffer.shape[1:]).to(k_buffer.dtype)
        v_buffer[loc] = v.view(-1, *v_buffer.shape[1:]).to(v_buffer.dtype)
    for b, (r, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[r, _window_start(n - 1, window) : n].to(torch.int64)
        keys = k_buffer[slots].float() * k_scale
        values = v_buffer[slots].float() * v_scale
        out = _attend(q[b : b + 1], keys, values, scaling, logit_cap, sinks=sinks)
        o[b : b + 1] = out.to(o.dtype)


def extend_attention_cpu(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_seq_lens,
    extend_start_loc,
    max_len_extend,
    scaling,
    logit_cap,
    is_cross,
    window,
    encoder_lens,
    sinks,
    tree_mask,
    is_causal,
):
    """Replaces sgl_kernel's extend_attention_cpu: each sequence's new rows
    attend to its cached prefix (req_to_token) and causally to the new rows
    (each row to its last ``window`` keys on a sliding-window layer, so only
    prefix slots inside the first row's window are read), or through tree_mask
    (FULL_MASK layout: per request [extend, prefix + extend], requests back to
    back) in a speculative verify."""
    _check_attention_args(is_cross, window, tree_mask)
    mask_offset = 0
    rows = zip(
        req_pool_indices.tolist(),
        seq_lens.tolist(),
        extend_seq_lens.tolist(),
        extend_start_loc.tolist(),
    )
    for r, total, ext, start in rows:
        prefix = total - ext
        lo = _window_start(prefix, window)
        slots = req_to_token[r, lo:prefix].to(torch.int64)
        keys = k_extend[start : start + ext].float()
        values = v_extend[start : start + ext].float()
        # Without a cached prefix the buffers are not read: an MLA model's
        # MHA prefill passes expanded per-head K/V whose shape is not the
        # pool's latent rows.
        if len(slots):
            keys = torch.cat([k_buffer[slots].float() * k_scale, keys])
            values = torch.cat([v_buffer[slots].float() * v_scale, values])
        if tree_mask is not None:
            size = ext * total
            mask = tree_mask.view(-1)[mask_offset : mask_offset + size].view(ext, total)
            mask = mask.to(torch.bool)
            mask_offset += size
        else:
            mask = _visible(
                torch.arange(lo, total), prefix + torch.arange(ext), window, is_causal
            )
        out = _attend(
            q_extend[start : start + ext],
            keys,
            values,
            scaling,
            logit_cap,
            mask,
            sinks,
        )
        o_extend[start : start + ext] = out.to(o_extend.dtype)


def build_draft_decode_metadata_cpu(
    req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len
):
    """Replaces sgl_kernel.build_draft_decode_metadata_cpu: one req_to_token
    row per draft branch, its request's prefix then that branch's num_steps
    draft slots (laid out [topk, num_steps] after the prefix, as
    assign_draft_cache_locs_contiguous hands them out)."""
    bs = seq_lens.shape[0]
    out = torch.zeros(
        (bs * topk, pool_len), dtype=req_to_token.dtype, device=req_to_token.device
    )
    for b, (r, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for t in range(topk):
            row = out[b * topk + t]
            row[:n] = req_to_token[r, :n]
            lo = n + t * num_steps
            row[n : n + num_steps] = req_to_token[r, lo : lo + num_steps]
    return out
