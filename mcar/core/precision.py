"""The precision policy, in one place: bfloat16 on CUDA, float32 elsewhere.

On a GPU, bfloat16 halves the bytes a memory-bound sampling pass reads and runs training's matmuls on tensor
cores (trainer.precision=bf16-mixed, the `mcar_precision` resolver); CPUs lack fast bfloat16, so they compute in
float32. Sampling dtype, the bench's default dtype, the dashboard's autocast and the GPU check all ask here.
"""
from __future__ import annotations

import torch


def compute_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype weights, activations and the KV cache are computed in on `device` by default."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def active_dtype(module_dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The dtype a module's keys and values come out in on `device`: autocast's where it is on, else its weights'."""
    device_type = torch.device(device).type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else module_dtype


def trainer_precision() -> str:
    """Lightning's precision for a trainer on this machine (conf: `${mcar_precision:}`): the policy above."""
    return "bf16-mixed" if compute_dtype("cuda" if torch.cuda.is_available() else "cpu") == torch.bfloat16 \
        else "32-true"
