"""Crafter's view as tokens (the tile-exact setting: one tile per token, a move an exact one-token shift): where
the map and the inventory rows are, which start tiles a walk hides and brings back, a map shifted by a move, the
start frame scrolled by the true movement (the rollouts' oracle), and the creatures' comings and goings.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mcar.core.layout import Layout
from mcar.crafter.gen import MOVE_DELTA

CREATURE_EVENTS = ("creatures", "entered", "left", "popped")


@dataclass(frozen=True)
class MapGrid:
    """Where the map is in a frame's token grid: rows [0, map_h) (the inventory rows below), the player drawn at
    (player_row, player_col) (Crafter's view centre: grid // 2)."""

    map_h: int
    w: int

    @property
    def player(self) -> tuple[int, int]:
        return self.map_h // 2, self.w // 2

    def maps(self, images: torch.Tensor) -> torch.Tensor:
        """(..., h, w) image tokens -> (..., map_h, w) map tokens."""
        return images[..., :self.map_h, :]

    def inventory(self, images: torch.Tensor) -> torch.Tensor:
        """(..., h, w) image tokens -> (..., h - map_h, w) the inventory rows below the map."""
        return images[..., self.map_h:, :]


def rerevealed_mask(grid: MapGrid, dx: int, dy: int) -> torch.Tensor:
    """(map_h, w) bool: the start view's tiles that are out of view once the view has moved by (dx, dy) tiles."""
    r, c = torch.meshgrid(torch.arange(grid.map_h), torch.arange(grid.w), indexing="ij")
    r, c = r - dy, c - dx  # where each start tile sits in the moved view
    return (r < 0) | (r >= grid.map_h) | (c < 0) | (c >= grid.w)


def hidden_mask(grid: MapGrid, offsets) -> torch.Tensor:
    """(map_h, w) bool: the start view's tiles out of view at any of the view's (dx, dy) offsets (a walk's)."""
    out = torch.zeros(grid.map_h, grid.w, dtype=torch.bool)
    for dx, dy in offsets:
        out |= rerevealed_mask(grid, int(dx), int(dy))
    return out


def far_mask(grid: MapGrid, offsets) -> torch.Tensor:
    """(map_h, w) bool: the start view's tiles out of view in both frames before a walk's last (its (dx, dy)
    offsets): no copy from two frames back, the memory an out-and-back loop teaches, brings them back."""
    offsets = [(int(dx), int(dy)) for dx, dy in offsets]
    if len(offsets) < 3:
        return torch.zeros(grid.map_h, grid.w, dtype=torch.bool)
    return rerevealed_mask(grid, *offsets[-2]) & rerevealed_mask(grid, *offsets[-3])


def masked_recall(end_maps: torch.Tensor, start_maps: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """end_maps, start_maps (B, map_h, w), masks (B, map_h, w) bool -> (B,) share of the masked tiles where the end
    frame equals the start frame (NaN where a mask is empty)."""
    same = (end_maps == start_maps) & masks
    return same.flatten(1).sum(1).double() / masks.flatten(1).sum(1).double()


def loop_recall(end_maps: torch.Tensor, start_maps: torch.Tensor, grid: MapGrid, far: torch.Tensor) -> torch.Tensor:
    """end_maps, start_maps (B, map_h, w), far (B, 2) the view's (dx, dy) at the loop's far end -> (B,) share of the
    re-revealed tiles where the end frame equals the start frame."""
    masks = torch.stack([rerevealed_mask(grid, dx, dy) for dx, dy in far.tolist()])
    return masked_recall(end_maps, start_maps, masks)


def creature_events(maps: torch.Tensor, codes: torch.Tensor, moves: torch.Tensor) -> dict[str, torch.Tensor]:
    """maps (B, T, h, w) map codes, codes the creatures' (creature_codes), moves (B, T-1, 2) the player's true
    (dx, dy) from each frame to the next -> {name: (B,)} per frame over frames 1..T-1: `creatures` (creature
    tiles), `entered` (new creatures on the view's edge: no creature of the frame before, scrolled by the move,
    within one tile: a creature steps one tile a turn), `left` (creatures of the frame before, scrolled, off the
    view or on its edge with no creature within one tile now), `popped` (creatures that appeared or vanished
    inside the view: the game only does that when one is killed or spawns). Matching is by distance, not identity:
    two creatures passing are not told apart."""
    B, T, h, w = maps.shape
    is_c = torch.isin(maps, codes).float()
    inside = torch.zeros(h + 2, w + 2, dtype=torch.bool)  # the view padded by a ring of just-out-of-view tiles
    inside[2:h, 2:w] = True  # the view less its edge
    out = {k: torch.zeros(B, dtype=torch.float64) for k in CREATURE_EVENTS}
    near = lambda x: torch.nn.functional.max_pool2d(x[None, None], 3, 1, 1)[0, 0] > 0
    for b in range(B):
        for t in range(1, T):
            dx, dy = (int(v) for v in moves[b, t - 1])
            prev = torch.zeros(h + 2 + 2 * abs(dy), w + 2 + 2 * abs(dx))
            cur = torch.zeros(h + 2, w + 2)
            cur[1:h + 1, 1:w + 1] = is_c[b, t]
            # the frame before as seen from the new view: a creature at (r, c) sits at (r - dy, c - dx)
            r0, c0 = 1 + abs(dy) - dy, 1 + abs(dx) - dx
            prev[r0:r0 + h, c0:c0 + w] = is_c[b, t - 1]
            prev = prev[abs(dy):abs(dy) + h + 2, abs(dx):abs(dx) + w + 2]
            new = (cur > 0) & ~near(prev)
            gone = (prev > 0) & ~near(cur)
            out["creatures"][b] += float(is_c[b, t].sum())
            out["entered"][b] += float((new & ~inside).sum())
            out["left"][b] += float((gone & ~inside).sum())
            out["popped"][b] += float((new & inside).sum() + (gone & inside).sum())
    return {k: v / max(T - 1, 1) for k, v in out.items()}


def shifted(maps: torch.Tensor, dx: int, dy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., H, W) map tokens -> (the map the view shows after moving (dx, dy) tiles, (H, W) bool where it is known:
    the tiles that were in view before)."""
    H, W = maps.shape[-2:]
    out, known = torch.zeros_like(maps), torch.zeros(H, W, dtype=torch.bool)
    r0, r1, c0, c1 = max(0, -dy), min(H, H - dy), max(0, -dx), min(W, W - dx)
    if r0 >= r1 or c0 >= c1:  # moved a whole view away: nothing known (a negative slice bound would wrap round)
        return out, known
    out[..., r0:r1, c0:c1] = maps[..., r0 + dy:r1 + dy, c0 + dx:c1 + dx]
    known[r0:r1, c0:c1] = True
    return out, known


def scroll_start(clips: torch.Tensor, positions: list[list], grid: MapGrid, layout: Layout, prompt: int
                 ) -> torch.Tensor:
    """(B, N) clips and each one's player positions per frame -> a copy whose frames >= prompt show the last prompt
    frame's map scrolled by the player's true movement since: the floor a greedy model must beat ("scroll the start
    frame by the true movement"). Tiles that come into view keep what the start frame showed there; the player's
    tile and the inventory rows stay the start frame's; every action stays the clip's own."""
    out = clips.clone()
    images = out.view(out.shape[0], -1, layout.frame_len)[..., :layout.frame_tokens].unflatten(-1, (layout.h,
                                                                                                     layout.w))
    start = images[:, prompt - 1].clone()
    pr, pc = grid.player
    for b, pos in enumerate(positions):
        for t in range(prompt, images.shape[1]):
            moved, known = shifted(grid.maps(start[b]), pos[t][0] - pos[prompt - 1][0],
                                   pos[t][1] - pos[prompt - 1][1])
            known[pr, pc] = False
            frame = start[b].clone()
            frame[:grid.map_h][known] = moved[known]
            images[b, t] = frame
    return out


def stay_or_move(prev: torch.Tensor, nxt: torch.Tensor, moves: torch.Tensor, grid: MapGrid
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """prev, nxt (B, map_h, w) maps before and after a move action, moves (B,) its action ids -> (agreement of nxt
    with prev, agreement with prev shifted one tile the move's way), each (B,), over the tiles both know, the
    player's tile left out."""
    stay, move = [], []
    pr, pc = grid.player
    for p, n, a in zip(prev, nxt, moves.tolist()):
        s, known = shifted(p, *MOVE_DELTA[a])
        known = known.clone()
        known[pr, pc] = False
        stay.append((n[known] == p[known]).double().mean())
        move.append((n[known] == s[known]).double().mean())
    return torch.stack(stay), torch.stack(move)
