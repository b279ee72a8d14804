"""HiCache host-tier stats behind the sglang:hicache_host_* metrics, on CPU.

SchedulerMetricsReporter._read_hicache_host_tier reads the host pool's format,
bytes and (for encoded pools) non-finite groups; the controller's ack counts
the same traffic in the device dtype. Both are checked against the pools after
a real backup.

    python -m pytest test/registered/unit/mem_cache/test_hicache_host_tier_stats.py -v
"""

import unittest
from types import SimpleNamespace

import torch

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.managers.scheduler_components.metrics_reporter import (
    SchedulerMetricsReporter,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

LAYERS, HEADS, DIM, TOKENS = 2, 2, 16, 8


def _pools(host_dtype):
    device_pool = MHATokenToKVPool(
        size=32,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    info = device_pool.get_device_pool_infos()[0].buffer_info
    # A budget of its own: the pool is tiny, whatever else the machine runs.
    with host_memory_budget_scope(1 << 30):
        host_pool = get_mha_host_pool_cls(info, host_dtype=host_dtype)(
            info,
            2.0,
            0,
            1,
            "layer_first",
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device_pool.size,
            start_layer=0,
            end_layer=LAYERS,
            host_token_capacity=64,
        )
    return device_pool, host_pool


def _backup(device_pool, host_pool):
    device_indices = torch.arange(1, TOKENS + 1)
    for layer in range(LAYERS):
        rows = torch.arange(TOKENS * HEADS * DIM, dtype=torch.float32)
        rows = rows.reshape(TOKENS, HEADS, DIM) * (layer + 1) / 64
        device_pool.k_buffer[layer][device_indices] = rows.to(torch.bfloat16)
        device_pool.v_buffer[layer][device_indices] = -rows.to(torch.bfloat16) / 2
    host_indices = host_pool.alloc(TOKENS)
    host_pool.backup_from_device_all_layer(
        device_pool, host_indices, device_indices, "direct"
    )
    return device_indices


def _read_tier(host_pool):
    reporter = SchedulerMetricsReporter.__new__(SchedulerMetricsReporter)
    reporter.scheduler = SimpleNamespace(
        tree_cache=SimpleNamespace(
            cache_controller=SimpleNamespace(io_backend="direct", host_dedup=None)
        )
    )
    return reporter._read_hicache_host_tier(host_pool, used_tokens=TOKENS)


def _logical_bytes(host_pool, num_tokens):
    controller = SimpleNamespace(_kv_host_pool=lambda: host_pool)
    op = SimpleNamespace(device_indices=torch.arange(num_tokens))
    num_bytes = num_tokens * host_pool.size_per_token
    return HiCacheController._transfer_num_logical_bytes(controller, op, num_bytes)


class TestHiCacheHostTierStats(CustomTestCase):
    def test_stock_pool_copies_device_dtype_rows(self):
        device_pool, host_pool = _pools("auto")
        _backup(device_pool, host_pool)
        tier = _read_tier(host_pool)
        bf16_bytes = LAYERS * HEADS * 2 * DIM * 2
        self.assertLessEqual(
            {
                "host_dtype": "bfloat16",
                "device_dtype": "bfloat16",
                "layout": "layer_first",
                "io_backend": "direct",
                "transfer_path": "copy",
            }.items(),
            tier.info.items(),
        )
        self.assertEqual(tier.bytes_per_token, bf16_bytes)
        self.assertEqual(tier.used_bytes, TOKENS * bf16_bytes)
        self.assertIsNone(tier.nonfinite_groups)
        self.assertEqual(_logical_bytes(host_pool, 5), 5 * bf16_bytes)

    def test_int8_pool_reports_encoded_bytes_and_nonfinite_groups(self):
        device_pool, host_pool = _pools("int8")
        device_indices = _backup(device_pool, host_pool)
        tier = _read_tier(host_pool)
        int8_bytes = LAYERS * HEADS * (2 * DIM + 2 * 2)
        bf16_bytes = LAYERS * HEADS * 2 * DIM * 2
        self.assertEqual(tier.info["host_dtype"], "int8")
        self.assertEqual(tier.info["device_dtype"], "bfloat16")
        self.assertEqual(tier.info["transfer_path"], "torch")
        self.assertEqual(tier.bytes_per_token, int8_bytes)
        self.assertEqual(tier.used_bytes, TOKENS * int8_bytes)
        self.assertEqual(tier.nonfinite_groups, 0)
        self.assertEqual(_logical_bytes(host_pool, 5), 5 * bf16_bytes)

        # A NaN in one K head row (one INT8 scale group) of every layer.
        for layer in range(LAYERS):
            device_pool.k_buffer[layer][device_indices[0], 0, 0] = float("nan")
        host_indices = host_pool.alloc(1)
        host_pool.backup_from_device_all_layer(
            device_pool, host_indices, device_indices[:1], "direct"
        )
        self.assertEqual(_read_tier(host_pool).nonfinite_groups, LAYERS)


if __name__ == "__main__":
    unittest.main()
