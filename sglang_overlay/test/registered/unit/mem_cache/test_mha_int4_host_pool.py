"""INT4 and K8V4 HiCache host pools (--hicache-host-dtype int4 / k8v4) on CPU.

The codec's fast path writes its reference bytes and stays within its error
bound; backup then per-layer load through the pool gives exactly the
reference restore in every layout and page size (keys per channel from 16
tokens a page, per token below), restores NaN for non-finite KV, moves
nothing for bad host indices, and sizes the pool by the encoded bytes.

    python -m pytest test/registered/unit/mem_cache/test_mha_int4_host_pool.py -v
"""

import unittest

import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host import kv_int4_codec as codec
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=15, suite="base-a-test-cpu")

LAYOUTS = ("page_first", "page_first_direct", "layer_first")
FORMATS = ("int4", "k8v4")


def _device_pool(page_size, head_num=2, head_dim=64, layers=2, dtype=None):
    return MHATokenToKVPool(
        size=16 * page_size,
        page_size=page_size,
        dtype=dtype or torch.bfloat16,
        head_num=head_num,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


def _host_pool(device_pool, layout, host_dtype, host_size=0, host_tokens=None):
    info = device_pool.get_device_pool_infos()[0].buffer_info
    cls = get_mha_host_pool_cls(info, host_dtype=host_dtype)
    return cls(
        info,
        2.0,
        host_size,
        device_pool.page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_pool.size,
        start_layer=0,
        end_layer=device_pool.layer_num,
        host_token_capacity=host_tokens,
    )


def _pages(first, count, page_size):
    return (
        (torch.arange(first, first + count)[:, None] * page_size)
        .add(torch.arange(page_size))
        .flatten()
    )


def _expected(host_dtype, k_rows, v_rows, unit_tokens):
    """Reference restore of rows written in host-unit order."""
    units = [x.view(-1, unit_tokens, *x.shape[1:]) for x in (k_rows, v_rows)]
    encode = getattr(codec, f"{host_dtype}_encode_reference")
    decode = getattr(codec, f"{host_dtype}_decode_reference")
    return [x.flatten(0, 1) for x in decode(encode(*units), k_rows.dtype)]


class TestKVInt4Codec(CustomTestCase):
    def test_fast_path_is_the_reference_and_within_the_bound(self):
        gen = torch.Generator().manual_seed(0)
        for dtype in (torch.bfloat16, torch.float16):
            x = (torch.randn(3, 16, 2, 128, generator=gen) * 4 + 1).to(dtype)
            x[0, 0, 0, 5] = float("nan")
            for per_channel in (False, True):
                with self.subTest(dtype=dtype, per_channel=per_channel):
                    if per_channel:
                        packed, meta = codec.encode_channels_reference(x)
                        encode_into = codec.encode_channels_into
                        decode = codec.decode_channels_reference
                        bound = codec.error_bound_channels
                    else:
                        packed, meta = codec.encode_tokens_reference(x)
                        encode_into = codec.encode_tokens_into
                        decode = codec.decode_tokens_reference
                        bound = codec.error_bound_tokens
                    fast_packed = torch.empty_like(packed)
                    fast_meta = torch.empty_like(meta)
                    encode_into(x, fast_packed, fast_meta)
                    self.assertTrue(torch.equal(fast_packed, packed))
                    self.assertTrue(
                        torch.equal(fast_meta.view(torch.int16), meta.view(torch.int16))
                    )
                    restored = decode(packed, meta, dtype)
                    self.assertEqual(int(codec.count_nonfinite_groups(meta)), 1)
                    ok = ~torch.isnan(restored)
                    err = (restored.double() - x.double()).abs()
                    self.assertTrue(bool((err[ok] <= bound(meta, restored)[ok]).all()))
                    # The NaN's group: channel 5 over the unit, or its token's
                    # 64 channels.
                    group = (
                        (0, slice(None), 0, 5) if per_channel else (0, 0, 0, slice(64))
                    )
                    self.assertTrue(bool(torch.isnan(restored[group]).all()))
                    self.assertEqual(int((~ok).sum()), restored[group].numel())

    def test_packing_order(self):
        q = torch.tensor([[1, 15, 0, 7]], dtype=torch.uint8)
        self.assertEqual(codec.pack_int4(q).tolist(), [[0xF1, 0x70]])
        self.assertTrue(torch.equal(codec.unpack_int4(codec.pack_int4(q)), q))


class TestMHAInt4HostPool(CustomTestCase):
    def _round_trip(self, host_dtype, layout, page_size, dtype=torch.bfloat16):
        device_pool = _device_pool(page_size, dtype=dtype)
        pool = _host_pool(device_pool, layout, host_dtype, host_tokens=16 * page_size)
        src = _pages(1, 3, page_size)
        gen = torch.Generator().manual_seed(page_size)
        written = []
        for layer in range(device_pool.layer_num):
            rows = []
            for buf in (device_pool.k_buffer[layer], device_pool.v_buffer[layer]):
                buf[src] = torch.randn((len(src), *buf.shape[1:]), generator=gen).to(
                    buf.dtype
                )
                rows.append(buf[src].clone())
            written.append(rows)
        host = pool.alloc(len(src))
        pool.backup_from_device_all_layer(device_pool, host, src, "kernel")

        for layer in range(device_pool.layer_num):
            device_pool.k_buffer[layer].fill_(3.0)
            device_pool.v_buffer[layer].fill_(3.0)
        dst = _pages(8, 3, page_size)
        for layer in range(device_pool.layer_num):
            pool.load_to_device_per_layer(device_pool, host, dst, layer, "kernel")

        unit_tokens = 1 if layout == "layer_first" else page_size
        others = torch.ones(device_pool.size + page_size, dtype=torch.bool)
        others[dst] = False
        for layer, (k_rows, v_rows) in enumerate(written):
            k_want, v_want = _expected(host_dtype, k_rows, v_rows, unit_tokens)
            self.assertTrue(torch.equal(device_pool.k_buffer[layer][dst], k_want))
            self.assertTrue(torch.equal(device_pool.v_buffer[layer][dst], v_want))
            self.assertTrue(bool((device_pool.k_buffer[layer][others] == 3.0).all()))

    def test_round_trip_every_layout_and_page_size(self):
        for host_dtype in FORMATS:
            for layout in LAYOUTS:
                for page_size in (1, 16):
                    with self.subTest(
                        host_dtype=host_dtype, layout=layout, page_size=page_size
                    ):
                        self._round_trip(host_dtype, layout, page_size)

    def test_round_trip_fp16(self):
        self._round_trip("int4", "page_first", 16, dtype=torch.float16)

    def test_nonfinite_groups_restore_as_nan(self):
        device_pool = _device_pool(16)
        pool = _host_pool(device_pool, "page_first", "int4", host_tokens=64)
        src = _pages(1, 1, 16)
        device_pool.k_buffer[0][src] = 1.0
        device_pool.k_buffer[0][src[2], 1, 3] = float("inf")
        host = pool.alloc(16)
        pool.backup_from_device_all_layer(device_pool, host, src, "direct")
        self.assertEqual(pool.nonfinite_group_count(), 1)
        dst = _pages(3, 1, 16)
        pool.load_to_device_per_layer(device_pool, host, dst, 0, "direct")
        restored = device_pool.k_buffer[0][dst]
        # Keys per channel: channel 3 of head 1 over the page.
        self.assertTrue(bool(torch.isnan(restored[:, 1, 3]).all()))
        restored[:, 1, 3] = 1.0
        self.assertTrue(bool((restored == 1.0).all()))

    def test_bad_host_indices_move_nothing(self):
        device_pool = _device_pool(16)
        pool = _host_pool(device_pool, "page_first", "k8v4", host_tokens=32)
        src = _pages(1, 1, 16)
        before = {n: b.clone() for n, b in pool.host_records.items()}
        for host in (_pages(-1, 1, 16), _pages(5, 1, 16)):
            with self.assertRaisesRegex(IndexError, "out of range"):
                pool.backup_from_device_all_layer(device_pool, host, src, "direct")
        for name, old in before.items():
            new = pool.host_records[name]
            self.assertTrue(torch.equal(old.view(torch.uint8), new.view(torch.uint8)))

    def test_size_per_token_is_encoded_size(self):
        # 8 heads of 128 dims: int4 512 + 64 + 512 + 64 B per token and layer
        # at page size 64, k8v4 1024 + 16 + 512 + 64 B.
        device_pool = _device_pool(64, head_num=8, head_dim=128, layers=4)
        for host_dtype, per_layer in (("int4", 1152), ("k8v4", 1616)):
            pool = _host_pool(device_pool, "page_first", host_dtype, host_size=0.01)
            self.assertEqual(pool.get_size_per_token(), 4 * per_layer)
            allocated = sum(
                b.numel() * b.element_size() for b in pool.host_records.values()
            )
            self.assertEqual(allocated, pool.size * pool.get_size_per_token())

    def test_odd_head_dim_is_rejected(self):
        with self.assertRaisesRegex(NotImplementedError, "--hicache-host-dtype int4"):
            _host_pool(_device_pool(1, head_dim=63), "page_first", "int4", 0, 16)


if __name__ == "__main__":
    unittest.main()
