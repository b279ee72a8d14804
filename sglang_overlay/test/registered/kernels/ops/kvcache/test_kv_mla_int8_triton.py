"""Fused Triton kernels of the MLA INT8 HiCache host pool (kv_mla_int8_triton).

The kernels must write the same int8 latent tiles, fp16 scales and RoPE bits
as the format's reference (MLAInt8HostFormat.encode_reference) and decode to
the same values, and the MLA pool's fused path must match its torch path in
every layout. On CUDA the kernels are compiled and the host buffers are
pinned; without CUDA they run under the Triton interpreter (TRITON_INTERPRET=1,
set before triton is imported).

    python -m pytest test/registered/kernels/ops/kvcache/test_kv_mla_int8_triton.py -v
"""

import unittest

import torch

from sglang.kernels.ops.kvcache import kv_mla_int8_triton as mk
from sglang.kernels.ops.kvcache.host_kv_common import KVCounters
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.host_format import host_pool_cls
from sglang.srt.mem_cache.pool_host.kv_mla_int8_codec import MLAInt8HostFormat
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

MLATokenToKVPoolINT8Host = host_pool_cls("int8", "mla")

register_cpu_ci(est_time=30, suite="base-a-test-cpu")
register_cuda_ci(est_time=30, stage="base-b-kernel-unit", runner_config="1-gpu-small")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
LAYOUTS = ("page_first", "page_first_direct", "layer_first")
LATENT, ROPE = 512, 64


def _bits(t):
    t = t.cpu()
    if t.dtype.is_floating_point:
        t = t.masked_fill(torch.isnan(t), 0)  # NaN positions are compared apart
    return t.view({1: torch.int8, 2: torch.int16}[t.element_size()])


@unittest.skipUnless(CUDA or mk.available("cpu"), "needs CUDA or TRITON_INTERPRET=1")
class TestKVMLAInt8Triton(CustomTestCase):
    def assertSameBits(self, a, b):
        if a.dtype.is_floating_point:
            self.assertTrue(torch.equal(torch.isnan(a.cpu()), torch.isnan(b.cpu())))
        self.assertTrue(torch.equal(_bits(a), _bits(b)))

    def test_encode_decode_match_reference(self):
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(24, 1, LATENT + ROPE, generator=g, dtype=torch.float64)
            x = x * torch.exp2(torch.randint(-20, 12, (24, 1, 1), generator=g))
            x[0, 0, :128] = 0.0
            x[1, 0, 200] = float("nan")  # latent tile 1: restores as NaN
            x[2, 0, LATENT + 3] = float("inf")  # RoPE: kept as is
            x[3, 0, 384:512] = 1e7  # beyond the fp16-scale range: a NaN tile
            x[4, 0, :128] = torch.arange(128) - 63.5  # quotients on .5 ties
            x = x.to(dtype)
            n = x.shape[0]
            fmt = MLAInt8HostFormat((LATENT + ROPE,), 1, 1, dtype)
            out = {
                r.name: torch.zeros((n, 1, *r.shape), dtype=r.dtype, device=DEVICE)
                for r in fmt.records
            }
            count = torch.zeros((), dtype=torch.int64, device=DEVICE)
            idx = torch.arange(n, device=DEVICE)
            table = mk.DeviceLayerTable([x.to(DEVICE)])
            mk.encode_gather(
                [table], idx, out, idx, counters=KVCounters(nonfinite=count)
            )
            ref = fmt.encode_reference([x[:, None]])
            for name, want in ref.items():
                self.assertSameBits(out[name][:, 0], want)
            self.assertEqual(int(count), 3)
            dst = torch.full((n + 2, 1, LATENT + ROPE), 5.0, dtype=dtype, device=DEVICE)
            slots = torch.arange(n, device=DEVICE).flip(0) + 2
            records = {name: t[:, 0] for name, t in out.items()}
            mk.decode_scatter(records, idx, [dst], slots)
            self.assertSameBits(dst[slots], fmt.decode_reference(ref, dtype)[0][:, 0])
            self.assertTrue((dst[:2] == 5.0).all())

    def _round_trip(self, layout, page_size, fused):
        dev_pool = MLATokenToKVPool(
            size=16 * page_size, page_size=page_size, dtype=torch.bfloat16,
            kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, layer_num=2, device=DEVICE,
            enable_memory_saver=False,
        )  # fmt: skip
        info = dev_pool.get_device_pool_infos()[0].buffer_info
        pool = MLATokenToKVPoolINT8Host(
            info, 2.0, 0, page_size, layout, pin_memory=CUDA, device="cpu",
            override_kv_cache_dim=dev_pool.kv_cache_dim,
            device_capacity_tokens=dev_pool.size, start_layer=dev_pool.start_layer,
            end_layer=dev_pool.end_layer, target_layer_num=dev_pool.layer_num,
            host_token_capacity=16 * page_size,
            fused_transfer="direct" if fused else "off",
        )  # fmt: skip
        g = torch.Generator().manual_seed(page_size)
        dev = torch.tensor([3, 1, 2])[:, None] * page_size + torch.arange(page_size)
        dev = dev.flatten().to(DEVICE)
        for buf in dev_pool.kv_buffer:
            buf[dev] = torch.randn(buf[dev].shape, generator=g).to(buf.dtype).to(DEVICE)
        host = pool.alloc(len(dev))
        pool.backup_from_device_all_layer(dev_pool, host, dev, "kernel")
        new = dev + 8 * page_size
        for layer in range(2):
            pool.load_to_device_per_layer(dev_pool, host, new, layer, "kernel")
        if CUDA:
            torch.cuda.synchronize()
        result = [t.clone() for t in pool.host_records.values()]
        result += [b.cpu() for b in dev_pool.kv_buffer]
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
