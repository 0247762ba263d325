"""Attention masks from ONE mask function, as a dense boolean tensor (SDPA, CPU) or a BlockMask (flex, GPU).

A mask is defined by a `SlotTable`: per input slot its feed pass F, its layout position and whether it is an
ephemeral proxy. The visibility rule of ../shared/DIAGD.md section 5 turns it into a mask; the causal mask is
the table with F(p) = p. Mask factories (causal here; DiagD in mcar.diagd_mask) turn a batch of clips into
model inputs, coordinates, loss targets and the mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from mcar.layout import Layout

IGNORE = -100  # loss target of slots that carry no loss


@dataclass(frozen=True)
class SlotTable:
    feed_pass: torch.Tensor  # (S,) long: pass in which the slot's key/value is computed
    pos: torch.Tensor  # (S,) long: the slot's position in the flat clip layout
    is_proxy: torch.Tensor  # (S,) bool: ephemeral proxy, seen by its own query only
    full: bool = False  # diagd_full: drop the pos(p) <= pos(q) condition

    def mask_mod(self):
        """The one mask function: (b, h, q_idx, kv_idx) -> bool, traceable by flex_attention."""
        F, pos, proxy, full = self.feed_pass, self.pos, self.is_proxy, self.full

        def mod(b, h, q, kv):
            fq, fk, pq, pk = F[q], F[kv], pos[q], pos[kv]
            visible = (fk < fq) | ((fk == fq) & (pk <= pq))
            if not full:
                visible = visible & (pk <= pq)
            return visible & (~proxy[kv] | (q == kv))

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


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "sdpa", "flex"):
        raise ValueError(f"mask.backend must be one of auto|sdpa|flex, got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


@dataclass
class MaskedBatch:
    tokens: torch.Tensor  # (B, S) long model inputs
    coords: torch.Tensor  # (S, 3) long RoPE coordinates
    targets: torch.Tensor  # (B, S) long, IGNORE where no loss
    mask: torch.Tensor | BlockMask | None  # dense (S, S) bool, BlockMask, or None: plain causal (SDPA is_causal)


def next_token_targets(clip: torch.Tensor, layout: Layout, frames: int, action_loss: bool) -> torch.Tensor:
    """(B, N) clip -> (B, N) targets: slot p predicts clip[p+1]; only image tokens (and actions if asked)."""
    targets = torch.full_like(clip, IGNORE)
    targets[:, :-1] = clip[:, 1:]
    keep = layout.is_image(frames).to(clip.device)
    if action_loss:
        keep = torch.ones_like(keep)
    keep = torch.cat([keep[1:], keep.new_zeros(1)])  # the target slot is p+1
    return torch.where(keep, targets, torch.full_like(targets, IGNORE))


def check_clip(clip: torch.Tensor, layout: Layout, frames: int) -> None:
    n = layout.n_slots(frames)
    if clip.dim() != 2 or clip.shape[1] != n:
        raise ValueError(f"clip has shape {tuple(clip.shape)}, the layout wants (B, {frames} frames x "
                         f"{layout.frame_len} = {n})")


class CausalMask:
    """Pre-training: the plain causal mask over the flat clip."""

    name = "causal"
    plain_causal = True  # False in subclasses with their own table

    def __init__(self, layout: Layout, frames: int, action_loss: bool = False, backend: str = "auto"):
        self.layout, self.frames, self.action_loss, self.backend = layout, frames, action_loss, backend
        self.coords = layout.coords(frames)

    def table(self, device=None) -> SlotTable:
        return causal_table(self.layout.n_slots(self.frames), device)

    @lru_cache(maxsize=4)
    def _mask(self, device: torch.device):
        if resolve_backend(self.backend, device) == "flex":
            return self.table(device).block_mask()
        # the plain causal table needs no dense mask: SDPA's is_causal takes its fast CPU kernel (~1.3x a tiny step)
        return None if self.plain_causal else self.table(device).dense()

    def __call__(self, clip: torch.Tensor) -> MaskedBatch:
        """clip (B, N) long, N = frames * frame_len."""
        check_clip(clip, self.layout, self.frames)
        return MaskedBatch(
            tokens=clip,
            coords=self.coords.to(clip.device),
            targets=next_token_targets(clip, self.layout, self.frames, self.action_loss),
            mask=self._mask(clip.device),
        )


def build_mask_factory(name: str, layout: Layout, frames: int, **kwargs):
    """mask=<name> from the config -> a mask factory."""
    from mcar.diagd_mask import FACTORIES as DIAGD  # here, not at the top: diagd_mask imports this module

    factories = {"causal": CausalMask, **DIAGD}
    if name not in factories:
        raise ValueError(f"mask.name={name!r} is unknown; choose one of {sorted(factories)}")
    return factories[name](layout, frames, **kwargs)
