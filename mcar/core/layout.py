"""The flat clip layout of docs/diagd.md section 1, and the ONE slot -> 3D coordinate function.

A clip of T frames is T blocks of `frame_len = h*w + n_a` slots: the frame's h×w image tokens in raster
order, then the n_a action tokens taken after seeing that frame.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    h: int  # token rows per frame
    w: int  # token columns per frame
    n_a: int  # action tokens per frame

    def __post_init__(self):
        for name in ("h", "w"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_a < 0:
            raise ValueError(f"layout.n_a must be >= 0, got {self.n_a}")

    @classmethod
    def of(cls, data) -> "Layout":
        """The layout of a data config (anything with h, w and n_a: the `data` group)."""
        return cls(int(data.h), int(data.w), int(data.n_a))

    @property
    def frame_tokens(self) -> int:
        return self.h * self.w

    @property
    def frame_len(self) -> int:
        return self.h * self.w + self.n_a

    def n_slots(self, frames: int) -> int:
        return frames * self.frame_len

    def pos(self, t: int, i: int, j: int) -> int:
        """Slot of image token c[t, i, j]."""
        return t * self.frame_len + i * self.w + j

    def action_pos(self, t: int, m: int) -> int:
        """Slot of action token a[t, m]."""
        return t * self.frame_len + self.frame_tokens + m

    def coords(self, frames: int) -> torch.Tensor:
        """(frames*frame_len, 4) long: the RoPE coordinates of every slot, (time, row, col, position).

        3D RoPE reads the first three: image token c[t,i,j] -> (t+1, i+1, j+1); action a[t,m] -> (t+1, h+1, m+1),
        a virtual row below the frame; 1-based so that no slot gets a zero (identity) rotation on any axis.
        1D RoPE (model.rope=1d, LLaMA / MineWorld) reads the last: the slot's 0-based index in the flat clip.
        """
        t = torch.arange(frames).repeat_interleave(self.frame_len)
        r = torch.arange(self.frame_len)
        is_img = r < self.frame_tokens
        row = torch.where(is_img, r // self.w, torch.full_like(r, self.h))
        col = torch.where(is_img, r % self.w, r - self.frame_tokens)
        pos = torch.arange(frames * self.frame_len)
        return torch.stack([t + 1, row.repeat(frames) + 1, col.repeat(frames) + 1, pos], dim=-1)

    def is_image(self, frames: int) -> torch.Tensor:
        """(frames*frame_len,) bool: True at image-token slots."""
        return (torch.arange(self.frame_len) < self.frame_tokens).repeat(frames)


def check_clip(clip, layout: Layout, frames: int) -> None:
    """A (B, N) batch of clips of `frames` frames in `layout`, or a ValueError saying what shape was expected."""
    n = layout.n_slots(frames)
    if clip.dim() != 2 or clip.shape[1] != n:
        raise ValueError(f"clip has shape {tuple(clip.shape)}, the layout wants (B, {frames} frames x "
                         f"{layout.frame_len} = {n})")
