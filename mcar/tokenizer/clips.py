"""Clips in the docs/diagd.md layout, both ways: per frame its h*w image ids (raster order), then its n_a action ids
+ codebook_size. `join_clip` builds a clip from frames and local action ids, `split_clip` takes clips apart."""
from __future__ import annotations

import numpy as np
import torch
from einops import rearrange

from mcar.core.layout import Layout


def join_clip(images, actions, codebook_size: int) -> torch.Tensor:
    """images (T, h, w) or (T, h*w) token ids, actions (T, n_a) local action ids -> (T * frame_len,) long clip."""
    if isinstance(images, np.ndarray) and isinstance(actions, np.ndarray):  # shards: one int64 buffer, no copies
        T = len(images)
        ft = int(np.prod(images.shape[1:], dtype=np.int64))
        out = np.empty((T, ft + int(np.prod(actions.shape[1:], dtype=np.int64))), np.int64)
        out[:, :ft] = images.reshape(T, ft)
        np.add(actions.reshape(T, -1), codebook_size, out=out[:, ft:], casting="unsafe")
        return torch.from_numpy(out.reshape(-1))
    img = torch.as_tensor(np.asarray(images, np.int64) if isinstance(images, np.ndarray) else images).long()
    act = torch.as_tensor(np.asarray(actions, np.int64) if isinstance(actions, np.ndarray) else actions).long()
    frames = torch.cat([img.reshape(len(img), -1), act.reshape(len(act), -1) + codebook_size], 1)  # (T, frame_len)
    return rearrange(frames, "t slot -> (t slot)")


def split_clip(clips: torch.Tensor, layout: Layout, codebook_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N) clips -> image ids (B, T, h, w) and local action ids (B, T, n_a)."""
    x = rearrange(clips, "b (t slot) -> b t slot", slot=layout.frame_len)
    images = rearrange(x[..., : layout.frame_tokens], "b t (h w) -> b t h w", h=layout.h, w=layout.w)
    return images, x[..., layout.frame_tokens:] - codebook_size
