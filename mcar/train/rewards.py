"""Post-training rewards: pluggable terms, each one small class, listed with weights in `posttrain.rewards`.

A term maps a batch of rollouts (`Rollouts`: the generated clips and the simulator's true clips under the same
actions) to one value per rollout, higher is better; the reward is the weighted sum. Every term is logged
(`reward/<name>`), weight 0 included: a run optimising one term shows what happens to the others, which is how a
reward that gets gamed is caught (RLIR found a pixel-distance reward turning videos darker). To add one: a class
with `__call__(rollouts) -> (B,)` in a file, and its `_target_` in the config list. A simulator's own terms live
with it (Crafter's creatures and revisited tiles: mcar/crafter/rewards.py).

- `TileAgreement` (verifiable): the share of generated image tokens equal to the simulator's (or of some rows:
  the inventory's, weighted apart).
- `ActionMatch` (RLIR): the share of commanded actions the inverse-dynamics model reads back off the generated
  consecutive frames.
- `NoInventedTiles` (a guard): the share of generated tiles whose tile type (code) is in the true frame or the prompt;
  a rollout that paints plausible-looking tiles from nowhere to please the IDM loses it.
- `TileMix`: 1 - the total-variation distance between each generated frame's mix of codes and the true frame's,
  wherever the tiles are. Agreement alone pays a model to leave out what it cannot place (a creature drawn one tile
  off costs two tiles, one left out costs one); the mix pays it back for drawing what is there.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mcar.core.agreement import histogram_distance
from mcar.core.layout import Layout
from mcar.idm.model import read_idm
from mcar.idm.scores import frame_pairs
from mcar.tokenizer.clips import split_clip


@dataclass
class Rollouts:
    generated: torch.Tensor  # (B, N) clips, generated frames filled in
    real: torch.Tensor  # (B, N) the simulator's clips under the same actions
    layout: Layout
    codebook_size: int
    prompt_frames: int
    positions: torch.Tensor | None = None  # (B, T, 2) the player's world (x, y) per frame, from the simulator
    context: int | None = None  # frames the model saw at once (the sampler's window)

    def images(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, h, w) image tokens of the generated and the true clips."""
        return split_clip(self.generated, self.layout, self.codebook_size)[0], \
            split_clip(self.real, self.layout, self.codebook_size)[0]


class TileAgreement:
    """The share of generated image tokens equal to the simulator's (frames >= prompt_frames); `rows` [first, stop)
    scores only those rows of the image (Python slice bounds, null: all), e.g. [7, 9], the inventory of the 9x9
    tile-exact view, as a term of its own beside the whole frame's."""

    def __init__(self, rows: list | None = None):
        if rows is not None and len(rows) != 2:
            raise ValueError(f"posttrain.rewards: TileAgreement rows={rows}: [first, stop) of the image rows, or null")
        self.rows = slice(*rows) if rows is not None else slice(None)

    def __call__(self, r: Rollouts) -> torch.Tensor:
        gen, real = r.images()
        P = r.prompt_frames
        gen, real = gen[:, P:, self.rows], real[:, P:, self.rows]
        if gen.numel() == 0:
            raise ValueError(f"posttrain.rewards: TileAgreement rows {self.rows} select none of the image's "
                             f"{r.layout.h} rows")
        return (gen == real).float().flatten(1).mean(1)


class ActionMatch:
    """The share of commanded actions an inverse-dynamics model (`idm`: a file of `mcar idm`, loaded weights only)
    reads back off the generated frames, over the pairs (t, t+1) with t + 1 >= prompt_frames."""

    def __init__(self, idm: str | None):
        if not idm or not Path(idm).is_file():
            raise FileNotFoundError(f"posttrain.rewards.action.idm={idm}: an inverse-dynamics model file is needed "
                                    f"(mcar idm writes checkpoints/idm-<data>/idm.pt; shipped: "
                                    f"checkpoints/shipped/idm-<data>/idm.pt), or drop the term")
        self.idm = read_idm(idm).eval()

    def __call__(self, r: Rollouts) -> torch.Tensor:
        c = self.idm.config
        if (c["codebook_size"], c["n_a"]) != (r.codebook_size, r.layout.n_a):
            raise ValueError(f"posttrain.rewards.action.idm: the IDM reads codebook {c['codebook_size']}, n_a "
                             f"{c['n_a']}; the model's data has {r.codebook_size}, {r.layout.n_a}")
        self.idm.to(r.generated.device)
        a, b, actions = frame_pairs(r.generated, r.layout, r.codebook_size, first=r.prompt_frames - 1)
        hit = (self.idm.predict(a, b) == actions).float().mean(1)  # (B * pairs,)
        return hit.view(len(r.generated), -1).mean(1)


class NoInventedTiles:
    """The share of generated tiles whose code is in the true frame or in a prompt frame (1: nothing invented)."""

    def __call__(self, r: Rollouts) -> torch.Tensor:
        gen, real = r.images()
        B, T = gen.shape[:2]
        P, cb = r.prompt_frames, r.codebook_size
        seen = torch.zeros(B, T, cb + 1, dtype=torch.bool, device=gen.device)
        seen.scatter_(2, real.flatten(2).clamp(max=cb), True)  # each true frame's codes
        prompt = torch.zeros(B, cb + 1, dtype=torch.bool, device=gen.device)
        prompt.scatter_(1, real[:, :P].flatten(1).clamp(max=cb), True)
        allowed = seen | prompt[:, None]
        ok = allowed.gather(2, gen.flatten(2).clamp(max=cb))  # (B, T, hw)
        return ok[:, P:].float().flatten(1).mean(1)


class TileMix:
    """1 - the total-variation distance between each generated frame's histogram of codes and the true frame's
    (mcar.core.agreement.histogram_distance), averaged over frames >= prompt_frames: 1 when every frame has the right
    tiles in the right numbers, wherever they are drawn."""

    def __call__(self, r: Rollouts) -> torch.Tensor:
        gen, real = r.images()
        P = r.prompt_frames
        return 1 - histogram_distance(gen[:, P:], real[:, P:], r.codebook_size).mean(1)


@dataclass
class RewardTerm:
    name: str
    fn: object
    weight: float


def total_reward(terms: list[RewardTerm], rollouts: Rollouts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-> (B,) weighted sum, and each term's (B,) values by name (every term, weight 0 included)."""
    values = {t.name: t.fn(rollouts).float() for t in terms}
    total = sum(t.weight * values[t.name] for t in terms)
    return total, values
