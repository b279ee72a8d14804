"""No kernel compiles while serving: the compiled-mode cache key of every launch
the pools make is recorded; after the start-up self-check, transfers of any
size and index placement add none."""

from __future__ import annotations

import pytest
import torch
from scripts.rigs.hicache_harness import Geometry, fill_random
from tests.support.int8_pool_checks import INTERPRETED_KERNELS, int8_pools
from sglang.kernels.ops.kvcache import host_kv_common as hk
from sglang.kernels.ops.kvcache import kv_int4_triton as k4
from sglang.kernels.ops.kvcache import kv_int8_triton as kt
from sglang.kernels.ops.kvcache import kv_mla_int8_triton as mk
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
    assert encoded_fused.self_check(pool.transfer_context, pool.transfer) is None
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
    assert encoded_fused.self_check(pool.transfer_context, pool.transfer) is None
    warmed = len(recorders["encode"].keys)
    serve(pool, device_pool, SIZES)
    assert len(recorders["encode"].keys) > warmed


# --- the encode kernels' tuples (dev with its layer offsets, counters) --------
# They hold whole tensors only, so what a transfer varies (index slices at any
# offset, sizes, the staged path's first_layer) picks no new variant in any of
# the three kernel modules.

ENCODE_KERNELS = {
    "int8": (kt, "_encode_kernel"),
    "int4": (k4, "_encode_kernel"),
    "mla": (mk, "_mla_encode_kernel"),
}
LAYERS, UNITS = 3, 40


def _layers(n_layers, width, heads=1):
    g = torch.Generator().manual_seed(width)
    return [
        torch.randn(UNITS, heads, width, generator=g).to(torch.bfloat16)
        for _ in range(n_layers)
    ]


def _int8_launch(tables, records_layers):
    k, v = tables
    out = [
        torch.zeros(UNITS, records_layers, 1, 1, 16, dtype=torch.int8) for _ in range(2)
    ]
    scale = torch.zeros(UNITS, records_layers, 1, 2, 1, dtype=torch.float16)

    def launch(dev, host, counters, first_layer):
        kt.encode_gather(
            k, v, dev, *out, scale, host, unit_tokens=1, counters=counters,
            first_layer=first_layer,
        )  # fmt: skip

    return launch


def _int4_launch(tables, records_layers):
    out = {
        "k": torch.zeros(UNITS, records_layers, 1, 1, 8, dtype=torch.uint8),
        "k_meta": torch.zeros(UNITS, records_layers, 1, 1, 2, 2, dtype=torch.float16),
        "v": torch.zeros(UNITS, records_layers, 1, 1, 8, dtype=torch.uint8),
        "v_meta": torch.zeros(UNITS, records_layers, 1, 1, 2, 2, dtype=torch.float16),
    }

    def launch(dev, host, counters, first_layer):
        k4.encode_gather(
            tables, dev, out, host, counters=counters, first_layer=first_layer
        )

    return launch


def _mla_launch(tables, records_layers):
    shape = (UNITS, records_layers, 1, 1)
    out = {
        "kv": torch.zeros(*shape, 32, dtype=torch.int8),
        "scale": torch.zeros(*shape, 2, dtype=torch.float16),
        "rope": torch.zeros(*shape, 16, dtype=torch.bfloat16),
    }

    def launch(dev, host, counters, first_layer):
        mk.encode_gather(
            tables[:1], dev, out, host, counters=counters, first_layer=first_layer
        )

    return launch


LAUNCHES = {"int8": _int8_launch, "int4": _int4_launch, "mla": _mla_launch}
WIDTHS = {"int8": 16, "int4": 16, "mla": 48}


def encode_recorder(monkeypatch, name, honour_options=True):
    module, attr = ENCODE_KERNELS[name]
    recorder = KeyRecorder(getattr(module, attr), honour_options)
    monkeypatch.setattr(module, attr, recorder)
    return recorder


def drive_encodes(name, sides=2):
    """Backups of every layer at once and, as the staged path makes them, one
    layer at a time from every first_layer (whole counters, one-layer
    records), with index slices at odd offsets and of varied sizes."""
    tables = tuple(hk.DeviceLayerTable(_layers(LAYERS, WIDTHS[name])) for _ in range(2))
    counters = hk.KVCounters(
        torch.zeros((), dtype=torch.int64),
        torch.zeros(LAYERS, 1 if name == "mla" else 2),
        torch.zeros((), dtype=torch.int64),
    )
    all_layers = LAUNCHES[name](tables, LAYERS)
    one_layer = LAUNCHES[name](tables, 1)
    pool = torch.arange(UNITS)
    for i, n in enumerate((1, 2, 3, 16, 5, 17)):
        # Slices at 0, 8, 16, ... bytes: every other one off 16-byte alignment.
        dev, host = pool[i : i + n], pool.flip(0)[i : i + n]
        all_layers(dev, host, counters, 0)
        for first_layer in range(LAYERS):
            one_layer(dev, host, counters._replace(bad_indices=None), first_layer)


@pytest.mark.parametrize("name", sorted(ENCODE_KERNELS))
def test_no_encode_variant_from_index_slices_sizes_or_first_layer(monkeypatch, name):
    recorder = encode_recorder(monkeypatch, name)
    drive_encodes(name)
    # One key with the bad-index counter (all layers), one without (staged).
    assert len(recorder.keys) == 2, recorder.keys


@pytest.mark.parametrize("name", sorted(ENCODE_KERNELS))
def test_a_sliced_tuple_element_would_be_a_new_variant(monkeypatch, name):
    """A layer-offsets slice in the dev tuple gives a new key (the recorder
    sees tuple elements' alignment), and sliced counters are refused."""
    recorder = encode_recorder(monkeypatch, name)
    tables = tuple(
        hk.DeviceLayerTable(_layers(LAYERS + 1, WIDTHS[name])) for _ in range(2)
    )
    launch = LAUNCHES[name](tables, LAYERS)
    idx = torch.arange(4)
    launch(idx, idx, None, 0)
    for table in tables:
        table.offsets = table.offsets[1:]  # 8 bytes in: not 16-byte aligned
        table.layers = table.layers[1:]
    launch(idx, idx, None, 0)
    assert len(recorder.keys) == 2
    sliced = torch.zeros(2, dtype=torch.int64)[1]
    with pytest.raises(ValueError, match="whole tensor"):
        launch(idx, idx, hk.KVCounters(nonfinite=sliced), 0)
