"""A synthetic world with the real layout, for tests and debugging.

Frame 0 is random codebook tokens; each action rolls the frame by one token (stay, left, right, up, down), so
the next frame is a deterministic function of the previous one and the action: a model can learn it.
"""
from __future__ import annotations

import numpy as np
import torch

from mcar.core.layout import Layout
from mcar.data.common import ClipDataModule, check_vocab

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
        hw = lay.h * lay.w
        frame = torch.randint(0, self.codebook_size, (lay.h, lay.w), generator=g).numpy()
        # one draw for all frames: the same generator stream as one draw per frame, at a fraction of the cost
        actions = torch.randint(0, len(SHIFTS), (self.frames,), generator=g).tolist() if lay.n_a else \
            [0] * self.frames
        tiled = np.tile(frame, (2, 2))  # every roll of the frame is a (h, w) window of it
        out = np.empty((self.frames, hw + lay.n_a), np.int64)
        dr = dc = 0  # the roll so far
        for t, action in enumerate(actions):
            out[t, :hw].reshape(lay.h, lay.w)[...] = tiled[lay.h - dr:2 * lay.h - dr, lay.w - dc:2 * lay.w - dc]
            out[t, hw:] = self.codebook_size + action  # ids live after the codebook
            r, c = SHIFTS[action]
            dr, dc = (dr + r) % lay.h, (dc + c) % lay.w
        return torch.from_numpy(out.reshape(-1))


class SyntheticDataModule(ClipDataModule):
    def __init__(self, h: int, w: int, n_a: int, codebook_size: int, action_vocab_size: int, clip_frames: int,
                 batch_size: int, train_clips: int = 256, val_clips: int = 8, seed: int = 0,
                 num_workers: int | None = None, name: str | None = None, vocab_size: int | None = None):
        super().__init__(Layout(h, w, n_a), clip_frames, batch_size, seed, num_workers, val_clips)
        check_vocab(codebook_size, action_vocab_size, vocab_size)
        self.name = name
        self.codebook_size, self.action_vocab_size, self.train_clips = codebook_size, action_vocab_size, train_clips

    def make_sources(self):
        make = lambda n, s: SyntheticClips(self.layout, self.clip_frames, self.codebook_size,
                                           self.action_vocab_size, n, s)
        return make(self.train_clips, 2 * self.seed), make(self.val_clips, 2 * self.seed + 1)
