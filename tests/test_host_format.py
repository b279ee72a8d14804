"""The host-format registry and interface (pool_host/host_format.py) and the encoded
host pools built on it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from sglang.srt.mem_cache.pool_host.page_integrity import SEAL_TAG

from scripts.rigs.hicache_harness import Geometry, make_device_pool, make_host_pool
from sglang.srt.mem_cache.pool_host import host_format as hf
from sglang.srt.mem_cache.pool_host import kv_int8_codec as codec
from sglang.srt.mem_cache.pool_host.host_format import host_format_cls, host_pool_cls
from tests.support import copy_format as toy
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from tests.support.conformance import LAYOUTS
from scripts.rigs.standins import run_fresh

MHATokenToKVPoolINT8Host = host_pool_cls("int8")

PATHS = ("torch", "fused_direct", "fused_staged")


# The toy format, registered through the registry alone (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("toy_host_format")


def copy_pool(device_pool, layout, host_tokens, path):
    return make_host_pool(
        device_pool, host_tokens=host_tokens, layout=layout, host_dtype="copy",
        fused_transfer="off" if path == "torch" else path.removeprefix("fused_"),
    )  # fmt: skip


def seeded_rows(device_pool, slots, seed):
    """Random rows (with a NaN and an Inf) written to `slots` of every layer; returns
    [(k, v)] per layer."""
    gen = torch.Generator().manual_seed(seed)
    written = []
    for layer in range(device_pool.layer_num):
        pair = []
        for buf in (device_pool.k_buffer[layer], device_pool.v_buffer[layer]):
            x = torch.randn((len(slots), *buf.shape[1:]), generator=gen)
            x *= torch.logspace(-8, 6, len(slots), base=2.0)[:, None, None]
            x[1, 0, 0] = float("nan")
            x[2, -1, -1] = float("inf")
            x = x.to(buf.dtype)
            buf[slots] = x
            pair.append(x)
        written.append(tuple(pair))
    return written


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.uint8)


def pages_as_tokens(pages, page_size):
    return (
        torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)
    ).flatten()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("page_size", (1, 4))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_toy_format_round_trips_through_the_generic_pool(layout, page_size, path):
    geo = Geometry(
        layer_num=3, head_num=2, head_dim=16, v_head_dim=8, page_size=page_size
    )
    device_pool = make_device_pool(geo, device_tokens=16 * page_size)
    pool = copy_pool(device_pool, layout, 12 * page_size, path)
    assert pool.transfer_path == path
    host = pages_as_tokens([7, 8, 2, 3, 10, 5], page_size)
    slots = torch.randperm(len(host), generator=torch.Generator().manual_seed(5))
    slots += page_size  # device page 0 is padding
    written = seeded_rows(device_pool, slots, seed=3)
    # Records and untouched units: test_conformance.py's toy rows; here NaN and Inf.
    pool.backup_from_device_all_layer(device_pool, host, slots, "direct")
    ut = pool.host_format.unit_tokens
    # Statistics: per layer and side, the largest finite |x| backed up.
    amax = pool.scale_amax_by_layer()
    assert amax.shape == (geo.layer_num, 2)
    for layer, rows in enumerate(written):
        for side, x in enumerate(rows):
            xf = x.float()
            assert amax[layer, side] == xf[torch.isfinite(xf)].abs().max()

    # Load back, each layer into fresh device slots in reversed unit order.
    order = torch.arange(len(host)).view(-1, ut).flip(0).flatten()
    fresh = torch.arange(len(host)) + (len(host) + page_size)
    for layer in range(geo.layer_num):
        pool.load_to_device_per_layer(device_pool, host[order], fresh, layer, "direct")
        for side, buf in enumerate((device_pool.k_buffer, device_pool.v_buffer)):
            assert torch.equal(
                bits(buf[layer][fresh]), bits(written[layer][side][order])
            )


def test_toy_format_is_dispatched_and_listed_from_its_registry_entry():
    from scripts.common.host_formats import host_formats

    info = make_device_pool(Geometry(), 16).get_device_pool_infos()[0].buffer_info
    assert hf.get_host_dtype("copy") is toy.ENTRY
    assert hf.host_dtype_choices()[-1] == "copy"
    pool_cls = get_mha_host_pool_cls(info, "copy")
    assert pool_cls is host_pool_cls("copy", "mha")
    assert pool_cls.host_format_cls is toy.CopyHostFormat
    assert pool_cls.__name__ == "MHATokenToKVPoolCOPYHost"
    with pytest.raises(NotImplementedError, match="copy does not support MLA"):
        host_pool_cls("copy", "mla")
    assert "copy" in [f.host_dtype for f in host_formats()]


def test_registry_and_dispatch(monkeypatch):
    info = make_device_pool(Geometry(), 16).get_device_pool_infos()[0].buffer_info
    assert hf.host_dtype_choices()[:4] == ["auto", "int8", "int4", "k8v4"]
    assert host_format_cls("int8") is codec.Int8HostFormat
    assert host_format_cls("int8", "mla").name == "int8"
    pool_cls = get_mha_host_pool_cls(info, "int8")
    assert pool_cls is hf.host_pool_cls("int8", "mha")
    assert pool_cls.host_format_cls is codec.Int8HostFormat
    with pytest.raises(ValueError, match="--hicache-host-dtype 'bogus'.*auto, int8"):
        host_format_cls("bogus")
    with pytest.raises(
        NotImplementedError, match="int4 does not support MLA.*auto, int8"
    ):
        hf.host_pool_cls("int4", "mla")
    # A format or pool module this build lacks fails naming the flag.
    monkeypatch.setattr(hf, "HOST_DTYPES", dict(hf.HOST_DTYPES))
    int8 = hf.get_host_dtype("int8")
    hf.register_host_dtype(replace(int8, name="nocodec", mha_format="sglang.no:X"))
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype nocodec"):
        get_mha_host_pool_cls(info, "nocodec")
    hf.register_host_dtype(replace(int8, name="nopool"))
    monkeypatch.setitem(hf._HOST_POOLS, "mha", "sglang.no_such_pool:X")
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype nopool"):
        get_mha_host_pool_cls(info, "nopool")


# ---------------------------------------------------------------------------
# INT8: the bytes the pre-refactor pool wrote


def old_int8_layout(pool, written, host, page_size, layout):
    """Host buffers as the pre-refactor INT8 pool laid them out, filled from the
    reference codec: k [units, L, ut, H, Dk], v [units, L, ut, H, Dv], scale [units, L,
    ut, 2, H] page-major; [L, units, ...] layer_first (ut = 1)."""
    ut = 1 if layout == "layer_first" else page_size
    units, L = pool.size // ut, len(written)
    geo = written[0][0].shape[1:], written[0][1].shape[1:]
    (H, DK), (_, DV) = geo
    shapes = {
        "k": (units, L, ut, H, DK),
        "v": (units, L, ut, H, DV),
        "scale": (units, L, ut, 2, H),
    }
    dtypes = {"k": torch.int8, "v": torch.int8, "scale": torch.float16}
    # 0xA5 bytes everywhere, as the pool's buffers were filled before the backup.
    out = {
        n: torch.full(
            (*s[:-1], s[-1] * dtypes[n].itemsize), 0xA5, dtype=torch.uint8
        ).view(dtypes[n])
        for n, s in shapes.items()
    }
    for layer, (k, v) in enumerate(written):
        (qk, sk), (qv, sv) = codec.quantize_reference(k), codec.quantize_reference(v)
        unit, within = host // ut, host % ut
        out["k"][unit, layer, within] = qk
        out["v"][unit, layer, within] = qv
        out["scale"][unit, layer, within, 0] = sk
        out["scale"][unit, layer, within, 1] = sv
    if layout == "layer_first":
        out = {n: t.transpose(0, 1).contiguous() for n, t in out.items()}
    return [out["k"], out["v"], out["scale"]]


@pytest.mark.parametrize("fused", (False, True), ids=("torch", "fused_direct"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("page_size", (1, 4))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_host_bytes_are_the_pre_refactor_bytes(
    request, layout, page_size, dtype, fused
):
    if fused:
        request.getfixturevalue("triton_interpreter")
    geo = Geometry(layer_num=2, head_num=3, head_dim=32, v_head_dim=16, dtype=dtype,
                   page_size=page_size)  # fmt: skip
    device_pool = make_device_pool(geo, device_tokens=12 * page_size)
    cls = MHATokenToKVPoolINT8Host if fused else MHATokenToKVPoolINT8Host
    pool = make_host_pool(
        device_pool, host_tokens=10 * page_size, layout=layout, host_pool_cls=cls,
        fused_transfer="direct" if fused else "off",
    )  # fmt: skip
    for buf in pool.kv_buffer:
        buf.view(torch.uint8).fill_(0xA5)
    host = pages_as_tokens([7, 8, 2, 3, 9, 0], page_size)
    slots = torch.randperm(len(host), generator=torch.Generator().manual_seed(2))
    written = seeded_rows(device_pool, slots + page_size, seed=17)
    pool.backup_from_device_all_layer(device_pool, host, slots + page_size, "direct")

    expected = old_int8_layout(pool, written, host, page_size, layout)
    assert [r.name for r in pool.host_format.records] == ["k", "v", "scale"]
    assert pool.storage_format_tag == f"int8-fp16scale-v1-{SEAL_TAG}"
    for got, want in zip(pool.kv_buffer, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


TOY_FLAG_PROBE = """
import json, logging, pathlib, tempfile
from sglang.srt.mem_cache.pool_host import host_format as hf
from tests.support import copy_format as toy
hf.register_host_dtype(toy.ENTRY)  # before the flag is declared, as a registry entry
from tests.support.server_args import DEEPSEEK_V2_MLA, LLAMA, cli_parser, from_argv, model_dir
from scripts.common.host_formats import host_dtype_choices
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.INFO)
parser = cli_parser()
(action,) = [a for a in parser._actions if "--hicache-host-dtype" in a.option_strings]
out = {"choices": list(action.choices), "help": action.help, "tools": host_dtype_choices()}
with tempfile.TemporaryDirectory() as tmp:
    for name, config in (("mha", LLAMA), ("mla", DEEPSEEK_V2_MLA)):
        path = model_dir(pathlib.Path(tmp), name, config)
        args = from_argv(parser, path, "--enable-hierarchical-cache", "--hicache-host-dtype",
                         "copy", "--device", "cpu", "--skip-tokenizer-init")
        try:
            args.resolve_once()
            out[name] = "ok"
        except ValueError as e:
            out[name] = str(e)
out["log"] = [m for m in records if m.startswith("HiCache host KV dtype")]
print(json.dumps(out))
"""


def test_toy_format_passes_the_flag_and_start_up_validation():
    """Registered before the server args load, as an entry in host_format.py is, the toy
    is a CLI choice with its help, passes start-up validation for an MHA model, is
    refused for MLA naming the flag, and is in the tools' parser-read list (mutant: a
    hard-coded choices list fails here)."""
    probe = run_fresh(TOY_FLAG_PROBE)
    # This process registered the toy too (pytestmark), last.
    assert probe["choices"] == hf.host_dtype_choices()
    assert probe["choices"][-1] == "copy"
    assert "'copy' stores lossless toy format (tests)" in probe["help"]
    assert probe["tools"][-1] == "copy"
    assert probe["mha"] == "ok"
    assert probe["log"] and probe["log"][0].startswith(
        "HiCache host KV dtype: copy for MHA models (lossless toy format (tests)"
    )
    assert probe["mla"].startswith(
        "--hicache-host-dtype copy does not support MLA models"
    )
    assert "--hicache-host-dtype int8 or auto" in probe["mla"]
