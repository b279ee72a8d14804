"""L3 storage through the live server, across a restart.

One storage folder (SGLang's ``file`` backend), three servers in turn, each
stopped before the next starts:

1. INT8 host pool: prompt A cold; its full pages are written to storage.
2. A fresh INT8 server (empty device and host tiers): A is served from
   storage (prefetched, cached tokens from storage), and the greedy tokens
   equal server 1's.
3. A BF16 (stock pool) server on the same folder: its keys carry another
   host format, so A misses storage and is computed from scratch, with
   server 1's greedy tokens and logprobs (no foreign page was decoded).

Mooncake with a real ``mooncake_master`` runs the same three steps when
HIQ_LIVE_L3_MOONCAKE=1 (three more server starts). It fails today, and not in
our code: Mooncake keeps objects in the segments its clients contribute, and
here the only client is the writing server, so its 43 pages (15.23 MB in the
master's log) vanish when it stops. Serving across a restart needs a segment
owner that outlives the servers (a standalone ``mooncake_client`` with
``standalone_storage``), which this test does not start yet.
Set HIQ_LIVE_SERVER=0 to skip everything here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.support.model import smollm2_dir, stdlib_prompts
from tests.support.server import LOG_ROOT, CPU_FLAGS, LiveServer, hicache_flags

pytestmark = pytest.mark.skipif(
    os.environ.get("HIQ_LIVE_SERVER") == "0", reason="HIQ_LIVE_SERVER=0"
)

PAGE = 64
PROMPT_TOKENS = 1400
STORED = PROMPT_TOKENS // PAGE * PAGE  # storage keeps whole pages only
NEW_TOKENS = 6
BACKUP_WAIT_S = 300.0


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def l3_server(name, host_dtype, backend, extra_config, log_dir) -> LiveServer:
    flags = hicache_flags(
        host_dtype,
        # A layout both backends take (Mooncake refuses layer_first), and the
        # io backend SGLang pairs with it.
        layout="page_first_direct",
        io_backend="direct",
        storage_backend=backend,
        extra=[
            "--page-size",
            str(PAGE),
            "--hicache-storage-backend-extra-config",
            json.dumps(extra_config),
            # Wait for the whole prefetch, so the hit count does not race it.
            "--hicache-storage-prefetch-policy",
            "wait_complete",
        ],
    )
    return LiveServer(
        [*CPU_FLAGS, *flags], name=name, log_dir=log_dir, progress=progress
    )


def generate(server: LiveServer, ids) -> dict:
    return server.generate(
        input_ids=ids, max_new_tokens=NEW_TOKENS, return_logprob=True
    )


def wait_backed_up(server: LiveServer, tokens: int) -> float:
    """Wait until the storage backup counter reaches tokens (it runs on a
    background thread after the request returns)."""
    deadline = time.monotonic() + BACKUP_WAIT_S
    while True:
        done = server.metrics().value("sglang:backuped_tokens_total")
        if done >= tokens or time.monotonic() > deadline:
            return done
        time.sleep(2)


def run_restart(backend: str, extra_config: dict, log_dir: Path) -> dict:
    prompt = stdlib_prompts(smollm2_dir(), 1, PROMPT_TOKENS)[0]
    out = {}
    with l3_server("l3-int8-writer", "int8", backend, extra_config, log_dir) as s:
        out["write"] = generate(s, prompt)
        out["backed_up"] = wait_backed_up(s, STORED)
        out["writer_log"] = s.log_text()
    with l3_server("l3-int8-reader", "int8", backend, extra_config, log_dir) as s:
        out["read"] = generate(s, prompt)
        out["read_metrics"] = s.metrics()
    with l3_server("l3-bf16-other", None, backend, extra_config, log_dir) as s:
        out["other"] = generate(s, prompt)
        out["other_metrics"] = s.metrics()
    return out


def fresh_dir(name: str) -> Path:
    # build/, not pytest's tmp: concurrent pytest runs prune old basetemps.
    root = LOG_ROOT / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


@pytest.fixture(scope="module")
def file_store():
    root = fresh_dir("l3-file")
    store = root / "store"
    result = run_restart("file", {"file_storage_path": str(store)}, root)
    result["store"] = store
    return result


def storage_tokens(reply: dict) -> int:
    return (reply["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)


def output_logprobs(reply: dict) -> list[float]:
    return [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]


def check_restart(result: dict) -> None:
    assert result["write"]["meta_info"]["cached_tokens"] == 0
    assert result["backed_up"] >= STORED, "the writer never backed A up to storage"
    read = result["read"]
    assert storage_tokens(read) == STORED, read["meta_info"]
    assert read["meta_info"]["cached_tokens"] == STORED
    assert result["read_metrics"].value("sglang:prefetched_tokens_total") >= STORED
    assert read["output_ids"] == result["write"]["output_ids"]

    other = result["other"]
    assert storage_tokens(other) == 0, other["meta_info"]
    assert other["meta_info"]["cached_tokens"] == 0
    assert result["other_metrics"].value("sglang:prefetched_tokens_total") == 0
    # Computed from scratch like the writer's cold pass: the same numbers.
    assert other["output_ids"] == result["write"]["output_ids"]
    assert output_logprobs(other) == output_logprobs(result["write"])


def test_file_store_serves_int8_pages_after_restart_and_not_to_bf16(file_store):
    check_restart(file_store)


def test_file_store_keys_name_the_host_format(file_store):
    names = [p.name for p in file_store["store"].rglob("*") if p.is_file()]
    assert names, "nothing was written to the file store"
    tagged = [n for n in names if "int8" in n]
    assert len(tagged) >= STORED // PAGE, names[:5]


@pytest.mark.skipif(
    os.environ.get("HIQ_LIVE_L3_MOONCAKE") != "1", reason="HIQ_LIVE_L3_MOONCAKE=1"
)
def test_mooncake_store_serves_int8_pages_after_restart_and_not_to_bf16():
    from tests.support.l3_harness import MooncakeMaster, require_mooncake

    require_mooncake()
    root = fresh_dir("l3-mooncake")
    master = MooncakeMaster(log_path=root / "mooncake_master.log").start()
    try:
        config = master.storage_config()
        check_restart(run_restart("mooncake", config, root))
    finally:
        master.stop()
