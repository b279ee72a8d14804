"""k8v4 with keys and values rotated (k8rv4r): measured against k8v4r
(docs/quality-rotated.md) and not registered, so it lives with the tests that
keep its measurements reproducible, not in the product."""

from __future__ import annotations

from sglang.srt.mem_cache.pool_host.kv_hadamard import RotatedHostFormatMixin
from sglang.srt.mem_cache.pool_host.kv_int4_codec import K8V4HostFormat


class K8V4RotKeysHostFormat(RotatedHostFormatMixin, K8V4HostFormat):
    name = "k8rv4r"
    base_name = "k8v4"
    storage_format_tag = "k8rv4r-fp16meta-v1"
    rotated_sides = ("k", "v")
    # The kernels' INT8 keys have no rotated variant: torch path only.
    fused_rotation = False
