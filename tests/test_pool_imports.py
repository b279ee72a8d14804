"""Our modules import one way: no import circle in the overlay, the registry loads no
pool or codec, the stock pools (--hicache-host-dtype auto) none of our codecs or
kernels (one fresh interpreter), and scripts/ nothing from tests/."""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

from scripts.rigs.standins import REPO_ROOT, run_fresh

OVERLAY = REPO_ROOT / "sglang_overlay" / "python"
# What the registry must not load: the pools and what they are made of.
POOL_MODULES = (
    "sglang.srt.mem_cache.pool_host.encoded",
    "sglang.srt.mem_cache.pool_host.transfer",
    "sglang.srt.mem_cache.pool_host.page_codec",
    "sglang.srt.mem_cache.pool_host.sink_page",
    "sglang.srt.mem_cache.pool_host.mha_encoded",
    "sglang.srt.mem_cache.pool_host.mla_encoded",
    "sglang.srt.mem_cache.pool_host.kv_",
    "sglang.kernels.ops.kvcache.kv_",
    "sglang.kernels.ops.kvcache.host_kv_common",
)
# What the stock pools must not load: every codec, kernel and encoded pool.
OURS = tuple(
    m for m in POOL_MODULES if not m.endswith(("transfer", "page_codec", "sink_page"))
)
# The registry first, then every upstream module the series edits to dispatch
# host pools, then the stock pools built.
PROBE = """
import json, sys
from sglang.srt.mem_cache.pool_host import host_format
from sglang.srt.arg_groups import hicache_hook
choices = host_format.host_dtype_choices()
registry = sorted(sys.modules)
from sglang.srt.mem_cache import hicache_auto_size
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost, get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost, get_mla_host_pool_cls
from scripts.rigs import hicache_harness as hh
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
built = []
for geo in (hh.Geometry(), hh.MLAGeometry(layer_num=2)):
    device_pool = hh.make_device_pool(geo, 64)
    with host_memory_budget_scope(1 << 40):  # a few kB; other processes' use aside
        pool = hh.make_host_pool(device_pool, host_tokens=128, host_dtype="auto")
    built.append(type(pool).__name__)
info = hh.make_device_pool(hh.Geometry(), 16).get_device_pool_infos()[0].buffer_info
assert get_mha_host_pool_cls(info, "auto") is MHATokenToKVPoolHost
print(json.dumps(dict(registry=registry, choices=choices, built=built,
                      modules=sorted(sys.modules))))
"""


@pytest.fixture(scope="module")
def probe():
    return run_fresh(PROBE)


def test_the_registry_imports_without_the_pools(probe):
    assert probe["choices"][:2] == ["auto", "int8"]
    assert [m for m in probe["registry"] if m.startswith(POOL_MODULES)] == []


def test_stock_pools_import_none_of_our_codecs_or_kernels(probe):
    assert probe["built"] == ["MHATokenToKVPoolHost", "MLATokenToKVPoolHost"]
    assert [m for m in probe["modules"] if m.startswith(OURS)] == []
    # The registry itself is what the dispatch reads.
    assert "sglang.srt.mem_cache.pool_host.host_format" in probe["modules"]


def overlay_imports() -> dict[str, set[str]]:
    """Each overlay module -> the overlay modules it imports, anywhere in it."""
    modules = {
        ".".join(path.relative_to(OVERLAY).with_suffix("").parts): path
        for path in OVERLAY.rglob("*.py")
    }
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets.add(node.module)
                # `from package import module` imports the module.
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as the modules along it, or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return error.args[1][::-1]  # the sorter lists predecessors first
    return None


def test_no_import_circle_among_the_overlay_modules():
    graph = overlay_imports()
    pool = "sglang.srt.mem_cache.pool_host.encoded"
    # The pool is built from its collaborators, which never import it back.
    assert {
        "sglang.srt.mem_cache.pool_host.transfer",
        "sglang.srt.mem_cache.pool_host.encoded_fused",
        "sglang.srt.mem_cache.pool_host.page_codec",
        "sglang.srt.mem_cache.pool_host.sink_page",
    } <= graph[pool]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _imports_of_tests(path: Path) -> list[str]:
    """Where a scripts/ file imports tests.*: import statements, code it runs
    in another interpreter (python -c text) and modules it runs with -m."""
    text = path.read_text()
    if path.suffix == ".sh":
        lines = enumerate(text.splitlines(), 1)
        found = r"\b(?:from|import)\s+tests\b"
        return [f"{path}:{i}" for i, line in lines if re.search(found, line)]
    hits = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            code = re.search(r"(?m)^\s*(?:from|import)\s+(tests\b[\w.]*)", node.value)
            module = re.fullmatch(r"tests(\.\w+)+", node.value)
            names = [code.group(1)] if code else [node.value] if module else []
        else:
            continue
        hits += [
            f"{path}:{node.lineno} {n}" for n in names if n.split(".")[0] == "tests"
        ]
    return hits


def test_scripts_import_nothing_from_tests():
    files = sorted(REPO_ROOT.glob("scripts/**/*.py")) + sorted(
        REPO_ROOT.glob("scripts/**/*.sh")
    )
    assert len(files) > 20
    hits = [hit for path in files for hit in _imports_of_tests(path)]
    assert not hits, (
        "scripts/ must not import tests.* (use scripts/rigs):\n" + "\n".join(hits)
    )
