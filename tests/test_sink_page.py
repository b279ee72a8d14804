"""The attention-sink page (issue 22 item 2): inside the 4-bit-key host formats the keys
of the page holding a sequence's token 0 are kept at 8 bits (pool_host/sink_page.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from scripts.rigs.hicache_harness import (
    Geometry,
    fill_random,
    finish_transfers,
    make_device_pool,
    make_host_pool,
    make_rig,
    mha_radix_cache,
    publish_server_args,
)
from sglang.srt.mem_cache.pool_host.kv_int8_codec import Int8HostFormat
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.mem_cache.pool_host.sink_page import L3_KEY_SUFFIX, SINK_ENV
from tests.support.conformance import (
    LAYOUTS,
    bits,
    host_unit_records,
    host_units,
    reference,
)

# The 4-bit-key formats, all with fused kernels.
FORMATS = ("int4", "int4r", "int4c")
PAGE = 16


def build(fmt, layout="page_first", sink_tokens=4 * PAGE, host_pages=16, **kw):
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=PAGE)
    return make_rig(
        geo,
        device_tokens=16 * PAGE,
        host_tokens=host_pages * PAGE,
        layout=layout,
        host_dtype=fmt,
        sink_page_tokens=sink_tokens,
        **kw,
    )


def backup(rig, tokens, seed, sink):
    dev = rig.allocator.alloc(tokens)
    written = fill_random(rig.device_pool, dev, seed)
    host = rig.controller.write(dev, first_page_is_sink=sink)
    assert host is not None
    finish_transfers(rig.controller)
    for layer in range(rig.device_pool.layer_num):
        rig.device_pool.k_buffer[layer][dev] = 0
        rig.device_pool.v_buffer[layer][dev] = 0
    rig.allocator.free(dev)
    return host, written


def restore(rig, host):
    dev = rig.controller.load(host)
    rig.controller.start_loading()
    finish_transfers(rig.controller)
    return [
        (rig.device_pool.k_buffer[layer][dev], rig.device_pool.v_buffer[layer][dev])
        for layer in range(rig.device_pool.layer_num)
    ]


def assert_same(got, want):
    assert torch.equal(bits(got), bits(want))


def expect(pool, written, sink_tokens):
    """Per layer: the reference restore of `written`, the first `sink_tokens` keys the
    int8 codec's."""
    fmt = pool.host_format
    int8 = Int8HostFormat(fmt.dims, fmt.head_num, PAGE, fmt.device_dtype)
    out = []
    for k, v in written:
        _, (k4, v4) = reference(pool, [k, v])
        if sink_tokens:
            rows = [x[:sink_tokens].view(-1, PAGE, *x.shape[1:]) for x in (k, v)]
            k8, _ = int8.decode_reference(int8.encode_reference(rows), k.dtype)
            k4[:sink_tokens] = k8.flatten(0, 1)
        out.append((k4, v4))
    return out


def assert_restores(rig, host, written, sink_tokens):
    want = expect(rig.host_pool, written, sink_tokens)
    for (k, v), (want_k, want_v) in zip(restore(rig, host), want):
        assert_same(k, want_k)
        assert_same(v, want_v)


def l2_counts(pool) -> dict:
    """sink_page_counts() without its L3 part."""
    counts = pool.sink_page_counts()
    return {k: v for k, v in counts.items() if k != "l3"}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_sink_page_keys_restore_at_8_bits_the_rest_at_4(fmt, layout):
    rig = build(fmt, layout)
    pool = rig.host_pool
    host, written = backup(rig, 3 * PAGE, seed=1, sink=True)
    other_host, other_written = backup(rig, 2 * PAGE, seed=2, sink=False)
    assert l2_counts(pool) == {"stored": 1, "slots": 4, "kept_4bit": 0}
    assert_restores(rig, host, written, PAGE)
    assert_restores(rig, other_host, other_written, 0)
    # The 4-bit records (L3's page bytes) hold the sink page too.
    for layer, (k, v) in enumerate(written):
        records, _ = reference(pool, [k, v])
        stored = host_unit_records(pool, layer, host_units(pool, host))
        for name, want in records.items():
            assert torch.equal(stored[name].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("access", ("direct", "staged"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_path_moves_the_sink_page_keys_on_the_torch_path(fmt, access):
    """The pool's fused 4-bit kernels, then the side store's keys on the torch path,
    give the reference's bits (Triton interpreter)."""
    rig = build(fmt, fused_transfer=access)
    pool = rig.host_pool
    host, written = backup(rig, 2 * PAGE, seed=11, sink=True)
    assert pool.transfer_path == f"fused_{access}"
    assert pool.sink_pages.transfer.path == "torch"
    assert_restores(rig, host, written, PAGE)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_load_mixing_sink_and_other_pages_splits_them(fmt):
    """One load over two sequences' pages, sink pages in the middle."""
    rig = build(fmt)
    host_a, rows_a = backup(rig, 2 * PAGE, seed=3, sink=True)
    host_b, rows_b = backup(rig, 2 * PAGE, seed=4, sink=True)
    host = torch.cat([host_a[PAGE:], host_b, host_a[:PAGE]])
    restored = restore(rig, host)
    want_a = expect(rig.host_pool, rows_a, PAGE)
    want_b = expect(rig.host_pool, rows_b, PAGE)
    for layer, (k, v) in enumerate(restored):
        a, b = want_a[layer], want_b[layer]
        assert_same(k, torch.cat([a[0][PAGE:], b[0], a[0][:PAGE]]))
        assert_same(v, torch.cat([a[1][PAGE:], b[1], a[1][:PAGE]]))


def test_sink_off_keeps_every_page_4_bit_and_the_pools_bytes(monkeypatch):
    monkeypatch.delenv(SINK_ENV, raising=False)
    rig = build("int4", sink_tokens=None)
    plain = build("int4", sink_tokens=0).host_pool
    pool = rig.host_pool
    assert pool.sink_pages is None and pool.sink_page_counts() is None
    assert pool.size_per_token == plain.size_per_token
    assert pool.size_per_token == allocated_bytes(pool) / pool.size
    host, written = backup(rig, 2 * PAGE, seed=5, sink=True)
    assert_restores(rig, host, written, 0)


@pytest.mark.parametrize("value", ["abc", "-64"])
def test_pool_refuses_a_malformed_env_value(monkeypatch, value):
    # Envs' reader turned "abc" into 0 (off) with a Python warning.
    monkeypatch.setenv(SINK_ENV, value)
    with pytest.raises(ValueError, match=f"{SINK_ENV}='{value}' is not a number"):
        build("int4", sink_tokens=None)


def test_full_store_keeps_the_page_4_bit_and_counts_it():
    rig = build("int4", sink_tokens=16 * PAGE)
    pool = rig.host_pool
    host_a, rows_a = backup(rig, 2 * PAGE, seed=6, sink=True)
    host_b, rows_b = backup(rig, 2 * PAGE, seed=7, sink=True)
    assert l2_counts(pool) == {"stored": 1, "slots": 1, "kept_4bit": 1}
    for host, rows, sink in ((host_a, rows_a, PAGE), (host_b, rows_b, 0)):
        assert_restores(rig, host, rows, sink)
    # Freeing the first sequence's pages returns its slot; the next first page takes it.
    rig.controller.evict_host(host_a)
    assert pool.sink_page_counts()["stored"] == 0
    host_c, rows_c = backup(rig, 2 * PAGE, seed=8, sink=True)
    assert l2_counts(pool) == {"stored": 1, "slots": 1, "kept_4bit": 1}
    assert_restores(rig, host_c, rows_c, PAGE)


def test_reused_host_page_is_not_a_sink_page_any_more():
    """A freed sink page's host slots, reused by a non-first page, restore at 4 bits."""
    rig = build("int4", host_pages=2)
    host, _ = backup(rig, 2 * PAGE, seed=9, sink=True)
    rig.controller.evict_host(host)
    again, rows = backup(rig, 2 * PAGE, seed=10, sink=False)
    assert sorted(again.tolist()) == sorted(host.tolist())
    assert_restores(rig, again, rows, 0)


def test_free_clears_the_mark_of_a_page_whose_slot_is_reused():
    """A freed sink page's mark goes with its slot: the next first page takes the one
    slot (8-bit keys), a non-first page on the freed host page restores at 4 bits."""
    rig = build("int4", sink_tokens=16 * PAGE, host_pages=4)
    pool = rig.host_pool
    host_a, _ = backup(rig, 2 * PAGE, seed=12, sink=True)
    rig.controller.evict_host(host_a)
    assert bool((pool.sink_pages.slot_of_page < 0).all())
    host_b, rows_b = backup(rig, 2 * PAGE, seed=13, sink=True)
    host_c, rows_c = backup(rig, 2 * PAGE, seed=14, sink=False)
    # The pool is full: host_a's pages went to b or c.
    assert sorted(torch.cat([host_b, host_c]).tolist()) == list(range(4 * PAGE))
    assert l2_counts(pool) == {"stored": 1, "slots": 1, "kept_4bit": 0}
    assert_restores(rig, host_b, rows_b, PAGE)
    assert_restores(rig, host_c, rows_c, 0)


def test_pool_clear_returns_every_slot_and_mark():
    """A cache reset clears the pool: no sink page outlives it."""
    rig = build("int4", sink_tokens=16 * PAGE, host_pages=2)
    pool = rig.host_pool
    backup(rig, 2 * PAGE, seed=16, sink=True)
    pool.clear()
    assert l2_counts(pool) == {"stored": 0, "slots": 1, "kept_4bit": 0}
    assert bool((pool.sink_pages.slot_of_page < 0).all())
    host, rows = backup(rig, 2 * PAGE, seed=17, sink=False)
    assert_restores(rig, host, rows, 0)


def test_marking_a_page_twice_takes_one_slot():
    rig = build("int4", sink_tokens=8 * PAGE)
    pool = rig.host_pool
    host, rows = backup(rig, 2 * PAGE, seed=15, sink=True)
    pool.mark_sink_page(host)
    assert l2_counts(pool) == {"stored": 1, "slots": 2, "kept_4bit": 0}
    assert_restores(rig, host, rows, PAGE)
    # Freeing the page returns every slot it held: none leaks.
    rig.controller.evict_host(host)
    assert l2_counts(pool) == {"stored": 0, "slots": 2, "kept_4bit": 0}


@pytest.mark.parametrize(
    "fmt, tokens, match",
    [
        ("int8", 64, r"formats that store keys at 4 bits \(int4, int4r, int4c\)"),
        ("int8c", 64, "formats that store keys at 4 bits"),
        ("k8v4", 64, "--hicache-host-dtype k8v4 does not"),
        ("k8v4r", 64, "--hicache-host-dtype k8v4r does not"),
        ("int4", 8, "at least the page size"),
    ],
)
def test_bad_settings_fail_at_start_up_naming_the_variable(fmt, tokens, match):
    with pytest.raises(ValueError, match=f"{SINK_ENV}.*{match}|{match}.*{SINK_ENV}"):
        build(fmt, sink_tokens=tokens)


def test_fp8_device_kv_is_refused():
    fp8 = torch.float8_e4m3fn
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, dtype=fp8, page_size=PAGE)
    device_pool = make_device_pool(geo, 16 * PAGE)
    with pytest.raises(ValueError, match=SINK_ENV):
        make_host_pool(
            device_pool,
            host_tokens=16 * PAGE,
            layout="page_first",
            host_dtype="int4",
            device_kv_dtype=fp8,
            sink_page_tokens=64,
        )


# --- bytes per token -----------------------------------------------------------


def allocated_bytes(pool) -> int:
    tensors = list(pool.host_records.values())
    if pool.sink_pages is not None:
        tensors += list(pool.sink_pages.records.tensors.values())
    return sum(t.numel() * t.element_size() for t in tensors)


def test_bytes_per_token_at_qwen3_8b_geometry():
    """int4 with a side-store slot per 1k/4k/8k/16k host tokens, page 64: the pool
    reports (start-up log, metrics) the bytes per token it allocates."""
    geo = Geometry(layer_num=36, head_num=8, head_dim=128, page_size=64)
    device_pool = make_device_pool(geo, device_tokens=128)
    bf16 = 36 * 8 * 128 * 2 * 2
    print("\nsink slot per  B/token  tokens per host byte vs BF16")
    for tokens in (0, 1024, 4096, 8192, 16384):
        pool = make_host_pool(
            device_pool,
            host_tokens=16384,
            layout="page_first",
            host_dtype="int4",
            sink_page_tokens=tokens,
        )
        per_token = allocated_bytes(pool) / pool.size
        assert per_token == pool.size_per_token == pool.get_size_per_token()
        print(f"{tokens or 'off':>13}  {per_token:>7}  {bf16 / per_token:.3f}x")
        # int4's 1152 B per token and layer, plus one page of int8 keys
        # (1040 B per token and layer) per `tokens` host tokens.
        assert per_token == 36 * (1152 + (1040 * 64 / tokens if tokens else 0))


# --- the radix cache says which page -----------------------------------------


def radix_cache(monkeypatch, host_dtype, host_tokens=64 * PAGE):
    """SGLang's UnifiedRadixCache + HiCache as the scheduler builds it, write-through."""
    monkeypatch.setenv(SINK_ENV, str(4 * PAGE))
    device_tokens = 32 * PAGE
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=PAGE)
    server_args = publish_server_args(
        host_dtype,
        page_size=PAGE,
        hicache_ratio=host_tokens / device_tokens,
        layout="page_first",
        io_backend="direct",
    )
    device_pool = make_device_pool(geo, device_tokens)
    cache, allocator, _ = mha_radix_cache(
        server_args, device_pool, requests=4, max_context_len=4096
    )
    cache.write_through_threshold = 1
    return cache, device_pool, allocator


def insert(cache, allocator, device_pool, ids, seed):
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slots = allocator.alloc(len(ids))
    fill_random(device_pool, slots, seed)
    cache.insert(
        InsertParams(
            key=RadixKey(array("q", ids)),
            value=slots.to(torch.int64),
            prev_prefix_len=0,
            inserted_len=0,
        )
    )
    cache.writing_check(write_back=True)
    return slots


def test_radix_cache_flags_the_first_page_of_each_root_child(monkeypatch):
    """Three sequences: b shares a's first two pages, c starts elsewhere."""
    cache, device_pool, allocator = radix_cache(monkeypatch, "int4r")
    controller = cache.cache_controller
    pool = controller.mem_pool_host.anchor_entry.host_pool
    writes = []
    real_write = controller.write

    def write(device_indices, *args, first_page_is_sink=False, **kw):
        host = real_write(
            device_indices, *args, first_page_is_sink=first_page_is_sink, **kw
        )
        writes.append((device_indices.clone(), host.clone(), first_page_is_sink))
        return host

    monkeypatch.setattr(controller, "write", write)
    a = list(range(1, 1 + 3 * PAGE))
    b = a[: 2 * PAGE] + list(range(500, 500 + 2 * PAGE))
    c = list(range(900, 900 + 2 * PAGE))
    slots = [
        insert(cache, allocator, device_pool, ids, seed)
        for seed, ids in enumerate((a, b, c))
    ]
    assert [(len(dev), sink) for dev, _, sink in writes] == [
        (3 * PAGE, True),
        (2 * PAGE, False),
        (2 * PAGE, True),
    ]
    assert torch.equal(writes[0][0], slots[0])
    assert torch.equal(writes[1][0], slots[1][2 * PAGE :])
    assert torch.equal(writes[2][0], slots[2])
    flagged = (pool.sink_pages.slot_of_page >= 0).nonzero().flatten().tolist()
    assert sorted(flagged) == sorted(int(h[0]) // PAGE for _, h, s in writes if s)
    counts = pool.sink_page_counts()
    assert (counts["stored"], counts["kept_4bit"]) == (2, 0)


# --- L3 -------------------------------------------------------------------------


def l3_rig(tmp_path, l3_rigs, monkeypatch, sink_tokens=4 * PAGE):
    from scripts.rigs.l3_harness import file_storage_config, make_l3_rig

    monkeypatch.setenv(SINK_ENV, str(sink_tokens))
    geo = Geometry(layer_num=2, head_num=2, head_dim=64, page_size=PAGE)
    l3 = make_l3_rig(
        "file", file_storage_config(tmp_path), host_dtype="int4r", geo=geo,
        layout="page_first", device_tokens=8 * PAGE, host_tokens=16 * PAGE,
    )  # fmt: skip
    l3_rigs.append(l3)
    return l3


def sink_objects(tmp_path) -> list:
    return sorted(p for p in tmp_path.iterdir() if L3_KEY_SUFFIX in p.name)


def write_sequence(l3, tokens, seed):
    """A sequence from token 0 -> L2 -> L3, dropped from L1 and L2; returns its (K, V)
    per layer."""
    from scripts.rigs.l3_harness import device_rows, evict_everywhere, write_through

    dev, host, _, stored = write_through(l3, tokens, seed=seed, first_page_is_sink=True)
    assert stored == len(tokens) // PAGE
    rows = device_rows(l3.rig, dev)
    layers = l3.geo.layer_num
    evict_everywhere(l3, dev, host)
    return list(zip(rows[:layers], rows[layers:]))


def record_gets(l3) -> list:
    """The keys the controller asks the backend for, from now on."""
    backend, keys = l3.backend, []
    batch_get = backend.batch_get

    def recording(batch_keys, *args, **kwargs):
        keys.extend(batch_keys)
        return batch_get(batch_keys, *args, **kwargs)

    backend.batch_get = recording
    return keys


def assert_prefetch_restores(l3, tokens, written, sink_tokens, last_hash=None):
    """L3 -> fresh host pages -> L1 gives expect()'s bits."""
    from scripts.rigs.l3_harness import load_to_device, prefetch

    fetched = prefetch(l3, tokens, last_hash=last_hash)
    assert fetched.completed_tokens == len(tokens)
    dev = load_to_device(l3, fetched.host_indices)
    l1 = l3.rig.device_pool
    for layer, (want_k, want_v) in enumerate(
        expect(l3.rig.host_pool, written, sink_tokens)
    ):
        assert_same(l1.k_buffer[layer][dev], want_k)
        assert_same(l1.v_buffer[layer][dev], want_v)


def test_l3_carries_the_sink_page_keys_at_8_bits(monkeypatch, tmp_path, l3_rigs):
    """L3 holds every page at 4 bits plus one object of the sink page's 8-bit keys, with
    which the prefetched sink page restores (the int8 codec's bits)."""
    l3 = l3_rig(tmp_path, l3_rigs, monkeypatch)
    pool = l3.rig.host_pool
    tokens = list(range(7, 7 + 3 * PAGE))
    written = write_sequence(l3, tokens, seed=12)
    assert len(sink_objects(tmp_path)) == 1
    assert pool.sink_page_counts()["stored"] == 0
    gets = record_gets(l3)
    assert_prefetch_restores(l3, tokens, written, PAGE)
    assert [k for k in gets if L3_KEY_SUFFIX in k] == [
        get_storage_hash_str(tokens, None, page_size=PAGE)[0] + L3_KEY_SUFFIX
    ]
    counts = pool.sink_page_counts()
    assert counts["stored"] == 1 and counts["l3"]["restored"] == 1


def test_l3_chain_after_token_0_does_not_ask(monkeypatch, tmp_path, l3_rigs):
    """A prefetch continuing a cached prefix asks for no sink object: 4 bits."""
    l3 = l3_rig(tmp_path, l3_rigs, monkeypatch)
    tokens = list(range(7, 7 + 3 * PAGE))
    written = write_sequence(l3, tokens, seed=6)
    last_hash = get_storage_hash_str(tokens, None, page_size=PAGE)[0]
    gets = record_gets(l3)
    rest = [(k[PAGE:], v[PAGE:]) for k, v in written]
    assert_prefetch_restores(l3, tokens[PAGE:], rest, 0, last_hash=last_hash)
    assert gets and not [k for k in gets if L3_KEY_SUFFIX in k]
    counts = l3.rig.host_pool.sink_page_counts()
    assert counts["stored"] == 0 and sum(counts["l3"]["refused"].values()) == 0


def test_l3_full_store_restores_4_bit_and_counts_it(monkeypatch, tmp_path, l3_rigs):
    """One slot, held by the first prefetched sink page: the second's restores 4-bit,
    counted as full."""
    l3 = l3_rig(tmp_path, l3_rigs, monkeypatch, sink_tokens=16 * PAGE)
    pool = l3.rig.host_pool
    assert pool.sink_page_counts()["slots"] == 1
    first = list(range(7, 7 + 2 * PAGE))
    second = list(range(500, 500 + 2 * PAGE))
    written_first = write_sequence(l3, first, seed=7)
    written_second = write_sequence(l3, second, seed=8)
    assert_prefetch_restores(l3, first, written_first, PAGE)
    assert_prefetch_restores(l3, second, written_second, 0)
    counts = pool.sink_page_counts()
    assert counts["l3"]["restored"] == 1 and counts["l3"]["full"] == 1


def _corrupt(l3, objects):
    data = bytearray(objects[0].read_bytes())
    data[len(data) // 2] ^= 0x40
    objects[0].write_bytes(bytes(data))


def _other_page(l3, objects):
    # The first sequence's sink object under the second's key.
    objects[0].write_bytes(objects[1].read_bytes())


def _failing_get(l3, objects):
    batch_get = l3.backend.batch_get

    def failing(keys, *args, **kwargs):
        if any(L3_KEY_SUFFIX in k for k in keys):
            raise OSError("store unavailable")
        return batch_get(keys, *args, **kwargs)

    l3.backend.batch_get = failing


@pytest.mark.parametrize(
    "fault, reason",
    [
        (_corrupt, "checksum"),
        (lambda l3, objects: objects[0].unlink(), "missing"),
        (_other_page, "key"),
        (_failing_get, "missing"),
    ],
    ids=["corrupt", "delete", "other_page", "get_raises"],
)
def test_l3_sink_object_refused_restores_4_bit(
    monkeypatch, tmp_path, l3_rigs, fault, reason
):
    """A sink object changed, deleted, taken from another sequence's page, or whose get
    raises: the page (verified) restores at 4 bits, bit for bit, counted by reason; no
    slot is taken and the other pages are unchanged."""
    l3 = l3_rig(tmp_path, l3_rigs, monkeypatch)
    pool = l3.rig.host_pool
    first = list(range(7, 7 + 2 * PAGE))
    second = list(range(500, 500 + 2 * PAGE))
    write_sequence(l3, first, seed=3)
    written = write_sequence(l3, second, seed=4)
    objects = sink_objects(tmp_path)
    assert len(objects) == 2
    # The second sequence's object first: the one whose page this test fetches.
    key = get_storage_hash_str(second, None, page_size=PAGE)[0] + L3_KEY_SUFFIX
    objects.sort(key=lambda p: not p.name.startswith(key))
    assert objects[0].name.startswith(key)
    fault(l3, objects)
    assert_prefetch_restores(l3, second, written, 0)
    counts = pool.sink_page_counts()
    assert counts["stored"] == 0
    assert counts["l3"]["restored"] == 0
    assert counts["l3"]["refused"][reason] == 1
    assert sum(counts["l3"]["refused"].values()) == 1
    assert pool.storage_integrity_counts()["verified"] == 2


def test_l3_sink_off_writes_no_sink_objects(monkeypatch, tmp_path, l3_rigs):
    """Sink off: only the 4-bit pages go to L3, and they come back 4-bit."""
    l3 = l3_rig(tmp_path, l3_rigs, monkeypatch, sink_tokens=0)
    tokens = list(range(7, 7 + 2 * PAGE))
    written = write_sequence(l3, tokens, seed=5)
    assert sink_objects(tmp_path) == []
    assert len(list(tmp_path.iterdir())) == 2
    gets = record_gets(l3)
    assert_prefetch_restores(l3, tokens, written, 0)
    assert gets == get_storage_hash_str(tokens, None, page_size=PAGE)


def test_quality_harness_sink_arm_is_opt_in():
    """The quality CLI's int4r_sink arm: int4r's pool with the side store, opt-in."""
    from scripts.quality import harness as hq

    default, _ = hq._selected_arms(hq.QualityConfig(text_file="unused"))
    assert "int4r" in default and "int4r_sink" not in default
    arms, offloaded = hq._selected_arms(
        hq.QualityConfig(text_file="unused", arms=("int4r", "int4r_sink"))
    )
    assert arms == ("exact", "int4r", "int4r_sink")
    plain, sink = offloaded
    assert (sink.host_dtype, sink.page_size, sink.layout) == (
        plain.host_dtype, plain.page_size, plain.layout,
    )  # fmt: skip
    assert (plain.sink_page_tokens, sink.sink_page_tokens) == (0, hq.SINK_PAGE_TOKENS)


# --- start-up log ------------------------------------------------------------


def test_start_up_lines_round_bytes_per_token_and_size_the_store(caplog):
    """The line rounds the (fractional) bytes per token and sizes the store in a unit
    that shows it."""
    with caplog.at_level(logging.INFO, logger="sglang.srt.mem_cache.pool_host"):
        # 3 slots of 16.5 B per host token each.
        pool = build("int4", sink_tokens=6 * PAGE).host_pool
    lines = [r.getMessage() for r in caplog.records]
    exact = pool.get_size_per_token()
    assert exact != int(exact)  # what the line printed as 6482.139255702281
    (stores,) = [line for line in lines if "host pool stores INT4 KV" in line]
    assert f"stores INT4 KV: {round(exact)} B/token (torch.bfloat16: " in stores
    (sink,) = [line for line in lines if "sink page:" in line]
    store = pool.sink_pages.nbytes()
    assert 1e3 <= store < 1e6  # printed as 0.0 MB
    assert f"{SINK_ENV}=96), {store / 1e3:.1f} KB; L3 pages stay int4" in sink


@pytest.mark.parametrize(
    "n, text",
    [
        (17_800, "17.8 KB"),
        (9_600_000, "9.6 MB"),
        (2_500_000_000, "2.5 GB"),
        (512, "512 B"),
    ],
)
def test_readable_bytes(n, text):
    from sglang.srt.mem_cache.pool_host.sink_page import readable_bytes

    assert readable_bytes(n) == text


def test_the_sink_page_hooks_are_declared_and_take_bytes():
    """HostKVCache declares the controller's sink-page hooks, which the controller calls
    plainly; the pool names the object to get and receives its bytes, never a backend."""
    import inspect

    from sglang.srt.managers import cache_controller
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    source = inspect.getsource(cache_controller)
    hooks = (
        "storage_sink_objects",
        "storage_sink_page_get",
        "restore_storage_sink_page",
    )
    for hook in hooks:
        assert hook in vars(HostKVCache), hook
        assert f'"{hook}"' not in source, f"{hook} probed by name"
    off = build("int4", sink_tokens=0).host_pool
    assert off.storage_sink_page_get("k", torch.arange(PAGE)) is None

    rig = build("int4")
    pool = rig.host_pool
    host = pool.alloc(PAGE)
    key, dst = pool.storage_sink_page_get("page0", host)
    assert key == "page0" + L3_KEY_SUFFIX
    assert dst.dtype == torch.uint8 and dst.numel() == len(
        pool.sink_pages.l3.read(0, key)
    )
    # A miss (or a get that raised): counted, the page stays 4-bit.
    pool.restore_storage_sink_page(key, host, None)
    assert pool.sink_page_counts()["l3"]["refused"]["missing"] == 1
    assert pool.sink_page_counts()["stored"] == 0
