"""The encoded host pools' modules import one way: no import circle among the
overlay's modules (module-level or deferred imports alike), and the registry
the argument parser reads loads none of the pools, transfers, page codecs or
codecs (checked in a fresh interpreter)."""

from __future__ import annotations

import ast

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
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
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


def test_the_registry_imports_without_the_pools():
    probe = run_fresh(
        "import json, sys\n"
        "from sglang.srt.mem_cache.pool_host import host_format\n"
        "from sglang.srt.arg_groups import hicache_hook\n"
        "choices = host_format.host_dtype_choices()\n"
        "print(json.dumps({'choices': choices, 'modules': sorted(sys.modules)}))\n"
    )
    assert probe["choices"][:2] == ["auto", "int8"]
    loaded = [m for m in probe["modules"] if m.startswith(POOL_MODULES)]
    assert loaded == []
