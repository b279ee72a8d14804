"""Fault injection into the stored L3 objects of encoded host pages (`file`,
MooncakeStore, HiCacheNixl's POSIX files), aimed at payload, scales, metadata
or seal, and undone afterwards."""

from __future__ import annotations

import random
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_BYTES
from scripts.rigs import l3_harness as h
from scripts.rigs.hicache_harness import Geometry, MLAGeometry

GEO16 = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=16)
GEO_MLA = MLAGeometry(layer_num=2, page_size=4)
# (geometry, host dtype, format whose objects are planted under its keys)
FORMATS = {
    "int8": (GEO16, "int8", "k8v4"),
    "int4": (GEO16, "int4", "int8"),
    "k8v4": (GEO16, "k8v4", "int4"),
    # Same-sized records, other meaning: the planted pages must miss on the tag.
    "int8c": (GEO16, "int8c", "int8"),
    "int4c": (GEO16, "int4c", "int4"),
    # The rotated formats store their base format's records, rotated otherwise.
    "int4r": (GEO16, "int4r", "int4"),
    "k8v4r": (GEO16, "k8v4r", "k8v4"),
    "mla-int8": (GEO_MLA, "int8", "auto"),
}
# The reasons the seal gives on every backend (a flipped seal byte's field
# decides which); the size faults differ by backend.
SEAL_REFUSALS = {
    "flip_payload": {"checksum"},
    "flip_scales": {"checksum"},
    "flip_metadata": {"checksum"},
    "flip_seal": {"seal", "tag", "key", "size", "checksum"},
    "zero": {"seal"},
    "swap_pages": {"key"},
    "delete": {"missing"},
}

# POSIX plugin, buffered I/O (tmp dirs may not take O_DIRECT), no cleaner thread.
NIXL_CONFIG = {
    "plugin": {"posix": {"active": True}},
    "use_direct_io": False,
    "l3_cleaner_enabled": False,
}


def storage_config(request, tmp_path, backend: str) -> dict:
    """The extra config of `backend` for this test: a module's short-lease
    master, a NIXL FILE directory (read at construction) or a file folder."""
    if backend == "mooncake":
        return request.getfixturevalue("short_lease_master").storage_config()
    if backend == "nixl":
        try:
            from nixl._api import nixl_agent  # noqa: F401
        except Exception as e:  # ImportError, or a shared library it cannot load
            pytest.skip(
                f"nixl does not import ({type(e).__name__}: {e}); install "
                "requirements/l3-nixl.txt with pip --no-deps"
            )
        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setenv("SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR", str(tmp_path))
        return NIXL_CONFIG
    return h.file_storage_config(tmp_path)


def make_l3(request, tmp_path, backend: str, **kwargs):
    """make_l3_rig on `backend` under this test's model name, closed at teardown."""
    kwargs.setdefault("model_name", f"hiq/{request.node.name}")
    l3 = h.make_l3_rig(backend, storage_config(request, tmp_path, backend), **kwargs)
    request.getfixturevalue("l3_rigs").append(l3)
    return l3


def region_of(record_name: str) -> str:
    """What a record's bytes are, for aiming byte flips."""
    if "scale" in record_name:
        return "scales"
    if "meta" in record_name or record_name == "rope":
        return "metadata"
    return "payload"


def object_layouts(pool, zero_copy: bool) -> list[list[tuple[str, int, int]]]:
    """[(region, start, end)] of each storage object of one page: the flat page,
    or the zero-copy objects; the seal last."""
    layouts = []
    if zero_copy:
        objects = pool.pages.objects
    else:
        units = pool.page_size // pool.host_format.unit_tokens
        objects = [
            [(r.name, 0, r.nbytes * pool.layer_num * units)]
            for r in pool.host_format.records
        ]
        objects = [[piece for obj in objects for piece in obj]]
    for pieces in objects:
        ranges, at = [], 0
        for name, _, size in pieces:
            ranges.append((region_of(name), at, at + size))
            at += size
        layouts.append([*ranges, ("seal", at, at + SEAL_BYTES)])
    return layouts


class FileObjects:
    """The `file` backend (one file per page) and HiCacheNixl's FILE objects
    (_k/_v files, MLA: _k, or one flat page file in copy mode)."""

    def __init__(self, l3):
        self.backend = b = l3.backend
        self.nixl = b.__class__.__name__ == "HiCacheNixl"
        self.zero_copy = self.nixl and b.is_zero_copy
        mla = self.zero_copy and b.is_mla_model
        self._parts = (["k"] if mla else ["k", "v"]) if self.zero_copy else [""]

    def parts(self) -> list[str]:
        return self._parts

    def path(self, page_hash: str, part: str) -> Path:
        key = self.backend._get_suffixed_key(page_hash)
        if not self.nixl:
            return Path(self.backend.file_path) / f"{key}.bin"
        key += f"_{part}" if part else ""
        return Path(self.backend.file_manager.get_file_path(key))

    def read(self, page_hash: str, part: str) -> bytes:
        return self.path(page_hash, part).read_bytes()

    def write(self, page_hash: str, part: str, data: bytes | None) -> None:
        path = self.path(page_hash, part)
        if data is None:
            path.unlink()
        else:
            path.write_bytes(data)


class MooncakeObjects:
    """MooncakeStore: the page's zero-copy objects (_k/_v for MHA, _k for MLA)."""

    zero_copy = True

    def __init__(self, l3):
        self.backend = l3.backend
        self.store = self.backend.store
        self.mla = self.backend.is_mla_backend

    def parts(self) -> list[str]:
        return ["k"] if self.mla else ["k", "v"]

    def key(self, page_hash: str, part: str) -> str:
        b = self.backend
        suffix = b.mla_suffix if self.mla else b.mha_suffix
        return b._tag_keys([page_hash])[0] + f"_{suffix}_{part}"

    def read(self, page_hash: str, part: str) -> bytes:
        return bytes(self.store.get(self.key(page_hash, part)))

    def write(self, page_hash: str, part: str, data: bytes | None) -> None:
        key = self.key(page_hash, part)
        # force: skip the read lease of the prefetch that just ended (nothing
        # reads the store meanwhile); -704: there is no such object.
        rc = self.store.remove(key, force=True)
        if rc not in (0, -704):
            raise AssertionError(f"cannot remove {key}: {rc}")
        if data is not None:
            rc = self.store.put(key, data)
            if rc != 0:
                raise AssertionError(f"put {key} returned {rc}")


def objects_for(l3):
    mooncake = l3.backend.__class__.__name__ == "MooncakeStore"
    return (MooncakeObjects if mooncake else FileObjects)(l3)


FLIPS = ("flip_payload", "flip_scales", "flip_metadata", "flip_seal")
SIZES = ("truncate", "extend")
FAULT_KINDS = (*FLIPS, *SIZES, "zero", "swap_pages", "swap_parts", "foreign")


def _flip(data: bytes, spans, rng: random.Random) -> bytes:
    a, b = rng.choice(spans)
    at = rng.randrange(a, b)
    out = bytearray(data)
    out[at] ^= 1 << rng.randrange(8) if rng.random() < 0.5 else rng.randrange(1, 256)
    return bytes(out)


def make_fault(kind, rng, objects, layouts, hashes, page, foreign=None):
    """The writes {(page_hash, part): bytes or None} putting fault `kind` into
    page `page` (None: not applicable); `foreign` reads another format's objects."""
    parts = objects.parts()
    pi = rng.randrange(len(parts))
    part, layout = parts[pi], layouts[pi]
    h = hashes[page]
    data = objects.read(h, part)
    if kind.startswith("flip_"):
        region = kind.removeprefix("flip_")
        spans = [(a, b) for r, a, b in layout if r == region]
        if not spans:
            return None
        return {(h, part): _flip(data, spans, rng)}
    if kind == "truncate":
        return {(h, part): data[: -rng.randrange(1, min(len(data), 64) + 1)]}
    if kind == "extend":
        return {(h, part): data + rng.randbytes(rng.randrange(1, 65))}
    if kind == "zero":
        return {(h, part): bytes(len(data))}
    if kind == "swap_pages":
        other = rng.choice([i for i in range(len(hashes)) if i != page])
        return {(h, part): objects.read(hashes[other], part)}
    if kind == "swap_parts":
        if len(parts) < 2:
            return None
        a, b = parts
        return {(h, a): objects.read(h, b), (h, b): objects.read(h, a)}
    if kind == "foreign":
        return {(h, part): foreign.read(h, part)}
    raise ValueError(kind)


@contextmanager
def faulted(objects, writes: dict, also_restore=()):
    """The store with `writes` applied; afterwards each object written, and
    those in `also_restore` (a delete's part), holds its bytes from before."""
    undo = {key: objects.read(*key) for key in (*also_restore, *writes)}
    for (hh, part), data in writes.items():
        objects.write(hh, part, data)
    try:
        yield
    finally:
        for (hh, part), data in undo.items():
            objects.write(hh, part, data)


def reference_restore(pool, written: list[torch.Tensor]) -> list[torch.Tensor]:
    """The format's reference decode of the rows written (device_rows order)."""
    fmt = pool.host_format
    layers, sides = pool.layer_num, len(fmt.sides)
    out = [None] * len(written)
    for layer in range(layers):
        rows = []
        for side in range(sides):
            x = written[side * layers + layer]
            rows.append(
                x.view(len(x) // fmt.unit_tokens, fmt.unit_tokens, *x.shape[1:])
            )
        restored = fmt.decode_reference(fmt.encode_reference(rows), x.dtype)
        for side, r in enumerate(restored):
            out[side * layers + layer] = r.reshape(written[side * layers + layer].shape)
    return out


def page_bytes(pool, host_indices: torch.Tensor, page: int) -> bytes:
    flat = pool.get_data_page(int(host_indices[page * pool.page_size]))
    return flat[:-SEAL_BYTES].numpy().tobytes()


def raw(t: torch.Tensor) -> bytes:
    # numpy copies: torch ops on many small tensors are slow on a busy CPU.
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def device_snapshot(l3) -> list[bytes]:
    pool = l3.rig.device_pool
    bufs = getattr(pool, "kv_buffer", None)
    if not isinstance(bufs, list):
        bufs = list(pool.k_buffer) + list(pool.v_buffer)
    return [raw(b) for b in bufs]


def check_restored_to_device(l3, tokens, reference, pages):
    pf = h.prefetch(l3, tokens + [7])
    assert pf.completed_tokens == pages * l3.geo.page_size
    dev = h.load_to_device(l3, pf.host_indices)
    for got, want in zip(h.device_rows(l3.rig, dev), reference):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    h.evict_everywhere(l3, dev, pf.host_indices)
