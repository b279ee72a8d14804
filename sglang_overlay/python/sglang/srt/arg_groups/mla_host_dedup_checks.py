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
    if cfg.hicache_storage_backend not in (None, "file"):
        # The source alone reads and writes L3 pages; wired for file only.
        raise ValueError(
            "--enable-mla-hicache-host-dedup does not support "
            f"--hicache-storage-backend {cfg.hicache_storage_backend}: only file "
            "is wired for L3 with host dedup. Use --hicache-storage-backend file "
            "or drop the flag."
        )
