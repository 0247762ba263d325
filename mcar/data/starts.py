"""Post-training's batches: fresh simulator worlds, step by step (`mcar posttrain`'s `posttrain.data`).

A source maps a world seed to that world's true clips under a policy, each with the player's (frames, 2) positions:
[(clip (frames * frame_len,), positions)], [] when the world ended before its clips did (a `dead` count says how
many); Crafter's is mcar.crafter.starts.CrafterStarts. Step s of rank r takes worlds from seed
`seed_base + (s * world + r) * 4 * starts` on (room for skipped worlds), so a resumed run goes on with the worlds
after the last step it finished and no two ranks share one.
"""
from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from mcar.data.common import StepsFrom


class StepStarts(Dataset):
    """Item s: the (starts, N) true clips of step s for this rank, with the player's (starts, frames, 2) world
    positions and their world seeds."""

    def __init__(self, source, starts: int, seed_base: int, rank: int = 0, world: int = 1):
        self.source, self.starts, self.seed_base, self.rank, self.world = source, starts, seed_base, rank, world

    def __len__(self) -> int:  # endless; the trainer stops at max_steps
        return 2**40

    def __getitem__(self, step: int) -> dict:
        first = self.seed_base + (step * self.world + self.rank) * self.starts * 4  # 4x room for skipped worlds
        made, seeds = [], []
        for seed in range(first, first + 4 * self.starts):
            clips = self.source(seed)[:self.starts - len(made)]
            made += clips
            seeds += [seed] * len(clips)
            if len(made) == self.starts:
                return {"tokens": torch.stack([c for c, _ in made]), "positions": torch.stack([p for _, p in made]),
                        "world_seed": torch.tensor(seeds), "dead": torch.tensor(getattr(self.source, "dead", 0))}
        raise RuntimeError(f"step {step}: only {len(made)} of {self.starts} clips from {4 * self.starts} worlds from "
                           f"seed {first} (the player died): lower the source's warm-up or the clip's frames")


class StartsDataModule(L.LightningDataModule):
    """The training batches of `mcar posttrain`: `starts` fresh worlds per step from `source` (world seed -> its
    true clips; no validation set: the rollouts are scored against the simulator as they are made)."""

    def __init__(self, source, starts: int = 2, seed_base: int = 1_000_000):
        super().__init__()
        if starts < 1:
            raise ValueError(f"posttrain.starts={starts}: at least one start per step")
        self.source, self.starts, self.seed_base = source, starts, seed_base

    def train_dataloader(self) -> DataLoader:
        t = self.trainer
        rank, world = (t.global_rank, t.world_size) if t is not None else (0, 1)
        start = t.global_step if t is not None else 0  # restored on resume before the loaders are built
        return DataLoader(StepStarts(self.source, self.starts, self.seed_base, rank, world), batch_size=None,
                          sampler=StepsFrom(start), num_workers=0)
