"""Shared fixtures: CPU stand-ins, installed once before sglang is imported."""

from __future__ import annotations

import os

import pytest
import torch

# Triton decides at import (triton.jit) whether kernels are interpreted: on a
# machine without CUDA the fused host-pool kernels run under its interpreter.
# An explicit TRITON_INTERPRET (the compile check's workers set 0) wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.standins import install_torchvision_stub  # noqa: E402

install_torchvision_stub()
if os.environ.get("HIQ_PIPELINE_ONLY") != "1":
    from tests.support.standins import install_sglang_standins  # noqa: E402

    install_sglang_standins()


@pytest.fixture(scope="module")
def triton_interpreter():
    """Modules whose kernels run on CPU tensors opt in with usefixtures: they
    need the kernels built under Triton's interpreter (set above)."""
    from sglang.kernels.ops.kvcache import host_kv_common

    if not host_kv_common.available("cpu"):
        pytest.skip("the fused kernels were built for the GPU, not interpreted")


@pytest.fixture
def toy_host_format():
    """The toy host format (tests/support/copy_format.py), registered through
    the registry alone, as a new format would be; removed afterwards."""
    from sglang.srt.mem_cache.pool_host import host_format as hf
    from tests.support import copy_format as toy

    hf.register_host_dtype(toy.ENTRY)
    yield toy.CopyHostFormat
    del hf.HOST_DTYPES[toy.ENTRY.name]


@pytest.fixture
def l3_rigs():
    """L3 rigs a test makes (append them); their storage backends are detached
    at teardown, pass or fail."""
    made = []
    yield made
    for l3 in made:
        l3.close()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    """One real mooncake_master on 127.0.0.1 for the session (tests keep their
    keys apart by model name). Leases of 1 s let tests rewrite objects and the
    store evict them, yet outlive a read on a busy machine."""
    from tests.support import l3_harness

    l3_harness.require_mooncake()
    master = l3_harness.MooncakeMaster(
        tmp_path_factory.mktemp("mooncake") / "master.log",
        extra_args=("--default_kv_lease_ttl=1000",),
    ).start()
    yield master
    master.stop()


@pytest.fixture
def collectors():
    """SGLang's scheduler and radix-cache metrics collectors, built as a server
    builds them (tests/support/metrics.py)."""
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
    """The demo and replay tools quiet the sglang logger in-process; later
    modules assert on its INFO/WARNING lines, so each module starts as it was."""
    import logging

    logger = logging.getLogger("sglang")
    level = logger.level
    yield
    logger.setLevel(level)
