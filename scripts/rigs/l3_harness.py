"""L3 (storage) rigs on CPU: a real HiCacheController with its storage threads,
attached to SGLang's `file` backend or to SGLang's MooncakeStore talking to a
real `mooncake_master` this module starts on 127.0.0.1.

Drives the controller the way UnifiedRadixCache does: write-through to L2,
write_storage() to L3 (backup thread), then prefetch() (query thread) ->
host allocation -> prefetch_buffer (I/O thread) -> load back to L1.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty

import pytest
import torch

from scripts.rigs.hicache_harness import (
    Geometry,
    HiCacheRig,
    MLAGeometry,
    finish_transfers,
    make_rig,
    publish_server_args,
)
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.utils import get_storage_hash_str
from scripts.rigs.server_process import die_with_parent

# Every wait on a storage thread is bounded, so a fault can only fail a test.
STORAGE_WAIT_S = 20.0
MODEL_NAME = "hiq/tiny-test-model"


def publish_runtime(page_size: int, layout: str, host_dtype: str) -> None:
    """Publish the config namespaces attach_storage_backend reads (parallel)."""
    publish_server_args(host_dtype, page_size=page_size, layout=layout)
    # A single-rank process: the ranks the process groups would stamp.
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_dcp_rank=0
    )


# ---------------------------------------------------------------------------
# mooncake_master


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mooncake_unavailable_reason() -> str | None:
    """Why the Mooncake store cannot run here, or None if it can."""
    try:
        import mooncake
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:  # ImportError, or a missing libibverbs/libnuma
        return (
            f"mooncake.store does not import ({type(e).__name__}: {e}); install "
            "requirements/l3-mooncake.txt and apt-get install libibverbs1 "
            "librdmacm1 libnuma1"
        )
    binary = Path(mooncake.__file__).parent / "mooncake_master"
    if not binary.is_file():
        return f"{binary} is missing from the mooncake wheel"
    return None


def require_mooncake() -> None:
    """Skip with the reason when Mooncake cannot run; under CI=true, fail."""
    reason = mooncake_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI must run the Mooncake tests: {reason}")
    pytest.skip(reason)


def terminate(process: subprocess.Popen | None) -> None:
    """Stops a helper process by its own pid (never by name), killing it if
    SIGTERM does not end it within 10 s."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@dataclass
class MooncakeMaster:
    """A mooncake_master process with its built-in HTTP metadata server."""

    log_path: Path
    extra_args: tuple[str, ...] = ()
    metadata_port: int = field(default_factory=_free_port)
    rpc_port: int = field(default_factory=_free_port)
    metrics_port: int = field(default_factory=_free_port)
    process: subprocess.Popen | None = None

    def start(self) -> MooncakeMaster:
        import mooncake

        binary = Path(mooncake.__file__).parent / "mooncake_master"
        # pip install --target can drop the run bit.
        if not os.access(binary, os.X_OK):
            binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [
                str(binary),
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}",
                f"--rpc_port={self.rpc_port}",
                f"--metrics_port={self.metrics_port}",
                *self.extra_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + STORAGE_WAIT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited with {self.process.returncode}; "
                    f"log: {self.log_path.read_text()[-2000:]}"
                )
            try:
                self.metrics()
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("mooncake_master did not come up")

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        terminate(self.process)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus gauges and counters (unlabelled ones)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=3).read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("#") or "{" in line or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            try:
                values[name] = float(value)
            except ValueError:
                pass
        return values

    def storage_config(self, segment_bytes: int = 64 << 20) -> dict:
        """extra_config for SGLang's MooncakeStore (TCP, no etcd)."""
        return {
            "master_server_address": f"127.0.0.1:{self.rpc_port}",
            "metadata_server": f"http://127.0.0.1:{self.metadata_port}/metadata",
            "global_segment_size": segment_bytes,
            "protocol": "tcp",
            "device_name": "",
            "local_hostname": "127.0.0.1",
            "check_server": False,
            "standalone_storage": False,
        }


# ---------------------------------------------------------------------------
# the controller's storage path


@dataclass
class L3Rig:
    rig: HiCacheRig
    geo: Geometry | MLAGeometry

    @property
    def controller(self):
        return self.rig.controller

    @property
    def backend(self):
        return self.rig.controller.storage_backend

    def close(self) -> None:
        ctl = self.controller
        if ctl.enable_storage:
            ctl.detach_storage_backend()


def make_l3_rig(
    backend: str,
    extra_config: dict,
    *,
    host_dtype: str = "int8",
    geo: Geometry | MLAGeometry | None = None,
    layout: str = "page_first_direct",
    device_tokens: int = 256,
    host_tokens: int = 512,
    model_name: str = MODEL_NAME,
    **host_extra,
) -> L3Rig:
    """host_extra: host pool keywords (e.g. an encoded pool's key8_layers)."""
    geo = geo or Geometry(layer_num=3, head_num=2, head_dim=16, page_size=4)
    publish_runtime(geo.page_size, layout, host_dtype)
    rig = make_rig(
        geo,
        device_tokens=device_tokens,
        host_tokens=host_tokens,
        layout=layout,
        host_dtype=host_dtype,
        **host_extra,
    )
    rig.controller.attach_storage_backend(
        backend,
        prefetch_threshold=geo.page_size,
        model_name=model_name,
        storage_backend_extra_config=dict(extra_config),
    )
    return L3Rig(rig, geo)


def device_rows(rig: HiCacheRig, indices: torch.Tensor) -> list[torch.Tensor]:
    """K then V rows (MLA: latent rows) of every layer at device `indices`
    (copies)."""
    pool = rig.device_pool
    if isinstance(pool, MLATokenToKVPool):
        return [pool.kv_buffer[i][indices].clone() for i in range(pool.layer_num)]
    return [pool.k_buffer[i][indices].clone() for i in range(pool.layer_num)] + [
        pool.v_buffer[i][indices].clone() for i in range(pool.layer_num)
    ]


def write_through(l3: L3Rig, tokens: list[int], seed: int = 0, edit=None, **write):
    """New KV for `tokens` on the device -> L2 -> L3 (edit(device_pool, dev)
    may change it first; `write`: HiCacheController.write keywords). Returns
    (device indices, host indices, page hashes, number of pages L3 accepted)."""
    from scripts.rigs.hicache_harness import fill_random

    ctl, rig = l3.controller, l3.rig
    dev = rig.allocator.alloc(len(tokens))
    fill_random(rig.device_pool, dev, seed=seed)
    if edit is not None:
        edit(rig.device_pool, dev)
    host = ctl.write(dev, node_id=0, **write)
    assert host is not None, "host pool full"
    ctl.start_writing()
    finish_transfers(ctl)
    hashes = get_storage_hash_str(tokens, None, page_size=l3.geo.page_size)
    op_id = ctl.write_storage(host, tokens, hash_value=hashes)
    op = ctl.ack_backup_queue.get(timeout=STORAGE_WAIT_S)
    assert op.id == op_id
    return dev, host, hashes, op.completed_tokens // l3.geo.page_size


def evict_everywhere(l3: L3Rig, dev: torch.Tensor, host: torch.Tensor) -> None:
    """Drop the KV from L1 and L2, poisoning the freed rows so stale bytes
    cannot pass for restored ones."""
    pool = l3.rig.device_pool
    buffers = (
        [pool.kv_buffer]
        if isinstance(pool, MLATokenToKVPool)
        else [pool.k_buffer, pool.v_buffer]
    )
    for layer in range(pool.layer_num):
        for buffer in buffers:
            buffer[layer][dev] = float("nan")
    l3.rig.allocator.free(dev)
    l3.controller.mem_pool_host.free(host)


@dataclass
class Prefetch:
    hit_tokens: int  # what the hit query found in L3
    completed_tokens: int  # what the I/O thread delivered into L2
    host_indices: torch.Tensor | None


def prefetch_to_host(
    l3: L3Rig,
    tokens: list[int],
    request_id: str = "r",
    before_io=None,
    *,
    stop_on_miss: bool = True,
    last_hash: str | None = None,
) -> tuple[int, int, torch.Tensor | None]:
    """L3 -> L2 through the controller's query and I/O threads, as
    UnifiedRadixCache drives them; before_io() runs between the hit query and
    the reads (to fault the store there). Returns (tokens hit, tokens
    delivered, the whole host allocation: the caller frees it); a miss stops
    after the query unless stop_on_miss is False."""
    ctl = l3.controller
    op = ctl.prefetch(request_id, tokens, last_hash)
    queried = ctl.prefetch_hit_queue.get(timeout=STORAGE_WAIT_S)
    assert queried is op
    hit = op.storage_hit_count
    if hit == 0 and stop_on_miss:
        return 0, 0, None
    host = ctl.mem_pool_host.alloc(hit)
    assert host is not None, "host pool full"
    op.host_indices = host
    op.hash_value = op.hash_value[: hit // l3.geo.page_size]
    if before_io is not None:
        before_io()
    ctl.prefetch_buffer.put(op)
    completed = 0
    deadline = time.monotonic() + STORAGE_WAIT_S
    while True:
        try:
            ack = ctl.ack_prefetch_queue.get(
                timeout=max(0.0, deadline - time.monotonic())
            )
        except Empty:
            raise AssertionError("prefetch did not complete in time") from None
        if ack.completed_tokens is not None:
            completed = ack.completed_tokens
        if ack.completed_req:
            return hit, completed, host


def prefetch(
    l3: L3Rig,
    tokens: list[int],
    request_id: str = "r",
    before_io=None,
    last_hash: str | None = None,
) -> Prefetch:
    """prefetch_to_host, keeping what the cache keeps: only the delivered
    prefix enters it, the rest of the host allocation goes back; last_hash:
    the page hash the tokens follow (None: they start the sequence)."""
    hit, completed, host = prefetch_to_host(
        l3, tokens, request_id, before_io, last_hash=last_hash
    )
    if hit == 0:
        return Prefetch(0, 0, None)
    if completed < hit:
        l3.controller.mem_pool_host.free(host[completed:])
    return Prefetch(hit, completed, host[:completed])


def load_to_device(l3: L3Rig, host: torch.Tensor) -> torch.Tensor:
    """L2 -> L1 through the controller's load path; returns device indices."""
    ctl = l3.controller
    dev = ctl.load(host, node_id=0)
    assert dev is not None, "device pool full"
    ctl.start_loading()
    finish_transfers(ctl)
    return dev


def wait_for(condition, what: str, timeout_s: float = STORAGE_WAIT_S) -> None:
    """Poll until `condition()` (storage threads run asynchronously); bounded,
    so a fault fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not finish in time")
        time.sleep(0.02)


def radix_prefetch(
    cache, match, ids: list[int], rid: str = "r0", **wait
) -> tuple[int, int]:
    """Prefetch `ids` past a radix match from L3 and wait for it: the loaded span."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

    handle = CacheRequestHandle(rid, 0)
    cache.prefetch_from_storage(
        handle,
        match.last_host_node,
        array("q", ids),
        cache.get_last_hash_value(match.last_host_node),
        None,
        matched_prefix_tokens=array("q"),
    )

    def prefetched():
        cache.check_hicache_events()
        return cache.check_prefetch_progress(handle)

    wait_for(prefetched, "the L3 prefetch", **wait)
    return cache.pop_prefetch_loaded_span(handle)


def file_storage_config(path: Path) -> dict:
    return {"file_storage_path": str(path)}


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
