"""Start-up probe of one exported PR's tree on CPU (test_pr_bisect.py): each declared
SGLANG_HICACHE_* variable (the arguments) imports nothing a later PR ships, and each
accepted --hicache-host-dtype gets its pool from the dispatch. Usage: see the test."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from scripts.rigs.standins import install_sglang_standins, install_torchvision_stub

install_torchvision_stub()
install_sglang_standins()

from tests.support import server_args as sa  # noqa: E402

# Values that turn each variable on: a fraction, a host-token count (1, at
# page size 1), a transfer path (off).
VALUES = ("1", "off")
MODELS = {
    "mha": sa.LLAMA,
    "mla": dict(sa.DEEPSEEK_V2_MLA, kv_lora_rank=512, qk_rope_head_dim=64),
}


def start(model_path: str, host_dtype: str, env: dict) -> BaseException | None:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        sa.resolve(model_path, hicache_host_dtype=host_dtype)
    except Exception as error:  # refusals are ValueError; the caller judges
        return error
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return None


def main(variables: list[str]) -> int:
    from sglang.srt.mem_cache.pool_host.host_format import (
        host_dtype_choices,
        host_pool_cls,
    )

    failures = []
    root = Path(tempfile.mkdtemp(prefix="pr-probe-"))
    accepted = {kind: [] for kind in MODELS}
    for kind, config in MODELS.items():
        path = sa.model_dir(root, kind, config)
        for host_dtype in host_dtype_choices():
            if start(path, host_dtype, {}) is None:
                accepted[kind].append(host_dtype)
            for name in variables:
                for value in VALUES:
                    error = start(path, host_dtype, {name: value})
                    if isinstance(error, ImportError):
                        failures.append(
                            f"{kind} --hicache-host-dtype {host_dtype} with "
                            f"{name}={value}: {type(error).__name__}: {error}"
                        )
    failures += dispatch_failures(accepted, host_pool_cls)
    for failure in failures:
        print(failure)
    print(f"probed {len(variables)} variables; accepted {accepted}")
    return 1 if failures else 0


def dispatch_failures(accepted: dict, host_pool_cls) -> list[str]:
    """Accepted encoded values whose dispatch does not build their pool."""
    import torch

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host import mha, mla

    device_pool = MHATokenToKVPool(
        size=16, page_size=1, dtype=torch.bfloat16, layer_num=1, device="cpu",
        enable_memory_saver=False, head_num=1, head_dim=8, v_head_dim=8,
        enable_alt_stream=False,
    )  # fmt: skip
    info = device_pool.get_device_pool_infos()[0].buffer_info
    dispatch = {
        "mha": lambda d: mha.get_mha_host_pool_cls(info, host_dtype=d),
        "mla": lambda d: mla.get_mla_host_pool_cls(host_dtype=d),
    }
    failures = []
    for kind, host_dtypes in accepted.items():
        for host_dtype in host_dtypes:
            if host_dtype == "auto":
                continue
            try:
                built = dispatch[kind](host_dtype)
            except (AttributeError, TypeError) as error:  # no dispatch on it
                built = error
            try:
                pool_cls = host_pool_cls(host_dtype, kind)
            except NotImplementedError as error:  # its pool is not in the build
                pool_cls = error
            if built is not pool_cls:
                failures.append(
                    f"{kind} --hicache-host-dtype {host_dtype} is accepted at "
                    f"start-up, but the dispatch gives {built!r} (its pool: "
                    f"{pool_cls!r})"
                )
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
