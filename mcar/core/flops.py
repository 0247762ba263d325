"""FLOP and MFU estimates (PaLM appendix B style: 6N per token + attention), the one home of MFU.

A training step computes every row of the mask's input sequence: for DiagD that is the clip's slots plus one
proxy row per row-start target ((h-1) per generated frame, ~4% at MC-AR's geometry). MFU counts those rows, the
work the step does, not only the clip's tokens (which would understate DiagD's MFU by that 4%).
"""
from __future__ import annotations

import torch

# dense bf16 peak FLOP/s by fragments of torch.cuda.get_device_name(): every fragment must match, first row wins
# (the PCIe H100 has fewer SMs and lower clocks than the SXM one: 756 vs 989 TFLOP/s)
PEAK_BF16 = ((("H100", "PCIe"), 756e12), (("H100", "NVL"), 835e12), (("H200",), 989e12), (("H100",), 989e12),
             (("GH200",), 989e12), (("A100",), 312e12), (("L40S",), 362e12), (("A10G",), 125e12), (("4090",), 165e12))


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """override if set, else the table's dense bf16 peak of a known GPU; None on CPU or an unknown GPU."""
    if override:
        return float(override)
    if torch.device(device).type != "cuda":
        return None  # no meaningful peak for a CPU; pass peak_flops= to get an MFU there
    return peak_of(torch.cuda.get_device_name(device))


def peak_of(name: str) -> float | None:
    return next((v for parts, v in PEAK_BF16 if all(p in name for p in parts)), None)


def train_flops_per_token(n_params_no_emb: int, n_layers: int, dim: int, seq_len: int, mask_density: float) -> float:
    """Forward + backward FLOPs per computed row: 6N for the weights, 12*L*dim*(visible keys) for attention."""
    return 6 * n_params_no_emb + 12 * n_layers * dim * mask_density * seq_len


def train_step_flops(n_params_no_emb: int, n_layers: int, dim: int, rows: int, batch: int,
                     mask_density: float) -> float:
    """Forward + backward FLOPs of one step over `batch` sequences of `rows` computed rows each (the mask's
    sequence: proxy rows included) under a mask keeping `mask_density` of the (query, key) pairs."""
    return batch * rows * train_flops_per_token(n_params_no_emb, n_layers, dim, rows, mask_density)


def mfu(step_flops: float, seconds: float, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilisation of a step taking `seconds` over `devices` devices of `peak` FLOP/s each."""
    return step_flops / seconds / (peak * devices) if peak else None
