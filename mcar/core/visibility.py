"""The one visibility rule of docs/diagd.md section 5, over a table of input rows.

A `SlotTable` holds, per input row, its feed pass F, its layout position and whether it is an ephemeral proxy.
The rule turns it into a mask function (flex_attention's mask_mod), a dense boolean mask (SDPA) or a BlockMask;
the causal mask is the table with F(p) = p. The schedule builds tables; the mask factories and the samplers
read them. Nothing here knows the schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


@dataclass(frozen=True)
class SlotTable:
    feed_pass: torch.Tensor  # (S,) long: pass in which the slot's key/value is computed
    pos: torch.Tensor  # (S,) long: the slot's position in the flat clip layout
    is_proxy: torch.Tensor  # (S,) bool: ephemeral proxy, seen by its own query only
    full: bool = False  # diagd_full: drop the pos(p) <= pos(q) condition

    def mask_mod(self):
        """The one mask function: (b, h, q_idx, kv_idx) -> bool, traceable by flex_attention.

        Row p sees row q's key when (F, pos)(p) <= (F, pos)(q) in lexicographic order, and also pos(p) <= pos(q)
        unless `full`; a proxy's key only by its own query. Evaluated per element inside flex's kernel, so it
        reads per-row codes computed once here: one int32 per row holds the rank of (F, pos) and pos, and a
        proxy's key rank is above every query's. Two loads and a few integer ops per element, where the rule read
        as written gathers five int64s (8.8 KB of register spills per thread in flex's H100 forward)."""
        F, pos, proxy = self.feed_pass.cpu(), self.pos.cpu(), self.is_proxy.cpu()  # once per mask, on the host
        S = len(pos)
        if S and int(pos.min()) < 0:
            raise ValueError("SlotTable.pos must be >= 0 (layout positions)")
        rank = torch.unique(torch.stack([F, pos], 1), dim=0, return_inverse=True)[1]
        bits = max(int(pos.max()) if S else 0, S).bit_length()
        dtype = torch.int32 if 2 * bits + 1 <= 31 else torch.int64
        code = (rank.to(dtype) << bits) | pos.to(dtype)  # query side: rank, then pos in the low bits
        key = torch.where(proxy, code | (1 << (2 * bits)), code)  # a proxy key outranks every query
        code, key = code.to(self.pos.device), key.to(self.pos.device)
        low, full = (1 << bits) - 1, self.full

        def mod(b, h, q, kv):
            cq, ck = code[q], key[kv]
            visible = (ck >> bits) <= (cq >> bits)
            if not full:
                visible = visible & ((ck & low) <= (cq & low))
            return visible | (q == kv)

        return mod

    def dense(self) -> torch.Tensor:
        """(S, S) bool, True where query row may attend to key column."""
        idx = torch.arange(len(self.pos), device=self.pos.device)
        return self.mask_mod()(None, None, idx[:, None], idx[None, :])

    def block_mask(self, block_size: int = 128) -> BlockMask:
        S = len(self.pos)
        return create_block_mask(
            self.mask_mod(), B=None, H=None, Q_LEN=S, KV_LEN=S, device=self.pos.device, BLOCK_SIZE=block_size
        )


def block_stats(table: SlotTable, block: int = 128) -> dict:
    """How flex_attention tiles the table's mask into block x block tiles: counts and fractions of empty
    (skipped), partial (mask_mod evaluated element by element) and full (no mask_mod) tiles.

    Counted as `create_block_mask` counts them: the mask is padded with False up to a multiple of `block`, so
    a tile that overhangs the end is never full. `partial_of_computed` = partial / (partial + full).
    """
    S = len(table.pos)
    n = -(-S // block)
    mod, keys = table.mask_mod(), torch.arange(S, device=table.pos.device)
    counts = []
    for q0 in range(0, S, block):  # one row of tiles at a time: never the whole S x S mask
        q = keys[q0:q0 + block]
        band = mod(None, None, q[:, None], keys[None, :]).sum(0)  # (S,) visible queries per key column
        counts.append(torch.nn.functional.pad(band, (0, n * block - S)).view(n, block).sum(1))
    counts = torch.stack(counts)  # (n, n) visible elements per tile
    full = int((counts == block * block).sum())
    empty = int((counts == 0).sum())
    partial = n * n - full - empty
    return dict(block=block, seq_len=S, tiles=n * n, empty=empty, partial=partial, full=full,
                empty_frac=empty / (n * n), partial_frac=partial / (n * n), full_frac=full / (n * n),
                partial_of_computed=partial / max(partial + full, 1))


def causal_table(n: int, device=None) -> SlotTable:
    ar = torch.arange(n, device=device)
    return SlotTable(feed_pass=ar, pos=ar, is_proxy=torch.zeros(n, dtype=torch.bool, device=device))
