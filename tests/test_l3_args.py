"""--hicache-host-dtype int8 with --hicache-storage-backend: what start-up
accepts and what it refuses, through SGLang's own resolution pipeline."""

from __future__ import annotations

import pytest

from sglang.srt.arg_groups.overrides import resolution_result
from tests.support.server_args import resolve


@pytest.mark.parametrize("backend", ["file", "mooncake"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_int8_accepts_file_and_mooncake(models, backend, layout):
    server_args = resolve(
        models["mha"],
        hicache_host_dtype="int8",
        hicache_storage_backend=backend,
        hicache_mem_layout=layout,
    )
    assert resolution_result(server_args, "hicache_storage_backend") == backend
    assert resolution_result(server_args, "hicache_mem_layout") == layout


def test_int8_file_backend_keeps_layer_first(models):
    server_args = resolve(
        models["mha"],
        hicache_host_dtype="int8",
        hicache_storage_backend="file",
        hicache_mem_layout="layer_first",
    )
    assert resolution_result(server_args, "hicache_mem_layout") == "layer_first"


@pytest.mark.parametrize(
    "io_backend,layout", [("direct", "page_first_direct"), ("kernel", "page_first")]
)
def test_int8_mooncake_resolves_layer_first_to_a_page_major_layout(
    models, io_backend, layout
):
    # Upstream's storage resolution; zero-copy INT8 objects need it.
    server_args = resolve(
        models["mha"],
        hicache_host_dtype="int8",
        hicache_storage_backend="mooncake",
        hicache_mem_layout="layer_first",
        hicache_io_backend=io_backend,
    )
    assert resolution_result(server_args, "hicache_mem_layout") == layout


@pytest.mark.parametrize("backend", ["hf3fs", "aibrix", "dynamic"])
def test_int8_refuses_other_storage_backends(backend):
    with pytest.raises(ValueError) as error:
        resolve(hicache_host_dtype="int8", hicache_storage_backend=backend)
    message = str(error.value)
    assert f"--hicache-storage-backend {backend}" in message
    assert "file, mooncake, nixl" in message


def test_int8_storage_refuses_buffer_only_host_memory():
    with pytest.raises(ValueError, match="--hicache-host-memory-mode cache"):
        resolve(
            hicache_host_dtype="int8",
            hicache_storage_backend="mooncake",
            hicache_host_memory_mode="buffer_only",
        )
