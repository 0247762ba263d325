"""A synthetic world with the real layout, for tests and debugging.

Frame 0 is random codebook tokens; each action rolls the frame by one token (stay, left, right, up, down), so
the next frame is a deterministic function of the previous one and the action: a model can learn it.
"""
from __future__ import annotations

import torch

from mcar.data.common import ClipDataModule
from mcar.layout import Layout

SHIFTS = [(0, 0), (0, -1), (0, 1), (-1, 0), (1, 0)]  # (rows, cols) per action id


class SyntheticClips:
    def __init__(self, layout: Layout, frames: int, codebook_size: int, action_vocab_size: int, n_clips: int,
                 seed: int):
        if action_vocab_size < len(SHIFTS) and layout.n_a > 0:
            raise ValueError(f"data.action_vocab_size must be >= {len(SHIFTS)} for synthetic data")
        self.layout, self.frames, self.codebook_size = layout, frames, codebook_size
        self.action_vocab_size, self.n_clips, self.seed = action_vocab_size, n_clips, seed

    def __len__(self) -> int:
        return self.n_clips

    def clip(self, i: int) -> torch.Tensor:
        lay, g = self.layout, torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        frame = torch.randint(0, self.codebook_size, (lay.h, lay.w), generator=g)
        out = []
        for _ in range(self.frames):
            action = int(torch.randint(0, len(SHIFTS), (1,), generator=g)) if lay.n_a else 0
            acts = torch.full((lay.n_a,), self.codebook_size + action)  # ids live after the codebook
            out += [frame.flatten(), acts]
            frame = frame.roll(SHIFTS[action], dims=(0, 1))
        return torch.cat(out)


class SyntheticDataModule(ClipDataModule):
    def __init__(self, h: int, w: int, n_a: int, codebook_size: int, action_vocab_size: int, clip_frames: int,
                 batch_size: int, train_clips: int = 256, val_clips: int = 8, seed: int = 0, num_workers: int = 0,
                 **_):
        super().__init__(Layout(h, w, n_a), clip_frames, batch_size, seed, num_workers, val_clips)
        self.codebook_size, self.action_vocab_size, self.train_clips = codebook_size, action_vocab_size, train_clips

    def make_sources(self):
        make = lambda n, s: SyntheticClips(self.layout, self.clip_frames, self.codebook_size,
                                           self.action_vocab_size, n, s)
        return make(self.train_clips, 2 * self.seed), make(self.val_clips, 2 * self.seed + 1)
