"""INT4 and K8V4 host pools (host_pool_cls("int4"/"k8v4"), pool_host/mha_encoded.py)
through the real patched SGLang code on CPU: geometry refusals, the start-up log, the
real controller's random operations and L3 page I/O."""

from __future__ import annotations

import logging

import pytest

from scripts.rigs.hicache_harness import Geometry, make_device_pool, make_host_pool
from tests.support.int4_pool_checks import (
    build,
)


FORMATS = ("int4", "k8v4")
# The checks every 4-bit format passes, its rotated forms (int4r, k8v4r) too.
FAMILY = (*FORMATS, "int4r", "k8v4r")


# --- dispatch ---------------------------------------------------------------


# --- geometry refusals (the round trips: tests/test_conformance.py) ----------


def test_odd_head_dim_fails_naming_the_flag():
    geo = Geometry(head_dim=63)
    device_pool = make_device_pool(geo, 16)
    for fmt in FORMATS:
        with pytest.raises(NotImplementedError, match="--hicache-host-dtype"):
            make_host_pool(device_pool, host_tokens=16, host_dtype=fmt)


# --- start-up log, NaN policy, bad indices --------------------------------


@pytest.mark.parametrize(
    "fmt,layout,page_size,keys",
    [
        ("int4", "page_first", 64, "keys per channel over 64-token pages"),
        ("int4", "page_first_direct", 16, "keys per channel over 16-token pages"),
        ("int4", "page_first", 1, "keys per token in groups of 64 channels"),
        ("int4", "layer_first", 64, "keys per token in groups of 64 channels"),
        ("k8v4", "page_first", 64, "keys as int8 per token and head"),
    ],
)
def test_startup_log_states_format_and_key_grouping(
    fmt, layout, page_size, keys, caplog
):
    # The sglang logger itself: an earlier in-process server tool may have raised its level.
    with caplog.at_level(logging.INFO, logger="sglang"):
        build(fmt, layout, page_size)
    text = caplog.text
    assert f"stores {fmt.upper()} KV" in text
    assert keys in text
    assert "values per token in groups of 64 channels" in text
    assert "transfer path: torch" in text


# --- the real controller: write -> evict -> load ----------------------------


# --- L3 page I/O --------------------------------------------------------------
