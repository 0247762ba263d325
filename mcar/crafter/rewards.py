"""Crafter's reward terms for `mcar posttrain` (each a `_target_` in `posttrain.rewards`, beside the generic ones of
mcar/train/rewards.py): terms that read Crafter's own geometry (the map above the inventory, the player at its
centre) or its textures (the creatures' codes).

- `CreatureCount`: per frame, how near the number of creatures drawn is to the true frame's (the creatures' codes
  from the game's textures and the run's VQ), wherever they are: agreement alone pays a model to leave out
  creatures it cannot place (RESULTS.md, "Creatures").
- `CreatureTolerantAgreement`: tile agreement where a creature drawn within `reach` tiles of the true one (the same
  code, each paired once) counts as right on both tiles: a creature a tile off then costs nothing, one left out or
  made up one tile, so leaving out what cannot be placed no longer pays.
- `RevisitedTiles` (memory, verifiable): agreement on the tiles that come back into view having left it while an
  earlier frame of the model's window still showed them (waits, L-shapes, returns): the few tiles only memory can
  get right, weighted apart from the whole frame's agreement, where they are a percent of the tokens.
"""
from __future__ import annotations

import torch

from mcar.crafter.gen import map_rows
from mcar.crafter.textures import creature_codes, tile_textures
from mcar.tokenizer.vq_model import downsample, load_vq
from mcar.train.rewards import Rollouts


class RevisitedTiles:
    """The share of generated map tiles equal to the simulator's among the revisited ones: at frame t >=
    prompt_frames, a tile of the world in view at t, out of view at t-1, and in view at some frame of the model's
    window before that (t-context+1 .. t-2), so the frame before cannot tell it and memory can. 0 for a clip with
    none: the same for its whole group, so it moves no advantage. The map is the view's rows above the inventory
    (Crafter's; the player drawn at their centre)."""

    def __call__(self, r: Rollouts) -> torch.Tensor:
        if r.positions is None or r.context is None:
            raise ValueError("posttrain.rewards: RevisitedTiles needs the player's positions and the model's window "
                             "(the Crafter starts of `mcar posttrain` give them)")
        gen, real = r.images()
        mask = revisited_mask(r.positions.to(gen.device), map_rows((r.layout.w, r.layout.h)), r.layout.w,
                              r.context)[:, r.prompt_frames:]
        h = mask.shape[-2]
        same = (gen[:, r.prompt_frames:, :h] == real[:, r.prompt_frames:, :h]) & mask
        return same.flatten(1).sum(1).float() / mask.flatten(1).sum(1).clamp(min=1).float()



def revisited_mask(positions: torch.Tensor, map_h: int, w: int, context: int) -> torch.Tensor:
    """(B, T, 2) the player's world (x, y) per frame -> (B, T, map_h, w) bool: the view's tiles at t out of view at
    t-1 and in view at some frame of t-context+1 .. t-2 (the view is map_h x w tiles, the player at its centre)."""
    B, T = positions.shape[:2]
    r, c = torch.meshgrid(torch.arange(map_h, device=positions.device), torch.arange(w, device=positions.device),
                          indexing="ij")
    x = positions[..., 0, None, None] + c - w // 2  # (B, T, map_h, w) each tile's world x
    y = positions[..., 1, None, None] + r - map_h // 2

    def seen_at(s: int, t: int) -> torch.Tensor:  # frame t's tiles in frame s's view
        px, py = positions[:, s, 0, None, None], positions[:, s, 1, None, None]
        return ((x[:, t] - px).abs() <= w // 2) & ((y[:, t] - py).abs() <= map_h // 2)

    out = torch.zeros(B, T, map_h, w, dtype=torch.bool, device=positions.device)
    for t in range(2, T):
        earlier = [seen_at(s, t) for s in range(max(0, t - context + 1), t - 1)]  # none in a 2-frame window
        if earlier:
            out[:, t] = torch.stack(earlier).any(0) & ~seen_at(t - 1, t)
    return out



class CreatureCount:
    """Per frame >= prompt_frames, 1 - |creatures drawn - creatures in the true frame| / (their sum), 1 where both
    have none, averaged over frames. A creature is a tile whose code only Crafter's creature textures have
    (mcar.crafter.textures.creature_codes under `vq`, the run's VQ folder: `vq: ${vq.path}`)."""

    def __init__(self, vq: str):
        model = load_vq(vq)
        self.codes, _ = creature_codes(model, tile_textures(downsample(model)))
        if not len(self.codes):
            raise ValueError(f"posttrain.rewards: CreatureCount vq={vq}: this VQ gives no creature a code of its own")

    def __call__(self, r: Rollouts) -> torch.Tensor:
        gen, real = r.images()
        P, codes = r.prompt_frames, self.codes.to(gen.device)
        n_gen, n_real = (torch.isin(x[:, P:], codes).flatten(2).sum(-1).float() for x in (gen, real))
        return (1 - (n_gen - n_real).abs() / (n_gen + n_real).clamp(min=1)).mean(1)


class CreatureTolerantAgreement:
    """The share of generated image tokens equal to the simulator's (frames >= prompt_frames), where a creature
    drawn off its true tile still counts: each drawn creature the true frame lacks there is paired with at most one
    true creature of the same code the generated frame lacks, within `reach` tiles (Chebyshev), nearest first, and
    both tiles of a pair count as right. A creature's code as in CreatureCount (`vq: ${vq.path}`)."""

    def __init__(self, vq: str, reach: int = 1):
        if int(reach) < 0:
            raise ValueError(f"posttrain.rewards: CreatureTolerantAgreement reach={reach}: tiles, >= 0 (0: plain "
                             f"agreement)")
        self.codes, self.reach = CreatureCount(vq).codes, int(reach)

    def __call__(self, r: Rollouts) -> torch.Tensor:
        gen, real = r.images()
        gen, real = gen[:, r.prompt_frames:], real[:, r.prompt_frames:]
        right = gen == real
        codes = self.codes.to(gen.device)
        drawn, true = torch.isin(gen, codes) & ~right, torch.isin(real, codes) & ~right
        for b, t in torch.nonzero((drawn.flatten(2).any(-1) & true.flatten(2).any(-1))).tolist():
            for g, q in paired_creatures(drawn[b, t], true[b, t], gen[b, t], real[b, t], self.reach):
                right[b, t][g] = right[b, t][q] = True
        return right.float().flatten(1).mean(1)


def paired_creatures(drawn: torch.Tensor, true: torch.Tensor, gen: torch.Tensor, real: torch.Tensor, reach: int
                     ) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(h, w) masks of one frame's unmatched drawn and true creatures and its codes -> pairs ((row, col) drawn,
    (row, col) true) of the same code within reach, nearest first, each tile in at most one pair."""
    ds, ts = [tuple(x) for x in torch.nonzero(drawn).tolist()], [tuple(x) for x in torch.nonzero(true).tolist()]
    near = sorted((max(abs(a[0] - c[0]), abs(a[1] - c[1])), a, c) for a in ds for c in ts
                  if int(gen[a]) == int(real[c]))
    pairs, used = [], set()
    for dist, a, c in near:
        if dist <= reach and a not in used and c not in used:
            pairs.append((a, c))
            used.update((a, c))
    return pairs
