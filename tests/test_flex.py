"""The training sequence order for flex_attention: exact (a permutation of the interleaved order), block-sparse
(few partial 128x128 tiles at the paper's geometry), and the compiled flex forward equals the dense SDPA one."""
import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import mcar.core.model
from mcar.core.layout import Layout
from mcar.core.masks import DiagDMask
from mcar.core.model import ModelConfig, Transformer
from mcar.core.schedule import Schedule
from mcar.core.visibility import SlotTable, block_stats, causal_table

PAPER = Layout(14, 24, 11)  # MC-AR / MineWorld: 16-frame clips, one prompt frame
FRAMES = 16


def interleaved_rows(s: Schedule) -> torch.Tensor:
    """The schedule's rows in the old order, rebuilt from the per-slot and per-proxy tables: every slot in
    layout order, each proxy right after the slot it stands in for. (S, 8): pos, F, proxy, src, target, coords."""
    N = s.n_slots
    slot = torch.arange(N)
    real_target = torch.where(slot + 1 < N, slot + 1, -1)
    real_target[s.proxy_pred] = -1  # a proxied target is predicted by its proxy, not by its real predecessor
    real = torch.stack([slot, s.feed_pass, torch.zeros(N, dtype=torch.long), slot, real_target], 1)
    proxy = torch.stack([s.proxy_pred, s.proxy_pass, torch.ones_like(s.proxy_pred), s.proxy_source,
                         s.proxy_target], 1)
    rows = torch.cat([real, proxy])
    rows = torch.cat([rows, s.coords[rows[:, 0]]], 1)
    return rows[(2 * rows[:, 0] + rows[:, 2]).argsort()]


def sequence_rows(s: Schedule) -> torch.Tensor:
    return torch.cat([torch.stack([s.seq_pos, s.seq_feed_pass, s.seq_is_proxy.long(), s.seq_src, s.seq_target], 1),
                      s.seq_coords], 1)


def as_multiset(rows: torch.Tensor) -> list:
    return sorted(map(tuple, rows.tolist()))


@pytest.mark.parametrize("layout, frames, k, d, proxy", [
    (Layout(3, 4, 2), 4, 2, None, "prev_frame"), (Layout(3, 4, 2), 4, 2, 3, "above"),
    (Layout(3, 4, 0), 4, 1, 3, "prev_frame"), (PAPER, FRAMES, 2, None, "prev_frame"),
])
def test_sequence_is_a_permutation_of_the_interleaved_order(layout, frames, k, d, proxy):
    s = Schedule(layout, frames, 1, k=k, d=d, proxy=proxy)
    old, new = interleaved_rows(s), sequence_rows(s)
    assert as_multiset(old) == as_multiset(new)
    assert not torch.equal(old, new)  # the order did change: real slots first, then the proxies
    assert not s.seq_is_proxy[:s.n_slots].any() and s.seq_is_proxy[s.n_slots:].all()
    # the mask is a function of each row's (F, pos, proxy): permuting the rows permutes the mask
    if s.n_slots < 1000:
        perm = (2 * s.seq_pos + s.seq_is_proxy.long()).argsort()  # new row index of each old row
        t = s.table()
        old_table = SlotTable(t.feed_pass[perm], t.pos[perm], t.is_proxy[perm])
        assert torch.equal(t.dense()[perm][:, perm], old_table.dense())


@pytest.mark.parametrize("S, block", [(37, 16), (48, 16), (200, 128)])
def test_block_stats_counts_tiles_as_create_block_mask_does(S, block):
    s = Schedule(Layout(3, 4, 2), 4, 1, k=2, d=3)
    for table in (s.table(), s.table(full=True), causal_table(S)):
        stats = block_stats(table, block)
        bm = table.block_mask(block)
        assert stats["partial"] == int(bm.kv_num_blocks.sum()) and stats["full"] == int(bm.full_kv_num_blocks.sum())
        assert stats["empty"] + stats["partial"] + stats["full"] == stats["tiles"] == (-(-len(table.pos) // block)) ** 2
        assert stats["empty_frac"] + stats["partial_frac"] + stats["full_frac"] == pytest.approx(1.0)


def test_few_partial_tiles_at_the_paper_geometry():
    """The interleaved order made ~92% of the computed 128x128 tiles partial (mask_mod element by element)."""
    causal = block_stats(causal_table(PAPER.n_slots(FRAMES)))["partial_of_computed"]
    for full in (False, True):
        stats = block_stats(DiagDMask(PAPER, FRAMES, k=2, full=full).table())
        assert stats["seq_len"] == 5747
        assert causal < stats["partial_of_computed"] < 0.3


@pytest.fixture
def compiled_flex(monkeypatch):
    """mcar.core.model compiles flex_attention on CUDA only; compile it on CPU too (the block-sparse CPU kernel,
    which skips empty tiles and the mask_mod of full ones, where eager flex evaluates every element)."""
    compiled = torch.compile(flex_attention, dynamic=False)
    monkeypatch.setattr(mcar.core.model, "_flex", lambda q, k, v, block_mask: compiled(
        q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1]))


@pytest.mark.slow
def test_compiled_flex_equals_dense_sdpa_at_the_paper_length(compiled_flex):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, mlp_dim=64, init_std=0.2)
    model = Transformer(cfg).eval()
    factory = DiagDMask(PAPER, FRAMES, k=2, backend="flex")
    clip = torch.randint(0, cfg.vocab_size, (1, PAPER.n_slots(FRAMES)))
    batch = factory(clip)
    table = factory.table()
    assert batch.tokens.shape[1] == 5747
    with torch.no_grad():
        dense = model(batch.tokens, batch.coords, table.dense())
        flex = model(batch.tokens, batch.coords, batch.mask)
    assert ((flex - dense).abs().max() / dense.abs().max()).item() < 1e-5
