"""The patched tree's real HiCacheController moves KV device -> host -> device
on CPU with the stock host pool (io backend `direct`)."""

import torch

from scripts.rigs.hicache_harness import (
    Geometry,
    fill_random,
    finish_transfers,
    make_rig,
)


def test_write_evict_load_cycle_restores_exact_bytes():
    geo = Geometry(layer_num=3, head_num=2, head_dim=16)
    rig = make_rig(geo, device_tokens=128, host_tokens=256)
    dev = rig.allocator.alloc(40)
    written = fill_random(rig.device_pool, dev, seed=1)

    host = rig.controller.write(dev)
    assert host is not None and len(host) == 40
    finish_transfers(rig.controller)

    # Evict from L1: wipe the rows and give the slots back.
    for layer in range(geo.layer_num):
        rig.device_pool.k_buffer[layer][dev] = 0
        rig.device_pool.v_buffer[layer][dev] = 0
    rig.allocator.free(dev)

    new_dev = rig.controller.load(host)
    assert new_dev is not None
    rig.controller.start_loading()
    finish_transfers(rig.controller)

    for layer, (k_rows, v_rows) in enumerate(written):
        assert torch.equal(rig.device_pool.k_buffer[layer][new_dev], k_rows)
        assert torch.equal(rig.device_pool.v_buffer[layer][new_dev], v_rows)
