"""Clips in the DIAGD.md layout, both ways: per frame its h*w image ids (raster order), then its n_a action ids
+ codebook_size. `join_clip` builds a clip from frames and local action ids, `split_clip` takes clips apart."""
from __future__ import annotations

import numpy as np
import torch

from mcar.core.layout import Layout


def join_clip(images, actions, codebook_size: int) -> torch.Tensor:
    """images (T, h, w) or (T, h*w) token ids, actions (T, n_a) local action ids -> (T * frame_len,) long clip."""
    img = torch.as_tensor(np.asarray(images, np.int64) if isinstance(images, np.ndarray) else images).long()
    act = torch.as_tensor(np.asarray(actions, np.int64) if isinstance(actions, np.ndarray) else actions).long()
    return torch.cat([img.reshape(len(img), -1), act.reshape(len(act), -1) + codebook_size], 1).reshape(-1)


def split_clip(clips: torch.Tensor, layout: Layout, codebook_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N) clips -> image ids (B, T, h, w) and local action ids (B, T, n_a)."""
    B, T = clips.shape[0], clips.shape[1] // layout.frame_len
    x = clips.view(B, T, layout.frame_len)
    return x[..., : layout.frame_tokens].reshape(B, T, layout.h, layout.w), x[..., layout.frame_tokens:] - codebook_size
