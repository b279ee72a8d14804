"""Sealed L3 page objects: every storage object of an encoded host page carries
a seal, checked before any of its bytes is used as KV.

A seal is SEAL_BYTES appended to the object (a trailer of the flat page for
generic backends such as `file`; one more buffer of the multi-buffer object
for zero-copy backends such as `mooncake`, so those objects stay zero-copy):

    offset  bytes  field
    0       4      magic b"HQS1"
    4       2      seal version (1)
    6       2      object index within the page (0 = the flat page, or K; 1 = V)
    8       8      xxh3-64 of the format tag and page geometry ("tag")
    16      8      xxh3-64 of the page's storage key ("key")
    24      8      payload bytes
    32      8      xxh3-64 of the payload bytes

all little-endian. Every field is compared exactly, so a changed seal byte
refuses the page as surely as a changed payload byte. The hash is computed on
the host at L3 I/O time only (never on the device <-> host transfer path).

A page that fails is refused: a miss for that page, counted per Refusal
reason and logged once per reason per process. Pages are sealed always; the
storage tag carries SEAL_TAG so pages written before sealing (or by a pool
that does not seal) are a miss by key rather than a refusal.
"""

from __future__ import annotations

import enum
import logging
import struct
import threading
from typing import Iterable, Optional

import torch
import xxhash

logger = logging.getLogger(__name__)

SEAL_MAGIC = b"HQS1"
SEAL_VERSION = 1
SEAL_TAG = "seal1"
_SEAL = struct.Struct("<4sHHQQQQ")
SEAL_BYTES = _SEAL.size  # 40


class Refusal(str, enum.Enum):
    """Why a stored page was refused (the metric's `reason` label)."""

    # The backend did not deliver the object whole (absent, or a get that
    # failed, returned short or did not fit).
    MISSING = "missing"
    # The object's length, or the length its seal states, is not this page's.
    SIZE = "size"
    # No seal of this version where the seal belongs (e.g. zeroed object).
    SEAL = "seal"
    # A sealed object of another format, geometry or object index (K vs V).
    TAG = "tag"
    # A sealed object of this format written under another key.
    KEY = "key"
    # The payload does not hash to the sealed checksum.
    CHECKSUM = "checksum"


class StoragePageRefused(ValueError):
    """A stored page failed its seal; the caller treats the page as a miss."""

    def __init__(self, reason: Refusal, detail: str):
        super().__init__(f"L3 page refused ({reason.value}): {detail}")
        self.reason = reason


_logged_reasons: set[Refusal] = set()
_logged_lock = threading.Lock()


def digest(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode())


def checksum(buffers: Iterable) -> int:
    """xxh3-64 over the concatenation of byte buffers (anything exposing the
    buffer protocol: numpy arrays, memoryviews, bytes)."""
    h = xxhash.xxh3_64()
    for buf in buffers:
        h.update(buf)
    return h.intdigest()


def byte_view(t: torch.Tensor):
    """A contiguous CPU tensor's bytes as a numpy array, without a copy."""
    return t.view(torch.uint8).reshape(-1).numpy()


class PageIntegrityStats:
    """One host pool's L3 page statistics; storage threads update it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.refused = {reason: 0 for reason in Refusal}
        # Pages restored from L3 whose scales, metadata or (MLA) RoPE values
        # hold NaN/Inf; unit: pages, the same for every format.
        self.nonfinite_pages_loaded = 0
        self.pages_verified = 0
        # Stored pages a write replaced after a prefetch could not use them.
        self.pages_replaced = 0

    def refuse(self, reason: Refusal, detail: str) -> None:
        """Count and log a refusal, then raise StoragePageRefused."""
        self.note_refused(reason, detail)
        raise StoragePageRefused(reason, detail)

    def note_refused(self, reason: Refusal, detail: str) -> None:
        with self._lock:
            self.refused[reason] += 1
        with _logged_lock:
            first = reason not in _logged_reasons
            _logged_reasons.add(reason)
        if first:
            logger.warning(
                "HiCache L3 page refused (%s): %s. Such pages are a miss; "
                "further refusals for this reason are counted, not logged.",
                reason.value,
                detail,
            )

    def note_verified(self) -> None:
        with self._lock:
            self.pages_verified += 1

    def note_replaced(self, pages: int) -> None:
        with self._lock:
            self.pages_replaced += pages

    def note_nonfinite_loaded(self, pages: int = 1) -> None:
        with self._lock:
            self.nonfinite_pages_loaded += pages

    def counts(self) -> dict[str, int]:
        """Refused pages by reason value (a snapshot)."""
        with self._lock:
            return {reason.value: n for reason, n in self.refused.items()}


class PageSealer:
    """Seals and checks the storage objects of one host pool's pages.

    `tag` names the byte format and geometry: two pools whose pages must not
    read each other's objects have different tags. `object_bytes[i]` is the
    payload of object i (without its seal).
    """

    def __init__(self, tag: str, object_bytes: Iterable[int], stats):
        self.tag = tag
        self.object_bytes = tuple(int(n) for n in object_bytes)
        self._tag_digests = [
            digest(f"{tag}|object{i}") for i in range(len(self.object_bytes))
        ]
        self.stats = stats

    # -- sealing --------------------------------------------------------

    def seal(self, obj: int, key: Optional[str], buffers: Iterable) -> bytes:
        return _SEAL.pack(
            SEAL_MAGIC,
            SEAL_VERSION,
            obj,
            self._tag_digests[obj],
            digest(key or ""),
            self.object_bytes[obj],
            checksum(buffers),
        )

    def seal_into(self, out: torch.Tensor, obj: int, key, buffers) -> None:
        """Write object `obj`'s seal into `out` (SEAL_BYTES uint8, CPU)."""
        byte_view(out)[:] = memoryview(self.seal(obj, key, buffers))

    # -- checking -------------------------------------------------------

    def check(
        self, obj: int, key: Optional[str], buffers: list, seal
    ) -> Optional[Refusal]:
        """None if `buffers` (the payload) and `seal` are object `obj` of the
        page stored under `key`, else the first reason it is not."""
        try:
            magic, version, index, tag, key_digest, length, crc = _SEAL.unpack(
                bytes(seal)
            )
        except struct.error:
            return Refusal.SIZE
        if magic != SEAL_MAGIC or version != SEAL_VERSION:
            return Refusal.SEAL
        if length != self.object_bytes[obj]:
            return Refusal.SIZE
        if index != obj or tag != self._tag_digests[obj]:
            return Refusal.TAG
        if key_digest != digest(key or ""):
            return Refusal.KEY
        if crc != checksum(buffers):
            return Refusal.CHECKSUM
        return None

    def check_flat(self, key: Optional[str], data: torch.Tensor) -> torch.Tensor:
        """The payload of a flat one-object page, or StoragePageRefused."""
        flat = data.reshape(-1).view(torch.uint8)
        payload = self.object_bytes[0]
        if flat.numel() != payload + SEAL_BYTES:
            self.stats.refuse(
                Refusal.SIZE,
                f"{self.tag}: object has {flat.numel()} bytes, expected "
                f"{payload + SEAL_BYTES}",
            )
        arr = byte_view(flat)
        reason = self.check(0, key, [arr[:payload]], arr[payload:])
        if reason is not None:
            self.stats.refuse(reason, f"{self.tag}: key {key}")
        self.stats.note_verified()
        return flat[:payload]


def has_nonfinite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any floating tensor holds NaN/Inf (integer payloads cannot)."""
    return any(
        t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors
    )
