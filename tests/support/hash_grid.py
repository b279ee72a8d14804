"""Byte-identity grid of the encoded host pools: one SHA-256 per case.

Each case builds a real host pool through SGLang's dispatch, fills seeded KV
(with NaN, +-Inf, the dtype's largest value, zeros and tiny rows) into the
real device pool, backs it up, restores it, and hashes what a refactor must
not change: every host buffer, every L3 page (read and written back), the
zero-copy piece offsets and sizes, the statistics, the storage tag and the
bytes per token. Cases span format x model kind x layout x geometry x dtype x
page size x transfer path (torch, torch with run copies, and the fused
kernels under the Triton interpreter, direct and staged).

    python -m tests.support.hash_grid --write tests/hash_grid_reference.json
    python -m tests.support.hash_grid --check tests/hash_grid_reference.json
    python -m tests.support.hash_grid --add tests/hash_grid_reference.json

--add records only the cases the file lacks (a new format or geometry) and
keeps every recorded hash as it is.

Runs as its own process: TRITON_INTERPRET must be set before triton loads.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import torch  # noqa: E402

from scripts.rigs import standins  # noqa: E402

standins.install_torchvision_stub()
standins.install_sglang_standins()

from sglang.srt.mem_cache.pool_host import base  # noqa: E402
from scripts.rigs.hicache_harness import (  # noqa: E402
    Geometry,
    MLAGeometry,
    make_device_pool,
    make_host_pool,
)
from tests.support.conformance import LAYOUTS  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PAGE_SIZES = (1, 16)
# name -> (kind, geometry kwargs)
GEOMETRIES = {
    "mha_l2h2d64": ("mha", dict(layer_num=2, head_num=2, head_dim=64)),
    "mha_l3h1d128v64": (
        "mha",
        dict(layer_num=3, head_num=1, head_dim=128, v_head_dim=64),
    ),
    "mla_l2r512p64": ("mla", dict(layer_num=2, kv_lora_rank=512, qk_rope_head_dim=64)),
    "mla_l1r256p32": ("mla", dict(layer_num=1, kv_lora_rank=256, qk_rope_head_dim=32)),
}
FORMATS = {"mha": ("int8", "int4", "k8v4"), "mla": ("int8",)}
# The rotated formats (their base format's bytes after a Hadamard rotation
# with a fixed sign vector, kv_hadamard.py): every geometry, layout, dtype and
# path at one page size, their base formats covering the page sizes.
ROTATED_FORMATS = {"mha": ("int4r", "k8v4r"), "mla": ()}
ROTATED_PAGE_SIZES = (16,)
PATHS = ("torch", "torch_runs", "fused_direct", "fused_staged")
# Host pages written (out of order: a backward jump and a gap) and the device
# pages they come from and are restored into.
HOST_PAGES, DEVICE_PAGES, RESTORE_PAGES = [5, 2, 9], [4, 1, 6], [0, 7, 3]
PAGES = 12


# int8c at pages of 1 (keys per token) and 64 (per channel).
INT8C_FORMATS = {"mha": ("int8c",), "mla": ()}
INT8C_PAGE_SIZES = (1, 64)
# int4c at pages of 1 (keys per token), 16 (one 16-token sub-range) and 64
# (two 32-token sub-ranges), on the torch paths: it has no fused kernels yet.
INT4C_FORMATS = {"mha": ("int4c",), "mla": ()}
INT4C_PAGE_SIZES = (1, 16, 64)
INT4C_PATHS = ("torch", "torch_runs")


def cases(paths=PATHS):
    for geo_name, (kind, _) in GEOMETRIES.items():
        for formats, page_sizes in (
            (FORMATS[kind], PAGE_SIZES),
            (ROTATED_FORMATS[kind], ROTATED_PAGE_SIZES),
            (INT8C_FORMATS[kind], INT8C_PAGE_SIZES),
        ):
            for fmt, layout, dtype, page_size, path in itertools.product(
                formats, LAYOUTS, DTYPES, page_sizes, paths
            ):
                yield f"{kind}/{fmt}/{geo_name}/{layout}/{dtype}/p{page_size}/{path}"
        for fmt, layout, dtype, page_size, path in itertools.product(
            INT4C_FORMATS[kind], LAYOUTS, DTYPES, INT4C_PAGE_SIZES, INT4C_PATHS
        ):
            if path in paths:
                yield f"{kind}/{fmt}/{geo_name}/{layout}/{dtype}/p{page_size}/{path}"


def _token_ids(pages, page_size):
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()


def _special_rows(rows: torch.Tensor, dtype: torch.dtype, gen) -> torch.Tensor:
    """Seeded rows [n, heads, dim] with magnitudes over many octaves and the special
    values a codec must keep apart."""
    n = rows.shape[0]
    rows *= torch.logspace(-8, 6, n, base=2.0)[:, None, None]
    rows[0] = 0.0
    rows[1, 0, 0] = float("nan")
    rows[2, -1, 1] = float("inf")
    rows[3, 0, -1] = float("-inf")
    rows[4, 0, 2] = torch.finfo(dtype).max
    rows[5] = torch.finfo(dtype).tiny * torch.randn(rows.shape[1:], generator=gen)
    rows[6, :, ::5] = 0.5  # ties
    return rows.to(dtype)


def _fill(device_pool, kind, indices, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    buffers = (
        [device_pool.kv_buffer]
        if kind == "mla"
        else [device_pool.k_buffer, device_pool.v_buffer]
    )
    for side in buffers:
        for layer in side:
            rows = torch.randn((len(indices), *layer.shape[1:]), generator=gen)
            layer[indices] = _special_rows(rows, dtype, gen)
    return buffers


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


class _Digest:
    def __init__(self):
        self._h = hashlib.sha256()

    def add(self, label: str, value) -> None:
        self._h.update(label.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            self._h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            self._h.update(_bytes(value))
        else:
            self._h.update(repr(value).encode())
        self._h.update(b"\1")

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _path_kwargs(path) -> dict:
    """The pool's constructor arguments that choose the transfer path."""
    if path.startswith("fused_"):
        return {"fused_transfer": path.removeprefix("fused_")}
    return {"fused_transfer": "off", "run_copies": path == "torch_runs"}


def _zero_copy_meta(pool, host_tokens):
    """get_page_buffer_meta as (record, offset from that record's base, size)."""
    ptrs, sizes = pool.get_page_buffer_meta(host_tokens)
    # Each object's last piece is its seal (page_integrity.py), in its own buffer.
    buffers = {**pool.host_records, "seal": pool.pages.seals}
    bases = sorted(
        (buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size(), name)
        for name, buf in buffers.items()
    )
    out = []
    for ptr, size in zip(ptrs, sizes):
        name, base = next((n, lo) for lo, hi, n in bases if lo <= ptr < hi)
        out.append((name, ptr - base, size))
    return out


def run_case(key: str) -> str:
    kind, fmt, geo_name, layout, dtype_name, page, path = key.split("/")
    page_size, dtype = int(page[1:]), DTYPES[dtype_name]
    geo_kwargs = dict(GEOMETRIES[geo_name][1], dtype=dtype, page_size=page_size)
    geo = (MLAGeometry if kind == "mla" else Geometry)(**geo_kwargs)
    d = _Digest()
    device_pool = make_device_pool(geo, device_tokens=PAGES * page_size)
    info = device_pool.get_device_pool_infos()[0].buffer_info
    try:
        pool = make_host_pool(
            device_pool, host_tokens=PAGES * page_size, layout=layout,
            host_dtype=fmt, **_path_kwargs(path),
        )  # fmt: skip
    except NotImplementedError:
        d.add("refused", True)
        return d.hexdigest()
    d.add("bytes_per_token", pool.get_size_per_token())
    d.add("device_bytes_per_token", pool.device_size_per_token())
    d.add(
        "host_bytes_per_device_byte",
        type(pool).host_bytes_per_device_byte(info, page_size=page_size, layout=layout),
    )
    d.add("storage_format_tag", pool.storage_format_tag)
    d.add("storage_page_bytes", pool.storage_page_bytes)
    d.add("storage_buffers_per_object", pool.storage_buffers_per_object)
    d.add("size", (pool.size, pool.page_num, pool.layer_num))
    d.add("dummy_page", pool.get_dummy_flat_data_page())
    for buf in pool.host_records.values():
        buf.zero_()
    assert pool.transfer_path == path.removesuffix("_runs")

    dev = _token_ids(DEVICE_PAGES, page_size)
    host = _token_ids(HOST_PAGES, page_size)
    back = _token_ids(RESTORE_PAGES, page_size)
    if page_size == 1:
        # Token units: a shuffled order with gaps.
        host = torch.tensor([9, 2, 3, 11, 0, 5, 6, 1, 10, 4, 8, 7])[: len(dev) * 3]
        dev = torch.arange(PAGES).flip(0)[: len(host)]
        back = torch.randperm(PAGES, generator=torch.Generator().manual_seed(1))[
            : len(host)
        ]
    buffers = _fill(
        device_pool, kind, dev, dtype, seed=zlib.crc32(key.rpartition("/")[0].encode())
    )
    pool.backup_from_device_all_layer(device_pool, host, dev, "kernel")
    for name, buf in pool.host_records.items():
        d.add(f"host/{name}", buf)
    d.add("nonfinite", pool.nonfinite_group_count())
    d.add("scale_amax", pool.scale_amax_by_layer())
    if hasattr(pool, "invalid_host_index_count"):
        d.add("invalid_host_indices", pool.invalid_host_index_count())
    for side in buffers:
        for layer in side:
            layer[back] = float("nan")
    for layer_id in range(pool.layer_num):
        pool.load_to_device_per_layer(device_pool, host, back, layer_id, "kernel")
    for s, side in enumerate(buffers):
        for layer_id, layer in enumerate(side):
            d.add(f"restored/{s}/{layer_id}", layer[back])
    page_starts = sorted(set((host // page_size * page_size).tolist()))
    for index in page_starts:
        d.add(f"l3/{index}", pool.get_data_page(index))
    # A page written back from its bytes lands bit for bit in a free page.
    free = sorted(set(range(0, PAGES * page_size, page_size)) - set(page_starts))
    pool.set_from_flat_data_page(free[0], pool.get_data_page(page_starts[0]))
    for name, buf in pool.host_records.items():
        d.add(f"host_after_set/{name}", buf)
    if layout != "layer_first":
        d.add("zero_copy", _zero_copy_meta(pool, _token_ids(HOST_PAGES, page_size)))
    return d.hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", help="write the grid's hashes to this JSON file")
    group.add_argument("--check", help="compare the grid's hashes with this JSON file")
    group.add_argument(
        "--add", help="record the cases this JSON file lacks, keeping the others"
    )
    parser.add_argument("--match", default="", help="only cases containing this")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    start = time.monotonic()
    # Pools here are a few MB; other processes' use must not fail the check.
    recorded = {}
    if args.add:
        with open(args.add) as f:
            recorded = json.load(f)
    with base.host_memory_budget_scope(1 << 40):
        got = {
            key: run_case(key)
            for key in cases()
            if args.match in key and key not in recorded
        }
    took = time.monotonic() - start
    if args.add:
        with open(args.add, "w") as f:
            json.dump({**recorded, **got}, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"added {len(got)} case hashes to {args.add} in {took:.0f} s")
        return 0
    if args.write:
        with open(args.write, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {len(got)} case hashes to {args.write} in {took:.0f} s")
        return 0
    with open(args.check) as f:
        want = json.load(f)
    want = {k: v for k, v in want.items() if args.match in k}
    differ = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    for key in differ:
        print(f"DIFFERS {key}: {want.get(key)} -> {got.get(key)}")
    print(f"{len(got) - len(differ)}/{len(got)} cases identical in {took:.0f} s")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
