"""FLOP and MFU estimates (PaLM appendix B style: 6N per token + attention)."""
from __future__ import annotations

import torch

# dense bf16 peak FLOP/s, by substring of torch.cuda.get_device_name()
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    if override:
        return float(override)
    if device.type != "cuda":
        return None  # no meaningful peak for a CPU; pass peak_flops= to get an MFU there
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def train_flops_per_token(n_params_no_emb: int, n_layers: int, dim: int, seq_len: int, mask_density: float) -> float:
    """Forward + backward FLOPs per token: 6N for the weights, 12*L*dim*(visible keys) for attention."""
    return 6 * n_params_no_emb + 12 * n_layers * dim * mask_density * seq_len
