"""The host (L2) formats every CPU tool measures: the stock pool and the registry's."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from scripts.common.cpu_sglang import install_cpu_standins

# Table order where known (capacity order: bf16, int8, k8v4, int4); formats the
# tools don't know yet follow in the parser's order.
PREFERRED_ORDER = ("auto", "int8", "k8v4", "int4")


@dataclass(frozen=True)
class HostFormat:
    label: str  # what tables print: the stock pool is labelled by its dtype
    host_dtype: str  # the --hicache-host-dtype value

    @property
    def stock(self) -> bool:
        return self.host_dtype == "auto"


def registered_host_dtypes() -> list[str]:
    """`auto` and every format of the host-format registry."""
    install_cpu_standins()
    from sglang.srt.mem_cache.pool_host.host_format import host_dtype_choices

    return host_dtype_choices()


def host_dtype_choices() -> list[str]:
    """`--hicache-host-dtype`'s choices, from SGLang's own argument parser."""
    install_cpu_standins()
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    action = next(
        a for a in parser._actions if "--hicache-host-dtype" in a.option_strings
    )
    return list(action.choices)


def host_formats(stock_label: str = "bf16") -> list[HostFormat]:
    """The stock pool and every registered host format, stock pool first."""
    choices = registered_host_dtypes()

    def rank(name: str) -> int:
        if name in PREFERRED_ORDER:
            return PREFERRED_ORDER.index(name)
        return len(PREFERRED_ORDER) + choices.index(name)

    return [
        HostFormat(stock_label if name == "auto" else name, name)
        for name in sorted(choices, key=rank)
    ]
