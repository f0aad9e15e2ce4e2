"""The block bench's graphed cached step (`gr_plugin.bench.block.StaticStep`) in the engine's form (no
SiLU pass: `HSTULayer.attend_pages` from the projection before its SiLU) against the form it replaced
(``silu_pass=True``), on the GPU: with the kernels' exact SiLU the same bits, outputs and pages."""

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "page"), [(128, 16), (64, 32)])
def test_static_step_without_a_silu_pass_gives_the_silu_pass_bits(dim, page, monkeypatch):
    import gr_plugin.ops.triton as tri_ops
    from gr_plugin.bench.block import Block, StaticStep

    monkeypatch.setattr(tri_ops, "EXACT_SILU", True)
    blk = Block(dim, page, num_layers=2, hidden=256, heads=2, num_pages=64)
    users, hist, cached, cands = [0, 1], 96, 64, 8
    blk.fill(users, cached)
    plan = blk.plan(users, hist)
    with torch.no_grad():
        step = StaticStep(blk, plan, len(users), hist - cached, cands)
        before = StaticStep(blk, plan, len(users), hist - cached, cands, silu_pass=True)
        before.ys[0].copy_(step.ys[0])  # (each step draws its own input)
        results = []
        for s in (step, before):
            blk.cache.kv_table.zero_()  # (the history is gone: both steps read zeros there alike)
            s.run()
            torch.cuda.synchronize()
            results.append((s.ys[-1].clone(), blk.cache.kv_table.clone()))
    (y, table), (y_before, table_before) = results
    assert torch.equal(y, y_before) and torch.equal(table, table_before)
    assert table.abs().sum() > 0 and y.isfinite().all()  # (the new tokens were written; a real output)
