"""Rotary position embeddings over the layout's coordinates (`Layout.coords`: time, row, col, position).

3D (the default): the head dimension's rotation pairs are split across the (time, row, col) axes, each with its
own frequency ladder. 1D (`model.rope=1d`): LLaMA's RoPE over the flat position, as in transformers'
LlamaForCausalLM (MineWorld's checkpoints). Both rotate the pairs (x[:D/2], x[D/2:]) (transformers' rotate_half),
so a LLaMA checkpoint's q/k weights load unpermuted."""
from __future__ import annotations

import torch
from torch import nn


def rope_sections(head_dim: int) -> tuple[int, int, int]:
    """Rotation pairs per axis (time, row, col), as even a split as possible, time first."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    pairs = head_dim // 2
    if pairs < 3:
        raise ValueError(f"head_dim must be >= 6 for 3D RoPE, got {head_dim}")
    spatial = pairs // 3
    return pairs - 2 * spatial, spatial, spatial


class RoPE3D(nn.Module):
    """cos/sin tables for integer (t, row, col) coordinates; each axis has its own frequency ladder."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        self.sections = rope_sections(head_dim)
        inv = [base ** (-torch.arange(n, dtype=torch.float64) / n) for n in self.sections]
        self.register_buffer("inv_freq", torch.cat(inv).float(), persistent=False)  # (D/2,)
        self.register_buffer(
            "axis", torch.tensor([a for a, n in enumerate(self.sections) for _ in range(n)]), persistent=False
        )  # (D/2,) which coordinate each pair rotates with

    def forward(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """coords (..., S, 3 or 4) long (Layout.coords; the position column is not read) -> cos, sin (..., S, D/2)."""
        angle = coords[..., self.axis].float() * self.inv_freq  # (..., S, D/2)
        return angle.cos(), angle.sin()


class RoPE1D(nn.Module):
    """cos/sin tables for the flat position (the coordinates' last column): inv_freq_i = base^(-2i/D)."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        # in float32, as transformers' LLaMA and MineWorld compute it: a converted model's logits match theirs bit for
        # bit (float64 then rounded differs in 10 of 32 frequencies at head_dim 64: 2e-4 by slot 5,552)
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)  # (D/2,)

    def forward(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """coords (..., S, 4) long -> cos, sin (..., S, D/2) float32."""
        if coords.shape[-1] != 4:
            raise ValueError(f"1D RoPE reads the position column of Layout.coords (..., S, 4); "
                             f"got {tuple(coords.shape)}")
        angle = coords[..., 3:].float() * self.inv_freq  # (..., S, D/2)
        return angle.cos(), angle.sin()


ROPES = {"3d": RoPE3D, "1d": RoPE1D}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D); cos/sin (B or 1, 1, S, D/2). Rotates the pairs (x[:D/2], x[D/2:])."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


def rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (..., D/2) -> full-width (cos | cos), (-sin | sin) (..., D) for `rotate`: built once per forward."""
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """`apply_rope` with `rotation_tables`' tables, bit for bit (a - b == a + (-b) in IEEE arithmetic) in half the
    kernels: x * (cos | cos) + (x2 | x1) * (-sin | sin). The model's path (each op costs ~5 us when sampling on CPU)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    return (xf * cos2 + torch.cat([xf[..., half:], xf[..., :half]], -1) * sin2).type_as(x)
