"""The k8v4r host (L2) format: k8v4 with Hadamard-rotated values.

Keys are stored exactly as k8v4 stores them (INT8, one FP16 scale per token,
layer and head); each value head row is rotated (kv_hadamard: a per-head
Walsh-Hadamard butterfly with a fixed seeded sign flip), stored as k8v4's
4-bit values and unrotated on restore. Same records, bytes per token and L3
objects as k8v4; the storage tag differs.

Keys stay unrotated: rotating the INT8 keys as well (k8rv4r, measured with
tests/support/rotated_keys_format.py) gained 6-8% of mean KL and no clear top-1 agreement at reduced size
(docs/quality-rotated.md), too little for a format of its own.
"""

from __future__ import annotations

from sglang.srt.mem_cache.pool_host.kv_hadamard import RotatedHostFormatMixin
from sglang.srt.mem_cache.pool_host.kv_int4_codec import K8V4HostFormat


class K8V4RotHostFormat(RotatedHostFormatMixin, K8V4HostFormat):
    """--hicache-host-dtype k8v4r: k8v4 with values rotated."""

    name = "k8v4r"
    base_name = "k8v4"
    storage_format_tag = "k8v4r-fp16meta-v1"
    rotated_sides = ("v",)
