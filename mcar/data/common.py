"""What every data source shares: clip sources, a step-indexed batch order, and the LightningDataModule.

Exact resume: the batch of global step s on rank r is a pure function of (seed, s, r). The train loader is a
sequence of steps starting at the trainer's restored global step, so a resumed run sees exactly the batches
an uninterrupted one would have seen.
"""
from __future__ import annotations

from typing import Protocol

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mcar.layout import Layout


class ClipSource(Protocol):
    """A set of clips in the DIAGD.md layout: `clip(i)` is a (frames * frame_len,) long tensor."""

    layout: Layout
    frames: int

    def __len__(self) -> int: ...

    def clip(self, i: int) -> torch.Tensor: ...


def clip_indices(n_clips: int, batch_size: int, seed: int, step: int, rank: int = 0, world: int = 1) -> list[int]:
    """The clips of rank `rank` at global step `step`: walk seeded per-epoch permutations of all clips."""
    per_step = batch_size * world
    first = step * per_step + rank * batch_size
    out = []
    for g in range(first, first + batch_size):
        epoch, k = divmod(g, n_clips)
        perm = torch.randperm(n_clips, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(int(perm[k]))
    return out


class StepBatches(Dataset):
    """Item s is the whole (B, N) batch of global step s for this rank."""

    def __init__(self, source: ClipSource, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        if len(source) == 0:
            raise ValueError("the training set has no usable clips")
        self.source, self.batch_size, self.seed, self.rank, self.world = source, batch_size, seed, rank, world

    def __len__(self) -> int:  # effectively endless; the trainer stops at max_steps
        return 2**62

    def indices(self, step: int) -> list[int]:
        return clip_indices(len(self.source), self.batch_size, self.seed, step, self.rank, self.world)

    def __getitem__(self, step: int) -> dict:
        idx = self.indices(step)
        return {"tokens": torch.stack([self.source.clip(i) for i in idx]), "clip_index": torch.tensor(idx)}


class StepsFrom(Sampler):
    """Yields step numbers start, start+1, ... (the trainer stops the loop)."""

    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        s = self.start
        while True:
            yield s
            s += 1

    def __len__(self) -> int:
        return 2**62


class ClipDataModule(L.LightningDataModule):
    """Wraps a train and a val ClipSource; subclasses implement `make_sources()` (and `prepare_data()`)."""

    def __init__(self, layout: Layout, clip_frames: int, batch_size: int, seed: int = 0, num_workers: int = 0,
                 val_clips: int = 8):
        super().__init__()
        if clip_frames < 2:
            raise ValueError(f"data.clip_frames must be >= 2 (a prompt frame and a target), got {clip_frames}")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.layout, self.clip_frames, self.batch_size = layout, clip_frames, batch_size
        self.seed, self.num_workers, self.val_clips = seed, num_workers, val_clips
        self.train_source: ClipSource | None = None
        self.val_source: ClipSource | None = None

    def make_sources(self) -> tuple[ClipSource, ClipSource]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_source is None:
            self.train_source, self.val_source = self.make_sources()

    def _rank_world(self) -> tuple[int, int]:
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        start = 0
        if self.trainer is not None:  # restored on resume before the loaders are built
            start = self.trainer.global_step * self.trainer.accumulate_grad_batches
        ds = StepBatches(self.train_source, self.batch_size, self.seed, rank, world)
        return DataLoader(ds, batch_size=None, sampler=StepsFrom(start), num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        n = min(self.val_clips, len(self.val_source))
        if n == 0:
            raise ValueError("the validation set has no usable clips")
        clips = torch.stack([self.val_source.clip(i) for i in range(n)])
        rank, world = self._rank_world()
        mine = clips[rank::world] if len(clips) >= world else clips
        batches = [{"tokens": b} for b in mine.split(self.batch_size)]
        return DataLoader(batches, batch_size=None)
