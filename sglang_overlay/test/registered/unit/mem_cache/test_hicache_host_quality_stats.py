"""Unit tests for the host tier's KV quality stats.

SchedulerMetricsReporter._read_hicache_host_quality reads an encoded pool's
per-layer scale amax and the relative restore errors of its sampled pages
(SGLANG_HICACHE_VERIFY_SAMPLE_RATE); a stock pool has none. Checked against
the values of a real backup.

    python -m pytest test/registered/unit/mem_cache/test_hicache_host_quality_stats.py -v
"""

import os
import unittest
from unittest import mock

import torch

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


def _read_quality(host_pool):
    reporter = SchedulerMetricsReporter.__new__(SchedulerMetricsReporter)
    return reporter._read_hicache_host_quality(host_pool)


class TestHiCacheHostQualityStats(CustomTestCase):
    def test_quality_stats_of_stock_and_int8_pools(self):
        device_pool, host_pool = _pools("auto")
        _backup(device_pool, host_pool)
        self.assertIsNone(_read_quality(host_pool))

        # Every backed-up page (one token at page size 1) decoded again.
        with mock.patch.dict(os.environ, {"SGLANG_HICACHE_VERIFY_SAMPLE_RATE": "1"}):
            device_pool, host_pool = _pools("int8")
        _backup(device_pool, host_pool)
        quality = _read_quality(host_pool)
        self.assertEqual(quality.host_dtype, "int8")
        # The largest |x| per layer: K's last row value, V's half of it (exact).
        top = (TOKENS * HEADS * DIM - 1) / 64
        k_amax = [top * (layer + 1) for layer in range(LAYERS)]
        self.assertEqual(
            quality.scale_amax, {"k": k_amax, "v": [a / 2 for a in k_amax]}
        )
        self.assertEqual(len(quality.verify_errors), TOKENS)
        for error in quality.verify_errors:
            self.assertTrue(0 < error <= 0.004, error)
        # Each sample is read once.
        self.assertEqual(_read_quality(host_pool).verify_errors, [])


if __name__ == "__main__":
    unittest.main()
