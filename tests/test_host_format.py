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
from tests.support.int4_pool_checks import pages
from scripts.rigs.standins import run_fresh

# The toy format, registered through the registry alone (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("toy_host_format")


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


@pytest.mark.parametrize("path", ("torch", "fused_direct", "fused_staged"))
@pytest.mark.parametrize("page_size", (1, 4))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_toy_format_statistics_through_the_generic_pool(layout, page_size, path):
    """The pool's statistics are the format's: per layer and side, the largest finite
    |x| backed up (the toy's records and restores: test_conformance.py's toy rows)."""
    geo = Geometry(
        layer_num=3, head_num=2, head_dim=16, v_head_dim=8, page_size=page_size
    )
    device_pool = make_device_pool(geo, device_tokens=16 * page_size)
    pool = make_host_pool(
        device_pool, host_tokens=12 * page_size, layout=layout, host_dtype="copy",
        fused_transfer="off" if path == "torch" else path.removeprefix("fused_"),
    )  # fmt: skip
    assert pool.transfer_path == path
    host = pages([7, 8, 2, 3, 10, 5], page_size)
    slots = torch.randperm(len(host), generator=torch.Generator().manual_seed(5))
    slots += page_size  # device page 0 is padding
    written = seeded_rows(device_pool, slots, seed=3)
    pool.backup_from_device_all_layer(device_pool, host, slots, "direct")
    amax = pool.scale_amax_by_layer()
    assert amax.shape == (geo.layer_num, 2)
    for layer, rows in enumerate(written):
        for side, x in enumerate(rows):
            xf = x.float()
            assert amax[layer, side] == xf[torch.isfinite(xf)].abs().max()


def test_registry_and_dispatch(monkeypatch):
    """Registered values (the toy last) dispatch to their pool; unknown values and a
    format or pool module this build lacks fail naming the flag."""
    from scripts.common.host_formats import host_formats

    info = make_device_pool(Geometry(), 16).get_device_pool_infos()[0].buffer_info
    assert hf.host_dtype_choices()[:4] == ["auto", "int8", "int4", "k8v4"]
    assert host_format_cls("int8") is codec.Int8HostFormat
    assert host_format_cls("int8", "mla").name == "int8"
    for name, fmt_cls in (("int8", codec.Int8HostFormat), ("copy", toy.CopyHostFormat)):
        pool_cls = get_mha_host_pool_cls(info, name)
        assert pool_cls is host_pool_cls(name, "mha")
        assert pool_cls.host_format_cls is fmt_cls
    assert pool_cls.__name__ == "MHATokenToKVPoolCOPYHost"
    assert hf.get_host_dtype("copy") is toy.ENTRY
    assert hf.host_dtype_choices()[-1] == "copy"
    assert "copy" in [f.host_dtype for f in host_formats()]
    with pytest.raises(NotImplementedError, match="copy does not support MLA"):
        host_pool_cls("copy", "mla")
    with pytest.raises(ValueError, match="--hicache-host-dtype 'bogus'.*auto, int8"):
        host_format_cls("bogus")
    with pytest.raises(
        NotImplementedError, match="int4 does not support MLA.*auto, int8"
    ):
        hf.host_pool_cls("int4", "mla")
    monkeypatch.setattr(hf, "HOST_DTYPES", dict(hf.HOST_DTYPES))
    int8 = hf.get_host_dtype("int8")
    hf.register_host_dtype(replace(int8, name="nocodec", mha_format="sglang.no:X"))
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype nocodec"):
        get_mha_host_pool_cls(info, "nocodec")
    hf.register_host_dtype(replace(int8, name="nopool"))
    monkeypatch.setitem(hf._HOST_POOLS, "mha", "sglang.no_such_pool:X")
    with pytest.raises(NotImplementedError, match="--hicache-host-dtype nopool"):
        get_mha_host_pool_cls(info, "nopool")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_records_are_the_pre_refactor_layout(layout, dtype):
    """The pre-refactor INT8 pool's buffers: k and v int8 [units, L, ut, H, D], scale
    fp16 [units, L, ut, 2, H] with K's scales then V's, page-major ([L, units, ...]
    layer_first); each record the per-token quantize_reference (pool bytes == records at
    every layout, page size, dtype and path: test_conformance.py's int8 rows)."""
    geo = Geometry(layer_num=2, head_num=3, head_dim=32, v_head_dim=16, dtype=dtype,
                   page_size=4)  # fmt: skip
    pool = make_host_pool(
        make_device_pool(geo, device_tokens=48), host_tokens=40, layout=layout,
        host_dtype="int8",
    )  # fmt: skip
    ut = 1 if layout == "layer_first" else 4
    lead = (2, pool.size // ut) if layout == "layer_first" else (pool.size // ut, 2)
    shapes = [(3, 32), (3, 16), (2, 3)]
    dtypes = [torch.int8, torch.int8, torch.float16]
    assert [r.name for r in pool.host_format.records] == ["k", "v", "scale"]
    for buf, shape, want in zip(pool.kv_buffer, shapes, dtypes, strict=True):
        assert buf.shape == (*lead, ut, *shape) and buf.dtype == want
    assert pool.storage_format_tag == f"int8-fp16scale-v1-{SEAL_TAG}"
    k, v = (torch.randn(2, ut, 3, d).to(dtype) for d in (32, 16))
    k[0, 0, 0, 0], v[-1, -1, -1, -1] = float("nan"), float("inf")
    records = pool.host_format.encode_reference([k, v])
    (qk, sk), (qv, sv) = codec.quantize_reference(k), codec.quantize_reference(v)
    assert torch.equal(records["k"], qk) and torch.equal(records["v"], qv)
    scale = torch.stack([sk, sv], dim=-2).view(torch.int16)
    assert torch.equal(records["scale"].view(torch.int16), scale)


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
