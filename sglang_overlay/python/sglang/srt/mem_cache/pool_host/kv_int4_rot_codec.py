"""The int4r host (L2) format: int4 with Hadamard-rotated keys and values.

Each head row of K and V is rotated (kv_hadamard: a per-head Walsh-Hadamard
butterfly with a fixed seeded sign flip) and then stored exactly as int4
stores it (kv_int4_codec: keys per channel over a page of at least 16 tokens,
else per token; values per token in groups of 64 channels), and unrotated on
restore. Same records, bytes per token and L3 objects as int4; the storage
tag differs, so L3 pages of one are never read as the other.
"""

from __future__ import annotations

from sglang.srt.mem_cache.pool_host.kv_hadamard import RotatedHostFormatMixin
from sglang.srt.mem_cache.pool_host.kv_int4_codec import Int4HostFormat


class Int4RotHostFormat(RotatedHostFormatMixin, Int4HostFormat):
    """--hicache-host-dtype int4r: int4 with keys and values rotated."""

    name = "int4r"
    base_name = "int4"
    storage_format_tag = "int4r-fp16meta-v1"
    rotated_sides = ("k", "v")
