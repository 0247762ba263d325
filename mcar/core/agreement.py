"""How far a generated clip agrees with the real one, token by token or by its mix of tiles, and the "nothing
moves" baseline every model must beat: the one home of these (evaluation, world tests, play's rollouts, training's
summary and dashboard use them). Clips are flat (B, N) in a `Layout`."""
from __future__ import annotations

import torch

from mcar.core.layout import Layout


def frame_images(clips: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(B, N) clips -> (B, T, h*w) image tokens of every frame (a view where the clips are contiguous)."""
    return clips.reshape(clips.shape[0], -1, layout.frame_len)[..., :layout.frame_tokens]


def frame_agreement(generated: torch.Tensor, real: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(B, N) clips x2 -> (B, T) float64: per frame, the share of image tokens equal to the real frame's."""
    return (frame_images(generated, layout) == frame_images(real, layout)).double().mean(-1)


def generated_agreement(generated: torch.Tensor, real: torch.Tensor, layout: Layout,
                        prompt_frames: int) -> torch.Tensor:
    """(B, N) clips x2 -> (B,) float64: per clip, the share of image tokens of frames >= prompt_frames (the ones a
    sampler generates) equal to the real clip's. Prompt frames and action tokens are not counted."""
    return frame_agreement(generated, real, layout)[:, prompt_frames:].mean(1)


def nothing_moves(clips: torch.Tensor, layout: Layout, prompt_frames: int) -> torch.Tensor:
    """(B, N) clips -> a copy whose frames >= prompt_frames show the last prompt frame's image ("nothing moves":
    the floor a world model must beat). Prompt frames and every action stay the clips' own."""
    if prompt_frames < 1:
        raise ValueError(f"nothing_moves: prompt_frames={prompt_frames}, it needs a prompt frame to repeat")
    out = clips.clone()
    images = out.view(out.shape[0], -1, layout.frame_len)[..., :layout.frame_tokens]
    images[:, prompt_frames:] = images[:, prompt_frames - 1:prompt_frames]
    return out


def histogram_distance(frames: torch.Tensor, real: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """(B, T, h, w) codes x2 -> (B, T) total-variation distance between each frame's histogram of codes and the
    real frame's: 0 = the same mix of tiles wherever they are, 1 = no code in common."""
    def hist(x):
        flat = x.flatten(2).clamp(0, codebook_size - 1)
        return torch.zeros(*flat.shape[:2], codebook_size, dtype=torch.float64, device=flat.device).scatter_add_(
            2, flat, torch.ones_like(flat, dtype=torch.float64)) / flat.shape[-1]
    return (hist(frames) - hist(real)).abs().sum(-1) / 2
