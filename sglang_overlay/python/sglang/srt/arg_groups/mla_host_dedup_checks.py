"""Start-up checks of --enable-mla-hicache-host-dedup (one HiCache host KV
copy per attention-TP group of an MLA model)."""

from __future__ import annotations

from typing import Any

from sglang.srt.arg_groups.overrides import resolving_view


def validate_mla_hicache_host_dedup(server_args: Any):
    """Refuse what MLA host dedup cannot serve, naming the flag."""
    cfg = resolving_view(server_args)
    if not cfg.enable_mla_hicache_host_dedup:
        return
    if not cfg.enable_hierarchical_cache:
        raise ValueError(
            "--enable-mla-hicache-host-dedup requires --enable-hierarchical-cache."
        )
    from sglang.srt.mem_cache.hicache_host_dedup import (
        STORAGE_BACKENDS,
        storage_backend_refusal,
    )

    if cfg.hicache_storage_backend not in STORAGE_BACKENDS:
        # The source alone reads and writes L3 pages.
        raise ValueError(storage_backend_refusal(cfg.hicache_storage_backend))
