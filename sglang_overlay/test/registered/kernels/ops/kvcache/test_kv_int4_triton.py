"""Fused Triton kernels of the int4 and k8v4 HiCache host formats (kv_int4_triton).

The kernels must write the same record bytes as the format's reference
(kv_int4_codec.int4_encode_reference / k8v4_encode_reference) and restore the
same values, for per-channel keys (units of 16 tokens) and per-token keys
(units of one token), with NaN/Inf/huge groups. On CUDA the kernels are
compiled; without CUDA they run under the Triton interpreter (TRITON_INTERPRET=1,
set before triton is imported).

    python -m pytest test/registered/kernels/ops/kvcache/test_kv_int4_triton.py -v
"""

import unittest

import torch

from sglang.kernels.ops.kvcache import kv_int4_triton as k4
from sglang.kernels.ops.kvcache.host_kv_common import KVCounters
from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")
register_cuda_ci(est_time=30, stage="base-b-kernel-unit", runner_config="1-gpu-small")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
ENCODE = {"int4": codec.int4_encode_reference, "k8v4": codec.k8v4_encode_reference}
DECODE = {"int4": codec.int4_decode_reference, "k8v4": codec.k8v4_decode_reference}
SHAPES = {"int4": codec.int4_record_shapes, "k8v4": codec.k8v4_record_shapes}


def _bits(t):
    t = t.cpu()
    if t.dtype.is_floating_point:
        t = t.masked_fill(torch.isnan(t), 0)  # NaN positions are compared apart
    return t.view({1: torch.int8, 2: torch.int16}[t.element_size()])


@unittest.skipUnless(CUDA or k4.available("cpu"), "needs CUDA or TRITON_INTERPRET=1")
class TestKVInt4Triton(CustomTestCase):
    def assertSameBits(self, a, b):
        if a.dtype.is_floating_point:
            self.assertTrue(torch.equal(torch.isnan(a.cpu()), torch.isnan(b.cpu())))
        self.assertTrue(torch.equal(_bits(a), _bits(b)))

    def _rows(self, n, H, D, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, H, D, generator=g, dtype=torch.float64)
        x = x * torch.exp2(torch.randint(-20, 12, (n, H, 1), generator=g))
        x[0, 0] = 0.0
        x[1, 1, 5] = float("nan")
        x[2, 0, 7] = float("-inf")
        x[3, 1] = 1e6 if dtype == torch.bfloat16 else 6e4  # huge groups
        return x.to(dtype)

    def test_encode_decode_match_reference(self):
        H, D, units, layers = 2, 64, 4, 2
        for fmt, unit_tokens in (("int4", 16), ("int4", 1), ("k8v4", 16)):
            for dtype in (torch.bfloat16, torch.float16):
                with self.subTest(fmt=fmt, unit_tokens=unit_tokens, dtype=dtype):
                    n = units * unit_tokens
                    rows = [self._rows(n, H, D, dtype, s) for s in range(2 * layers)]
                    tables = [
                        k4.DeviceLayerTable([r.to(DEVICE) for r in rows[:layers]]),
                        k4.DeviceLayerTable([r.to(DEVICE) for r in rows[layers:]]),
                    ]
                    out = {
                        name: torch.zeros(
                            units, layers, *shape, dtype=dt, device=DEVICE
                        )
                        for name, (shape, dt) in SHAPES[fmt](
                            (D, D), H, unit_tokens
                        ).items()
                    }
                    # Host units in reverse order; device rows as given.
                    host = (
                        torch.arange(units).flip(0)[:, None] * unit_tokens
                        + torch.arange(unit_tokens)
                    ).flatten()
                    count = torch.zeros((), dtype=torch.int64, device=DEVICE)
                    k4.encode_gather(
                        tables, torch.arange(n, device=DEVICE), out,
                        host.to(DEVICE), counters=KVCounters(nonfinite=count),
                    )  # fmt: skip
                    expected_bad = 0
                    for layer in range(layers):
                        k = rows[layer].view(units, unit_tokens, H, D)
                        v = rows[layers + layer].view(units, unit_tokens, H, D)
                        want = ENCODE[fmt](k, v)
                        for name, rec in want.items():
                            self.assertSameBits(out[name][:, layer].flip(0), rec)
                        meta = (
                            want["k_scale"] if fmt == "k8v4" else want["k_meta"][..., 0]
                        )
                        expected_bad += int(torch.isnan(meta).sum())
                        expected_bad += int(torch.isnan(want["v_meta"][..., 0]).sum())

                        dst = [torch.full((n + 2, H, D), 5.0, dtype=dtype, device=DEVICE)
                               for _ in range(2)]  # fmt: skip
                        slots = torch.arange(n, device=DEVICE).flip(0) + 2
                        layer_records = {name: t[:, layer] for name, t in out.items()}
                        k4.decode_scatter(layer_records, host.to(DEVICE), dst, slots)
                        k_ref, v_ref = DECODE[fmt](want, dtype)
                        self.assertSameBits(dst[0][slots], k_ref.reshape(n, H, D))
                        self.assertSameBits(dst[1][slots], v_ref.reshape(n, H, D))
                        self.assertTrue((dst[0][:2] == 5.0).all())
                    self.assertEqual(int(count), expected_bad)


if __name__ == "__main__":
    unittest.main()
