"""L3 through the live server across restarts: an INT8 writer, a fresh INT8 reader
served from storage, a server of another format whose keys miss; `file` always,
Mooncake (a real master) with HIQ_LIVE_L3_MOONCAKE=1. HIQ_LIVE_SERVER=0 skips."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from contextlib import contextmanager
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


def run_restart(backend, extra_config, log_dir, other_dtype=None) -> dict:
    """Writer, reader and other-format server in turn on one store."""
    prompt = stdlib_prompts(smollm2_dir(), 1, PROMPT_TOKENS)[0]
    # A layout both backends take (Mooncake refuses layer_first); wait for the
    # whole prefetch, so the hit count does not race it.
    extra = ["--page-size", str(PAGE), "--hicache-storage-prefetch-policy"]
    extra += ["wait_complete", "--hicache-storage-backend-extra-config"]
    extra += [json.dumps(extra_config)]
    out = {}
    for role, dtype in (("write", "int8"), ("read", "int8"), ("other", other_dtype)):
        flags = hicache_flags(
            dtype,
            layout="page_first_direct",
            io_backend="direct",
            storage_backend=backend,
            extra=extra,
        )
        name = f"l3-{dtype or 'bf16'}-{role}"
        with LiveServer(
            [*CPU_FLAGS, *flags], name=name, log_dir=log_dir, progress=to_stderr
        ) as s:
            out[role] = s.generate(
                input_ids=prompt, max_new_tokens=NEW_TOKENS, return_logprob=True
            )
            # The storage backup runs on a thread after the request returns.
            deadline = time.monotonic() + BACKUP_WAIT_S
            while role == "write" and time.monotonic() < deadline:
                out["backed_up"] = s.metrics().value("sglang:backuped_tokens_total")
                if out["backed_up"] >= STORED:
                    break
                time.sleep(2)
            out[f"{role}_metrics"], out[f"{role}_log"] = s.metrics(), s.log_text()
    return out


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

    other, other_metrics = result["other"], result["other_metrics"]
    assert storage_tokens(other) == 0, other["meta_info"]
    assert other["meta_info"]["cached_tokens"] == 0
    assert other_metrics.value("sglang:prefetched_tokens_total") == 0
    counted = other_metrics.value("sglang:cached_tokens_total", cache_source="storage")
    assert counted == 0
    # Computed from scratch like the writer's cold pass: the same numbers.
    assert other["output_ids"] == result["write"]["output_ids"]
    assert output_logprobs(other) == output_logprobs(result["write"])


def test_file_store_serves_int8_pages_after_restart_and_not_to_bf16():
    root = fresh_dir("l3-file")
    store = root / "store"
    check_restart(run_restart("file", {"file_storage_path": str(store)}, root))
    # The keys name the host format.
    names = [p.name for p in store.rglob("*") if p.is_file()]
    assert names, "nothing was written to the file store"
    tagged = [n for n in names if "int8" in n]
    assert len(tagged) >= STORED // PAGE, names[:5]


@contextmanager
def segment_owner(master, log_path: Path, segment_bytes: int = 256 << 20):
    """The wheel's standalone ``mooncake_client`` mounting the only segment, so
    stored pages outlive the servers that wrote them."""
    import mooncake

    config = master.storage_config()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [
                str(Path(mooncake.__file__).parent / "mooncake_client"),
                f"--master_server_address={config['master_server_address']}",
                f"--metadata_server={config['metadata_server']}",
                f"--global_segment_size={segment_bytes}",
                "--protocol=tcp",
                "--host=127.0.0.1",
                f"--port={free_port()}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        # Mounted once the master counts a segment.
        deadline = time.monotonic() + 30
        while not master.metrics().get("master_total_capacity_bytes", 0):
            if process.poll() is not None:
                raise RuntimeError(
                    f"mooncake_client exited with {process.returncode}: "
                    f"{log_path.read_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_client mounted no segment: {log_path}")
            time.sleep(0.5)
        yield
    finally:
        terminate(process)


@pytest.mark.skipif(
    os.environ.get("HIQ_LIVE_L3_MOONCAKE") != "1", reason="HIQ_LIVE_L3_MOONCAKE=1"
)
def test_mooncake_store_serves_int8_pages_after_restart_and_not_to_int4():
    from scripts.rigs.l3_harness import MooncakeMaster, require_mooncake

    require_mooncake()
    root = fresh_dir("l3-mooncake")
    master = MooncakeMaster(log_path=root / "mooncake_master.log").start()
    try:
        with segment_owner(master, root / "mooncake_client.log"):
            # The servers mount nothing: every page lands in the owner's segment.
            config = {**master.storage_config(), "global_segment_size": 0}
            result = run_restart("mooncake", config, root, other_dtype="int4")
            key_count = master.metrics()["master_key_count"]
    finally:
        master.stop()
    check_restart(result)
    # The two formats key their pages under different prefixes.
    prefix = re.compile(r"Using Mooncake config prefix: (\S+)")
    writer = prefix.search(result["write_log"])[1]
    other = prefix.search(result["other_log"])[1]
    assert "int8" in writer and "int4" in other and writer != other
    assert key_count > 0
