"""The step's host-side index building (``worker/inputs.py`` and the attention backend's
``build``) against the paged-cache reference helpers (``tests/paged_reference.py``), on both the
all-host path and the device-gather path."""
from __future__ import annotations

import numpy as np
import paged_reference as paged
import torch
from test_sampler import PROMPTS, tiny

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine
from flash_dllm.worker import inputs


def _engine_with_running(page_size=4):
    model = tiny("llada", seed=1)
    eng = Engine(model, model.cfg, EngineConfig(page_size=page_size))
    params = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="vanilla")
    reqs = [eng.add_request(p, params) for p in PROMPTS[:3]]
    eng.scheduler.admit()
    states = [eng.runner.seq(r, eng.kv_manager.pages(r.request_id)) for r in reqs]
    return eng, reqs, states


def test_ids_positions_host_path_gathers_the_canvases():
    eng, reqs, states = _engine_with_running()
    arena = eng.runner.arena
    rows = [st.arena_row for st in states]
    parts = [(max(0, r.prompt_len - 2), r.prompt_len + 8) for r in reqs]
    ids = [(row, a, b) for row, (a, b) in zip(rows, parts)]
    blk = np.concatenate([row * arena.shape[1] + r.block_start + np.arange(8)
                          for row, r in zip(rows, reqs)])
    ids_t, pos_t, pos_host, blk_t = inputs.ids_positions(arena, rows, ids, parts, blk,
                                                         eng.device)
    assert torch.equal(ids_t, torch.cat([r.canvas[a:b] for r, (a, b) in zip(reqs, parts)]))
    assert pos_t.tolist() == [p for a, b in parts for p in range(a, b)]
    assert pos_host.tolist() == pos_t.tolist()
    assert torch.equal(arena.view(-1)[blk_t],
                       torch.cat([r.canvas[r.block_start:r.block_end] for r in reqs]))
    # a device part (e.g. flash top-k positions) takes the gather path: same ids and positions
    extra = torch.tensor([0, 1])
    parts2 = parts[:1] + [extra]
    ids2 = ids[:1] + [states[0].canvas[extra]]
    ids_t2, pos_t2, pos_host2, blk_t2 = inputs.ids_positions(arena, rows[:1], ids2, parts2,
                                                             blk[:8], eng.device)
    assert pos_host2 is None
    assert pos_t2.tolist() == list(range(*parts[0])) + [0, 1]
    assert torch.equal(ids_t2, torch.cat([reqs[0].canvas[parts[0][0]:parts[0][1]],
                                          reqs[0].canvas[extra]]))
    assert blk_t2.tolist() == blk[:8].tolist()


def test_attention_metadata_matches_slot_mapping_on_both_paths():
    eng, reqs, _ = _engine_with_running(page_size=4)
    ps = eng.pool.page_size
    width = eng.pool.pages_for(eng.cfg.max_position)
    pages = [eng.kv_manager.pages(r.request_id) for r in reqs]
    table = inputs.BlockTables().get(reqs, pages, width)
    parts = [(r.block_start - 1, r.block_end) for r in reqs]
    cu = [0]
    for a, b in parts:
        cu.append(cu[-1] + b - a)
    pos_host = np.concatenate([np.arange(a, b) for a, b in parts])
    positions = torch.from_numpy(pos_host)
    ref_table = paged.block_table(pages, width=width)
    assert torch.equal(torch.from_numpy(table), ref_table)
    req_of_row = paged.token_requests(torch.tensor(cu), positions.shape[0])
    tt = ref_table
    want = paged.slot_mapping(tt, req_of_row, positions, ps)
    lens = [r.canvas_len for r in reqs]
    backend = eng.runner.backend
    host = backend.build(table, lens, positions, pos_host, cu, [])
    dev = backend.build(table, lens, positions, None, cu, [(cu[1] - 2, cu[1])])
    assert host.slots.long().tolist() == want.tolist()
    expect_dev = want.clone()
    expect_dev[cu[1] - 2:cu[1]] = -1                 # verification rows: never cached
    assert dev.slots.tolist() == expect_dev.tolist()
    for b in (host, dev):
        assert b.cu_q.tolist() == cu
        assert b.seq_lens.tolist() == [r.canvas_len for r in reqs]
        assert torch.equal(b.block_table, tt)
        assert b.max_q == max(x - y for x, y in zip(cu[1:], cu))


def test_block_tables_cache_and_forget():
    eng, reqs, _ = _engine_with_running()
    pages = [eng.kv_manager.pages(r.request_id) for r in reqs]
    bt = inputs.BlockTables()
    t1 = bt.get(reqs, pages, 8)
    assert bt.get(list(reqs), pages, 8) is t1    # same requests: cached
    assert bt.get(reqs[:2], pages[:2], 8) is not t1   # another batch: rebuilt
    bt.forget(reqs[2].request_id)
    assert bt.cached                             # reqs[2] is not in the cached batch
    bt.forget(reqs[0].request_id)
    assert not bt.cached
    assert [t1[i, :len(p)].tolist() for i, p in enumerate(pages)] == pages
