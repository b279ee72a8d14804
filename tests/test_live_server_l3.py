"""L3 storage through the live server across restarts, one store, three
servers in turn: an INT8 writer (prompt A's full pages stored), a fresh INT8
reader (A served from storage, counted in the reply and /metrics, the
writer's greedy tokens) and a server of another format (BF16 for ``file``,
INT4 for Mooncake) whose keys miss A: computed from scratch, same tokens and
logprobs. ``file`` runs by default; HIQ_LIVE_L3_MOONCAKE=1 runs Mooncake too
(a real master; a standalone ``mooncake_client`` mounts the only segment, so
pages outlive the servers, which mount none). HIQ_LIVE_SERVER=0 skips.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from scripts.rigs.l3_harness import terminate
from scripts.rigs.model import smollm2_dir, stdlib_prompts
from scripts.rigs.server import (
    CPU_FLAGS,
    LIVE_ONLY,
    LiveServer,
    fresh_dir,
    free_port,
    hicache_flags,
    output_logprobs,
    to_stderr,
)

pytestmark = LIVE_ONLY

PAGE = 64
PROMPT_TOKENS = 1400
STORED = PROMPT_TOKENS // PAGE * PAGE  # storage keeps whole pages only
NEW_TOKENS = 6
BACKUP_WAIT_S = 300.0


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
        [*CPU_FLAGS, *flags], name=name, log_dir=log_dir, progress=to_stderr
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


def run_restart(
    backend: str, extra_config: dict, log_dir: Path, other_dtype: str | None = None
) -> dict:
    prompt = stdlib_prompts(smollm2_dir(), 1, PROMPT_TOKENS)[0]
    out = {}
    with l3_server("l3-int8-writer", "int8", backend, extra_config, log_dir) as s:
        out["write"] = generate(s, prompt)
        out["backed_up"] = wait_backed_up(s, STORED)
        out["writer_log"] = s.log_text()
    with l3_server("l3-int8-reader", "int8", backend, extra_config, log_dir) as s:
        out["read"] = generate(s, prompt)
        out["read_metrics"] = s.metrics()
    other = f"l3-{other_dtype or 'bf16'}-other"
    with l3_server(other, other_dtype, backend, extra_config, log_dir) as s:
        out["other"] = generate(s, prompt)
        out["other_metrics"] = s.metrics()
        out["other_log"] = s.log_text()
    return out


@pytest.fixture(scope="module")
def file_store():
    root = fresh_dir("l3-file")
    store = root / "store"
    result = run_restart("file", {"file_storage_path": str(store)}, root)
    result["store"] = store
    return result


def storage_tokens(reply: dict) -> int:
    return (reply["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)


def check_restart(result: dict) -> None:
    assert result["write"]["meta_info"]["cached_tokens"] == 0
    assert result["backed_up"] >= STORED, "the writer never backed A up to storage"
    read = result["read"]
    assert storage_tokens(read) == STORED, read["meta_info"]
    assert read["meta_info"]["cached_tokens"] == STORED
    read_metrics = result["read_metrics"]
    assert read_metrics.value("sglang:prefetched_tokens_total") >= STORED
    counted = read_metrics.value("sglang:cached_tokens_total", cache_source="storage")
    assert counted == STORED
    assert read["output_ids"] == result["write"]["output_ids"]

    other = result["other"]
    assert storage_tokens(other) == 0, other["meta_info"]
    assert other["meta_info"]["cached_tokens"] == 0
    assert result["other_metrics"].value("sglang:prefetched_tokens_total") == 0
    counted = result["other_metrics"].value(
        "sglang:cached_tokens_total", cache_source="storage"
    )
    assert counted == 0
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


class SegmentOwner:
    """The wheel's ``mooncake_client`` (a standalone real client) mounting one
    segment, so stored pages outlive the servers that wrote them."""

    def __init__(self, master, log_path: Path, segment_bytes: int = 256 << 20):
        self.master = master
        self.log_path = log_path
        self.segment_bytes = segment_bytes
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def start(self) -> "SegmentOwner":
        import mooncake

        binary = Path(mooncake.__file__).parent / "mooncake_client"
        config = self.master.storage_config()
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [
                str(binary),
                f"--master_server_address={config['master_server_address']}",
                f"--metadata_server={config['metadata_server']}",
                f"--global_segment_size={self.segment_bytes}",
                "--protocol=tcp",
                "--host=127.0.0.1",
                f"--port={self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        # Mounted once the master counts a segment of our size.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"mooncake_client exited with {self.process.returncode}: "
                    f"{self.log_path.read_text()[-2000:]}"
                )
            if self.master.metrics().get("master_total_capacity_bytes", 0) > 0:
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mooncake_client mounted no segment: {self.log_path}")

    def stop(self) -> None:
        terminate(self.process)


@pytest.fixture(scope="module")
def mooncake_store():
    from scripts.rigs.l3_harness import MooncakeMaster, require_mooncake

    require_mooncake()
    root = fresh_dir("l3-mooncake")
    master = MooncakeMaster(log_path=root / "mooncake_master.log").start()
    owner = None
    try:
        owner = SegmentOwner(master, root / "mooncake_client.log").start()
        # The servers mount nothing: every page lands in the owner's segment.
        config = {**master.storage_config(), "global_segment_size": 0}
        result = run_restart("mooncake", config, root, other_dtype="int4")
        result["master_metrics"] = master.metrics()
        return result
    finally:
        if owner is not None:
            owner.stop()
        master.stop()


@pytest.mark.skipif(
    os.environ.get("HIQ_LIVE_L3_MOONCAKE") != "1", reason="HIQ_LIVE_L3_MOONCAKE=1"
)
def test_mooncake_store_serves_int8_pages_after_restart_and_not_to_int4(
    mooncake_store,
):
    check_restart(mooncake_store)
    # The two formats key their pages under different prefixes.
    prefix = re.compile(r"Using Mooncake config prefix: (\S+)")
    writer = prefix.search(mooncake_store["writer_log"])[1]
    other = prefix.search(mooncake_store["other_log"])[1]
    assert "int8" in writer and "int4" in other and writer != other
    assert mooncake_store["master_metrics"]["master_key_count"] > 0
