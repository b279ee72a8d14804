"""Fused Triton kernels of the INT8 HiCache host pool (kv_int8_triton).

The kernels must write the same int8 and fp16 bytes as the reference codec
(kv_int8_codec.quantize_reference) and decode to the same values, and the
pool's fused path must match its torch path in every layout. On CUDA the
kernels are compiled and the host buffers are pinned; without CUDA they run
under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported).

    python -m pytest test/registered/kernels/ops/kvcache/test_kv_int8_triton.py -v
"""

import unittest

import torch

from sglang.kernels.ops.kvcache import kv_int8_triton as kt
from sglang.kernels.ops.kvcache.host_kv_common import KVCounters
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

MHATokenToKVPoolINT8Host = host_pool_cls("int8")

register_cpu_ci(est_time=30, suite="base-a-test-cpu")
register_cuda_ci(est_time=30, stage="base-b-kernel-unit", runner_config="1-gpu-small")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
LAYOUTS = ("page_first", "page_first_direct", "layer_first")


def _bits(t):
    t = t.cpu()
    if t.dtype.is_floating_point:
        t = t.masked_fill(torch.isnan(t), 0)  # NaN positions are compared apart
    return t.view({1: torch.int8, 2: torch.int16}[t.element_size()])


@unittest.skipUnless(CUDA or kt.available("cpu"), "needs CUDA or TRITON_INTERPRET=1")
class TestKVInt8Triton(CustomTestCase):
    def assertSameBits(self, a, b):
        if a.dtype.is_floating_point:
            self.assertTrue(torch.equal(torch.isnan(a.cpu()), torch.isnan(b.cpu())))
        self.assertTrue(torch.equal(_bits(a), _bits(b)))

    def test_encode_decode_match_reference(self):
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(24, 3, 96, generator=g, dtype=torch.float64)
            x = x * torch.exp2(torch.randint(-30, 20, (24, 3, 1), generator=g))
            x[0, 0] = 0.0
            x[1, 1, 5] = float("nan")
            x[2, 2, 7] = float("inf")
            x[3, 0] = 1e7  # beyond the fp16-scale range: a NaN row
            x[4, 1] = torch.arange(96) - 47.5  # quotients on .5 ties
            x = x.to(dtype)
            n, H, D = x.shape
            table = kt.DeviceLayerTable([x.to(DEVICE)])
            q = torch.zeros(n, 1, 1, H, D, dtype=torch.int8, device=DEVICE)
            s = torch.zeros(n, 1, 1, 2, H, dtype=torch.float16, device=DEVICE)
            count = torch.zeros((), dtype=torch.int64, device=DEVICE)
            idx = torch.arange(n, device=DEVICE)
            kt.encode_gather(table, table, idx, q, q.clone(), s, idx,
                             unit_tokens=1,
                             counters=KVCounters(nonfinite=count))  # fmt: skip
            q_ref, s_ref = codec.quantize_reference(x)
            self.assertSameBits(q.view(n, H, D), q_ref)
            self.assertSameBits(s[:, 0, 0, 0], s_ref)
            self.assertEqual(int(count), 2 * int(codec.count_nonfinite_rows(s_ref)))
            out = torch.full((n + 2, H, D), 5.0, dtype=dtype, device=DEVICE)
            slots = torch.arange(n, device=DEVICE).flip(0) + 2
            kt.decode_scatter(q[:, 0], q[:, 0], s[:, 0], idx, out, out.clone(), slots,
                              unit_tokens=1)  # fmt: skip
            self.assertSameBits(
                out[slots], codec.dequantize_reference(q_ref, s_ref, dtype)
            )
            self.assertTrue((out[:2] == 5.0).all())

    def _round_trip(self, layout, page_size, fused):
        dev_pool = MHATokenToKVPool(
            size=16 * page_size, page_size=page_size, dtype=torch.bfloat16,
            head_num=2, head_dim=32, layer_num=2, device=DEVICE,
            enable_memory_saver=False, v_head_dim=16, enable_alt_stream=False,
        )  # fmt: skip
        info = dev_pool.get_device_pool_infos()[0].buffer_info
        pool = MHATokenToKVPoolINT8Host(
            info, 2.0, 0, page_size, layout, pin_memory=CUDA, device="cpu",
            device_capacity_tokens=dev_pool.size, start_layer=dev_pool.start_layer,
            end_layer=dev_pool.end_layer, host_token_capacity=16 * page_size,
            fused_transfer="direct" if fused else "off",
        )  # fmt: skip
        g = torch.Generator().manual_seed(page_size)
        dev = torch.tensor([3, 1, 2])[:, None] * page_size + torch.arange(page_size)
        dev = dev.flatten().to(DEVICE)
        for buf in dev_pool.k_buffer + dev_pool.v_buffer:
            buf[dev] = torch.randn(buf[dev].shape, generator=g).to(buf.dtype).to(DEVICE)
        host = pool.alloc(len(dev))
        pool.backup_from_device_all_layer(dev_pool, host, dev, "kernel")
        new = dev + 8 * page_size
        for layer in range(2):
            pool.load_to_device_per_layer(dev_pool, host, new, layer, "kernel")
        if CUDA:
            torch.cuda.synchronize()
        result = [b.clone() for b in pool.kv_buffer] + [
            b.cpu() for b in dev_pool.k_buffer + dev_pool.v_buffer
        ]
        pool.destroy()
        return result

    def test_pool_fused_path_matches_torch_path(self):
        for layout in LAYOUTS:
            for page_size in (1, 16):
                with self.subTest(layout=layout, page_size=page_size):
                    fused = self._round_trip(layout, page_size, True)
                    ref = self._round_trip(layout, page_size, False)
                    for a, b in zip(fused, ref):
                        self.assertSameBits(a, b)


if __name__ == "__main__":
    unittest.main()
