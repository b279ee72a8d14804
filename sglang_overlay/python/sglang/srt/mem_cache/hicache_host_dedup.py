"""MLA host dedup inside HiCache (--enable-mla-hicache-host-dedup).

Every attention-TP rank of an MLA model holds the same latent KV, so one rank
per attention-TP group (its first, the source) keeps the host pool, in any
--hicache-host-dtype; the other ranks keep allocator-only pools of the same
capacity, so that host indices stay identical on every rank. Backups run on
the source only. A load restores (decodes) each layer on the source and
MLAHostDedupBroadcaster sends the restored layer to the other ranks' device
pools. A failure on the source during a load raises HostDedupLoadError on
every rank of the group after the layers' broadcasts, never a hang. With L3
(`file`, `mooncake`), the source alone writes and reads pages; the group agrees on each
prefetch's hits, host slots and completed pages, so every rank allocates the
same host indices and a page (or slots) the source cannot use is a miss on
every rank. A failed load cannot be a miss: its batch is already formed.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist

from sglang.srt.mem_cache.mla_host_dedup import (
    MLAHostDedupBroadcaster,
    mla_host_dedup_eligible,
)
from sglang.srt.mem_cache.pool_host.mla import (
    MLAHostAllocation,
    MLATokenToKVPoolHost,
)

logger = logging.getLogger(__name__)

FLAG = "--enable-mla-hicache-host-dedup"
# L3 backends the source alone serves for its group (None: no L3).
STORAGE_BACKENDS = (None, "file", "mooncake")


class _Broadcaster(MLAHostDedupBroadcaster):
    """Upstream's layerwise broadcaster; a DSA shared-top-k layer's 0-row
    indexer placeholder has nothing to send (and no row to index)."""

    def _bcast_layer(self, buf_list, staging, target, elem, layer_id: int) -> None:
        if buf_list[layer_id].shape[0] == 0:
            return
        super()._bcast_layer(buf_list, staging, target, elem, layer_id)


class _AllocatorOnlySidePool:
    """Builds a side pool riding on the anchor's host indices (the DSA
    indexer keys) in allocator-only mode, for the non-source ranks."""

    def __init__(self, builder):
        self._builder = builder

    def __getattr__(self, name):
        return getattr(self._builder, name)

    def build(self, *, decl, anchor_host, allocator_type, packed_draft_device_pools):
        from sglang.srt.mem_cache.pool_host.dsa import (
            DSAIndexerHostPoolBuilder,
            DSAIndexerPoolHost,
        )

        if not isinstance(self._builder, DSAIndexerHostPoolBuilder):
            raise ValueError(
                f"{FLAG} has no allocator-only mode for the {decl.pool_name} host "
                f"pool ({type(self._builder).__name__}). Drop the flag."
            )
        pool = DSAIndexerPoolHost(
            decl=decl,
            anchor_host=anchor_host,
            packed_draft_device_pools=packed_draft_device_pools,
            allocator_type=allocator_type,
            is_dummy=True,
        )
        # It stores nothing, like the anchor's allocator-only pool.
        pool.size_per_token = 0
        return pool


class HostDedupLoadError(RuntimeError):
    """The source rank could not restore a load; raised on every rank."""


class _GuardedLoad:
    """The source's host pool, with load failures recorded instead of raised,
    so that the source still takes part in every layer's broadcast."""

    def __init__(self, host_pool, dedup: HiCacheHostDedup):
        self._host_pool = host_pool
        self._dedup = dedup

    def __getattr__(self, name):
        return getattr(self._host_pool, name)

    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        try:
            return self._host_pool.prepare_transfer_indices(
                host_indices, device_indices, io_backend
            )
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            self._dedup._record_failure(exc)
            return host_indices, device_indices

    def load_to_device_per_layer_physical(self, *args, **kwargs):
        if self._dedup._failure is not None:
            return
        try:
            self._host_pool.load_to_device_per_layer_physical(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            self._dedup._record_failure(exc)


class HiCacheHostDedup:
    """What a HiCacheController needs for MLA host dedup: whether this rank is
    the source, the layer broadcaster, and a gloo group for a load's status."""

    def __init__(
        self, broadcaster: MLAHostDedupBroadcaster, status_group: dist.ProcessGroup
    ):
        self.broadcaster = broadcaster
        self.status_group = status_group
        self.is_src = broadcaster.is_src
        self.src_global_rank = broadcaster.src_global_rank
        # sglang:hicache_host_info's host_copy and host_copy_ranks labels.
        self.host_copy = "source" if self.is_src else "peer"
        self.group_size = dist.get_world_size(status_group)
        self._failure: Optional[BaseException] = None

    @classmethod
    def build(
        cls,
        device_pool,
        attn_tp_group: dist.ProcessGroup,
        storage_backend: Optional[str] = None,
        backend: Optional[str] = None,
    ) -> Optional[HiCacheHostDedup]:
        """The dedup state over `attn_tp_group` (the attention-TP group: the
        TP group, or with DP attention each DP rank's attention-TP group), or
        None where the group has one rank. Collective over the world."""
        check_host_dedup_supported(device_pool, storage_backend)
        ranks = dist.get_process_group_ranks(attn_tp_group)
        if len(ranks) <= 1:
            return None
        broadcaster = _Broadcaster.build(
            device_pool, attn_tp_group, None, backend=backend
        )
        from sglang.srt.distributed.parallel_state import (
            create_custom_parallel_group,
        )

        status_group = create_custom_parallel_group(list(ranks), backend="gloo")
        return cls(broadcaster, status_group)

    @classmethod
    def build_for_stack(
        cls, kv_pool, params, storage_backend: Optional[str], *, use_mla: bool
    ) -> Optional[HiCacheHostDedup]:
        """The dedup state for the scheduler's kv-only HiCache stack, over the
        attention-TP group (with DP attention) or the TP group."""
        if not use_mla:
            raise ValueError(
                f"{FLAG} is for MLA models; this model's KV cache is "
                f"{type(kv_pool).__name__}. Drop the flag."
            )
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled

        group = params.tp_cache_group
        if is_dp_attention_enabled() and params.attn_tp_cache_group is not None:
            group = params.attn_tp_cache_group
        if group is None:
            return None
        return cls.build(kv_pool, group, storage_backend)

    def build_host_pool(self, host_pool_cls, buffer_info, *args, **kwargs):
        """The host pool `host_pool_cls(buffer_info, *args, **kwargs)` on the
        source; elsewhere an allocator-only pool of the source's capacity and
        bytes per token (so the same allocations give the same indices)."""
        if self.is_src:
            pool = host_pool_cls(buffer_info, *args, **kwargs)
            geometry = torch.tensor(
                [pool.size, pool.size_per_token], dtype=torch.float64
            )
        else:
            geometry = torch.zeros(2, dtype=torch.float64)
        dist.broadcast(geometry, src=self.src_global_rank, group=self.status_group)
        group_size = dist.get_world_size(self.status_group)
        group_gb = geometry[0].item() * geometry[1].item() / 1e9
        logger.info(
            "%s: this rank holds %.4g GB of host KV (%s); its attention-TP group "
            "of %d ranks holds %.4g GB instead of %.4g GB without dedup.",
            FLAG,
            group_gb if self.is_src else 0.0,
            "source" if self.is_src else "allocator-only",
            group_size,
            group_gb,
            group_gb * group_size,
        )
        if self.is_src:
            return pool
        size, size_per_token = int(geometry[0]), float(geometry[1])
        if size_per_token.is_integer():
            size_per_token = int(size_per_token)
        drafts = kwargs.pop("draft_buffer_infos", ())
        kwargs.pop("host_token_capacity", None)
        kv_cache_dim = kwargs.get("override_kv_cache_dim") or (
            buffer_info.kv_lora_rank + buffer_info.qk_rope_head_dim
        )
        allocation = MLAHostAllocation(
            dtype=buffer_info.dtype,
            kv_lora_rank=buffer_info.kv_lora_rank,
            qk_rope_head_dim=buffer_info.qk_rope_head_dim,
            kv_cache_dim=kv_cache_dim,
            size_per_token=size_per_token,
            draft_layer_num=len(drafts),
            packed_fp8=buffer_info.packed_fp8,
        )
        pool = MLATokenToKVPoolHost(
            allocation, *args, host_token_capacity=size, **kwargs
        )
        # It stores nothing: the host-tier metrics and the controller's byte
        # counters (hicache_backup_bytes_total, ...) count 0 bytes per token.
        pool.size_per_token = 0
        return pool

    def side_pool_builder(self, builder):
        """The builder of a side host pool (the DSA indexer keys): upstream's
        on the source, an allocator-only one elsewhere."""
        return builder if self.is_src else _AllocatorOnlySidePool(builder)

    def wrap_load(
        self,
        transfers: list,
        device_indices: torch.Tensor,
        stream,
        on_layer_done: Callable[[int], None],
    ):
        """The transfers to submit for one load and the per-layer callback
        that broadcasts each restored layer before announcing it."""
        self._failure = None
        prepared = self.broadcaster.prepare_broadcast(device_indices, stream)
        guarded = [
            t._replace(host_pool=_GuardedLoad(t.host_pool, self)) for t in transfers
        ]

        def broadcast_then_done(layer_id: int) -> None:
            self.broadcaster.broadcast_loaded_layer(layer_id, prepared)
            on_layer_done(layer_id)

        return guarded, broadcast_then_done

    def _record_failure(self, exc: BaseException) -> None:
        if self._failure is None:
            logger.error("MLA host dedup: the source rank failed a load: %r", exc)
            self._failure = exc

    def agree_on_alloc(
        self, host_pool, indices: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """`indices`, just allocated from `host_pool` (a pool or a pool
        group), if every rank of the group allocated; else None on every rank,
        with the allocation undone where it was made (a collective on the
        scheduler thread). The peers' pools mirror the source's, so this only
        turns a refusal on one rank into the same refusal everywhere."""
        flag = torch.tensor([int(indices is not None)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.status_group)
        if flag.item() or indices is None:
            return indices
        logger.warning(
            "MLA host dedup: another rank of the group could not allocate %d host "
            "slots; the allocation is refused on every rank.",
            len(indices),
        )
        entry = getattr(host_pool, "anchor_entry", None)
        pool = host_pool if entry is None else entry.host_pool
        with pool.lock:
            # Back at the head of the free list: free() would queue the slots
            # last, and this rank's next allocations would differ from the
            # other ranks'.
            pool.slot_used[indices] = False
            pool.free_slots = torch.cat([indices, pool.free_slots])
        return None

    def finish_load(self) -> None:
        """Agree on the load's outcome; raise on every rank if it failed."""
        failed = torch.tensor([int(self._failure is not None)], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.status_group)
        failure, self._failure = self._failure, None
        if failed.item():
            raise HostDedupLoadError(
                f"{FLAG}: the source rank (global rank {self.src_global_rank}) "
                "failed to restore a load; its device rows are not valid on "
                "any rank of the attention-TP group"
            ) from failure

    def destroy(self) -> None:
        self.broadcaster.destroy()
        try:
            dist.destroy_process_group(self.status_group)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass


def storage_backend_refusal(storage_backend: str) -> str:
    return (
        f"{FLAG} does not support --hicache-storage-backend {storage_backend}: "
        "only file and mooncake are wired for L3 with host dedup. Use "
        "--hicache-storage-backend file or mooncake, or drop the flag."
    )


def check_host_dedup_supported(device_pool, storage_backend: Optional[str]) -> None:
    """Refuse, naming the flag, what the dedup cannot serve."""
    # The source alone reads and writes L3 pages (the peers' host indices
    # follow from the group's agreed hit counts); wired for STORAGE_BACKENDS.
    if storage_backend not in STORAGE_BACKENDS:
        raise ValueError(storage_backend_refusal(storage_backend))
    if not mla_host_dedup_eligible(device_pool, storage_backend):
        raise ValueError(
            f"{FLAG} needs an MLA model's BF16/FP16/FP8 latent KV cache on CUDA "
            f"(or CPU), got {type(device_pool).__name__} on "
            f"{getattr(device_pool, 'device', '?')}. Drop the flag."
        )
