"""Shared fixtures: CPU stand-ins, installed once before sglang is imported."""

from __future__ import annotations

import fnmatch
import os

import pytest
import torch

# Triton decides at import (triton.jit) whether kernels are interpreted: on a
# machine without CUDA the fused host-pool kernels run under its interpreter.
# An explicit TRITON_INTERPRET (the compile check's workers set 0) wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from scripts.rigs.standins import install_torchvision_stub  # noqa: E402

install_torchvision_stub()
if os.environ.get("HIQ_PIPELINE_ONLY") != "1":
    from scripts.rigs.standins import install_sglang_standins  # noqa: E402

    install_sglang_standins()


@pytest.fixture(scope="module")
def triton_interpreter():
    """Modules running kernels on CPU tensors opt in: they need the interpreter."""
    from sglang.kernels.ops.kvcache import host_kv_common

    if not host_kv_common.available("cpu"):
        pytest.skip("the fused kernels were built for the GPU, not interpreted")


@pytest.fixture
def toy_host_format():
    """The toy format (tests/support/copy_format.py) registered as a new one is."""
    from sglang.srt.mem_cache.pool_host import host_format as hf
    from tests.support import copy_format as toy

    hf.register_host_dtype(toy.ENTRY)
    yield toy.CopyHostFormat
    del hf.HOST_DTYPES[toy.ENTRY.name]


@pytest.fixture(scope="module")
def model_dir():
    """The live-server modules' model, SmolLM2-135M-Instruct (modules may override)."""
    from scripts.rigs.model import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="module")
def prompts(request, model_dir) -> list[list[int]]:
    """The module's PROMPTS prompts of PROMPT_TOKENS tokens each."""
    from scripts.rigs.model import stdlib_prompts

    module = request.module
    return stdlib_prompts(model_dir, module.PROMPTS, module.PROMPT_TOKENS)


@pytest.fixture
def l3_rigs():
    """L3 rigs a test makes (append them): detached at teardown, pass or fail."""
    made = []
    yield made
    for l3 in made:
        l3.close()


def _mooncake_master(tmp_path_factory, lease_ms: int):
    from scripts.rigs import l3_harness

    l3_harness.require_mooncake()
    master = l3_harness.MooncakeMaster(
        tmp_path_factory.mktemp("mooncake") / "master.log",
        extra_args=(f"--default_kv_lease_ttl={lease_ms}",),
    ).start()
    yield master
    master.stop()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    """One real mooncake_master for the session (keys apart by model name); 1 s
    leases let the store evict rewritten objects yet outlive a read when busy."""
    yield from _mooncake_master(tmp_path_factory, 1000)


@pytest.fixture(scope="module")
def short_lease_master(tmp_path_factory):
    """A mooncake_master per module with 100 ms leases (rewrites between I/O)."""
    yield from _mooncake_master(tmp_path_factory, 100)


@pytest.fixture
def host_ram_not_under_test():
    """Tests of KiB-sized pools opt out of the free-RAM guard (shared machine)."""
    from sglang.srt.mem_cache.pool_host import base

    with base.host_memory_budget_scope(1 << 40):
        yield


@pytest.fixture(scope="module")
def hybrid_host_copies_on_cpu():
    """CPU stand-ins for the stock MHA pool's and the Mamba host pool's CUDA copies."""
    from sglang.srt.mem_cache.pool_host import mamba, mha
    from scripts.rigs import standins
    from tests.support.hybrid_rigs import KERNEL_IO_OPS

    with pytest.MonkeyPatch.context() as patch:
        for name in KERNEL_IO_OPS:
            patch.setattr(mha, name, getattr(standins, name), raising=False)
        for name, standin in standins.mamba_standins().items():
            patch.setattr(mamba, name, standin, raising=False)
        yield


@pytest.fixture
def mamba_extra_buffer_on_cpu(monkeypatch):
    """Linear-attention models' default extra_buffer strategy, allowed on CPU."""
    monkeypatch.setattr(
        "sglang.srt.arg_groups.mamba_hook._platform_supports_mamba_cache_extra_buffer",
        lambda: True,
    )


@pytest.fixture
def restore_environ():
    """Start-up resolution exports environment variables: restored afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def hybrid_runtime_context(mamba_extra_buffer_on_cpu):
    """Afterwards the radix caches built (tests/support/hybrid_rigs.py) are
    released, their collectors unregistered, the server arguments reset."""
    from prometheus_client import REGISTRY

    from sglang.srt.runtime_context import reset_context
    from tests.support.hybrid_rigs import _CACHES

    registered_before = set(REGISTRY._collector_to_names)
    yield
    while _CACHES:
        cache = _CACHES.pop()
        # Stop the storage threads an L3-backed controller started.
        if cache.cache_controller.enable_storage:
            cache.cache_controller.detach_storage_backend()
        cache.release_host_resources()
    # The caches' and scheduler's collectors register process-wide.
    for collector in set(REGISTRY._collector_to_names) - registered_before:
        REGISTRY.unregister(collector)
    reset_context()


@pytest.fixture(scope="module")
def hybrid_model_dirs(tmp_path_factory):
    """Paths of the tiny gpt-oss, Qwen3-Next and Qwen3.5 configs (no weights)."""
    import json

    from tests.support.server_args import GPT_OSS, QWEN3_5, QWEN3_NEXT

    root = tmp_path_factory.mktemp("hybrid_models")
    paths = {}
    for name, config in (
        ("gpt_oss", GPT_OSS),
        ("qwen3_next", QWEN3_NEXT),
        ("qwen3_5", QWEN3_5),
    ):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        paths[name] = str(root / name)
    return paths


@pytest.fixture(scope="session")
def smollm2_bundle():
    """The quality harness's SmolLM2-135M, loaded once for every quality test."""
    from scripts.common.cpu_sglang import install_cpu_standins
    from scripts.quality import harness as hq
    from tests.support.quality_inputs import require_inputs

    require_inputs()
    install_cpu_standins()
    return hq.load_model()


@pytest.fixture
def collectors():
    """SGLang's scheduler and radix-cache collectors, built as a server builds them."""
    from tests.support.metrics import scheduler_and_radix_collectors

    yield from scheduler_and_radix_collectors()


@pytest.fixture(scope="module")
def parser():
    """SGLang's own `sglang serve` argument parser (tests/support/server_args.py)."""
    from tests.support.server_args import cli_parser

    return cli_parser()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Paths of the tiny MHA and MLA model configs (no weights)."""
    from tests.support.server_args import write_models

    return write_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module", autouse=True)
def _restore_sglang_log_level():
    """The demo tools quiet the sglang logger; later modules assert on its lines."""
    import logging

    logger = logging.getLogger("sglang")
    level = logger.level
    yield
    logger.setLevel(level)


# `make test-fast` (HIQ_FAST=1): the interpreted kernels and the conformance
# suite at one head geometry, each test's first value of every geometry axis
# (layouts, unit sizes, dtypes and transfer paths all stay).
FAST_ONE_GEOMETRY = ("test_conformance.py", "test_kv_*_triton.py")
GEOMETRY_AXES = ("geometry", "dims", "dim", "d", "H", "heads", "dk", "dv", "rank")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("HIQ_FAST") != "1":
        return
    first, keep, drop = {}, [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        one = any(fnmatch.fnmatch(item.path.name, p) for p in FAST_ONE_GEOMETRY)
        axes = [axis for axis in GEOMETRY_AXES if one and axis in params]
        test = item.nodeid.partition("[")[0]
        same = all(
            first.setdefault((test, axis), params[axis]) == params[axis]
            for axis in axes
        )
        (keep if same else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
