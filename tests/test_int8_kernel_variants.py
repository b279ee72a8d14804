"""No kernel compiles while serving (issue 9, item 3).

Triton compiles one kernel per specialization key: constexpr values, options,
the dtype of every argument, and for ints "== 1" / "divisible by 16", for
pointers 16-byte alignment, unless the kernel opts out per argument. Without
a GPU nothing compiles, so this test computes, for every launch the pool
makes, the key Triton's compiled-mode launcher would compute (JITFunction's
own binder, built with the options the pool's kernels were built with), and
counts distinct keys. After the start-up self-check (the warm-up), transfers
of varied sizes and index placements must not add any.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.hicache_harness import Geometry, fill_random
from tests.support.int8_pool_checks import INTERPRETED_KERNELS, int8_pools
from sglang.kernels.ops.kvcache import kv_int8_triton as kt
from sglang.srt.mem_cache.pool_host import encoded_fused
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

pytestmark = INTERPRETED_KERNELS
SPECIALIZE_OPTIONS = ("do_not_specialize", "do_not_specialize_on_alignment")


class KeyRecorder:
    """Wraps a built (interpreted) kernel: records the compiled-mode cache key
    of each launch, then runs it."""

    def __init__(self, kernel, honour_options: bool = True):
        self.kernel = kernel
        options = {k: kernel.kwargs.get(k) for k in SPECIALIZE_OPTIONS}
        if not honour_options:
            options = {}
        jit = JITFunction(kernel.fn, **options)
        self.binder = create_function_from_signature(
            jit.signature, jit.params, BaseBackend
        )
        self.keys: set[str] = set()

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            self.keys.add(repr(specialization) + repr(sorted(options.items())))
            return launch(*args, **kwargs)

        return run


def record_keys(monkeypatch, honour_options: bool = True):
    recorders = {
        name: KeyRecorder(getattr(kt, f"_{name}_kernel"), honour_options)
        for name in ("encode", "decode")
    }
    for name, recorder in recorders.items():
        monkeypatch.setattr(kt, f"_{name}_kernel", recorder)
    return recorders


def serve(pool, device_pool, sizes) -> None:
    """Transfers of the given page counts, from host slots the pool's own
    allocator hands out (slices at varying offsets), freed afterwards."""
    p = pool.page_size
    for i, pages in enumerate(sizes):
        dev = torch.arange(p, (pages + 1) * p)
        if i % 2:
            dev = dev.flip(0).view(pages, p).flip(1).flatten()  # backward jumps
        host = pool.alloc(pages * p)
        pool.backup_from_device_all_layer(device_pool, host, dev, "direct")
        for layer in range(pool.layer_num):
            pool.load_to_device_per_layer(device_pool, host, dev, layer, "direct")
        pool.free(host)


SIZES = [1, 2, 3, 16, 5, 17, 32, 4]


@pytest.mark.parametrize(
    "layout,page_size,access",
    [("page_first", 2, "direct"), ("layer_first", 1, "direct"),
     ("page_first_direct", 4, "staged")],
)  # fmt: skip
def test_no_new_kernel_variant_after_the_self_check(
    monkeypatch, layout, page_size, access
):
    geo = Geometry(layer_num=3, head_num=1, head_dim=16, page_size=page_size)
    device_pool, pool = int8_pools(geo, 40 * page_size, 80 * page_size, layout, access)
    fill_random(device_pool, torch.arange(40 * page_size), seed=2)
    recorders = record_keys(monkeypatch)
    assert encoded_fused.self_check(pool)
    warmed = {name: set(r.keys) for name, r in recorders.items()}
    assert all(warmed.values())
    serve(pool, device_pool, SIZES)
    for name, recorder in recorders.items():
        assert recorder.keys == warmed[name], f"{name} compiled mid-serving"


def test_the_key_sees_per_transfer_specialization(monkeypatch):
    """The same transfers through kernels built without the opt-outs give
    new keys: the recorder can tell (this test cannot pass vacuously)."""
    geo = Geometry(layer_num=2, head_num=1, head_dim=16, page_size=2)
    device_pool, pool = int8_pools(geo, 80, 160, "page_first", "direct")
    recorders = record_keys(monkeypatch, honour_options=False)
    assert encoded_fused.self_check(pool)
    warmed = len(recorders["encode"].keys)
    serve(pool, device_pool, SIZES)
    assert len(recorders["encode"].keys) > warmed
