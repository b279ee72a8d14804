"""Unit tests for the host tier's KV quality stats.

SchedulerMetricsReporter._read_hicache_host_quality reads an encoded pool's
per-layer scale amax and the relative restore errors of its sampled pages
(SGLANG_HICACHE_VERIFY_SAMPLE_RATE); a stock pool has none. Checked against
the values of a real backup (the pools and the backup of
test_hicache_host_tier_stats.py, run beside it).

    python -m pytest test/registered/unit/mem_cache/test_hicache_host_quality_stats.py -v
"""

import os
import unittest
from unittest import mock

from test_hicache_host_tier_stats import DIM, HEADS, LAYERS, TOKENS, _backup, _pools

from sglang.srt.managers.scheduler_components.metrics_reporter import (
    SchedulerMetricsReporter,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")


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
