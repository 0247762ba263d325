"""FLOP and MFU estimates (PaLM appendix B style: 6N per token + attention), the one home of MFU.

A training step computes every row of the mask's input sequence: for DiagD that is the clip's slots plus one
proxy row per row-start target ((h-1) per generated frame, ~4% at MC-AR's geometry). MFU counts those rows, the
work the step does, not only the clip's tokens (which would understate DiagD's MFU by that 4%).
"""
from __future__ import annotations

import torch

# dense bf16 peak FLOP/s (FP32 accumulation, no sparsity) by fragments of torch.cuda.get_device_name(), matched
# case-insensitively: every fragment must match, first row wins, an unlisted variant (a bare "NVIDIA H100") gets
# None rather than a neighbour's peak. Lightning's _CUDA_FLOPS (lightning/fabric/utilities/throughput.py, 2.6) has
# the same H100 SXM/PCIe, A100, A10G, L40 and L4 values, and the same variant rule (an H100 reporting HBM3 is SXM,
# HBM2e is PCIe). Where it differs, on purpose: its H200 (2.0e15), H200 NVL (1.7e15) and H100 NVL (1.98e15) rows are
# the datasheets' with-sparsity figures (dense: half, per card), and its H200 rows need "sxm1"/"nvl1" in the name;
# it gives "NVIDIA L40" and "NVIDIA L40S" its L4 row (121e12: "l4" is in the name; L40S datasheet: 362 dense); its
# RTX 4090 bf16 (82.6e12) is the card's TF32 figure (Ada whitepaper: bf16 with FP32 accumulate 165.2 dense, FP16
# accumulate 330); it has no GH200 (SXM-class Hopper: 989). tests/test_gpu_paths.py checks each row against it.
PEAK_BF16 = ((("GH200",), 989e12), (("H200", "NVL"), 835e12), (("H200",), 989e12),
             (("H100", "NVL"), 835e12), (("H100", "PCIe"), 756e12), (("H100", "HBM2e"), 756e12),
             (("H100", "HBM3"), 989e12), (("H100", "SXM"), 989e12),
             (("A100",), 312e12), (("L40S",), 362e12), (("L40",), 181e12), (("L4",), 121e12), (("A10G",), 125e12),
             (("RTX 4090",), 165.2e12))


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """override if set, else the table's dense bf16 peak of a known GPU; None on CPU or an unknown GPU."""
    if override:
        return float(override)
    if torch.device(device).type != "cuda":
        return None  # no meaningful peak for a CPU; pass peak_flops= to get an MFU there
    return peak_of(torch.cuda.get_device_name(device))


# peak memory bandwidth (bytes/s) by the same fragments and rule: what a memory-bound sampling pass can reach (the
# bandwidth floor of mcar bench sampler and the GPU check). GH200 ships with 4.0 (HBM3) or 4.9 TB/s (HBM3e) under one
# name ("GH200" holds "H200": its own row, None), like a bare "NVIDIA H100" (pass bench.bandwidth=).
PEAK_BANDWIDTH = ((("GH200",), None), (("H200",), 4.8e12), (("H100", "NVL"), 3.9e12), (("H100", "PCIe"), 2.0e12),
                  (("H100", "HBM2e"), 2.0e12), (("H100", "HBM3"), 3.35e12), (("H100", "SXM"), 3.35e12),
                  (("A100", "80GB"), 2.0e12), (("A100",), 1.555e12))


def device_lookup(table, name: str) -> float | None:
    """The value of the first row of `table` whose every fragment is in `name` (case-insensitive); None if none."""
    name = name.lower()
    return next((v for parts, v in table if all(p.lower() in name for p in parts)), None)


def peak_of(name: str) -> float | None:
    """The dense bf16 peak of the GPU called `name` (a CUDA device name, or e.g. "H100 SXM"); None if unknown."""
    return device_lookup(PEAK_BF16, name)


def bandwidth_of(name: str) -> float | None:
    """The peak memory bandwidth of the GPU called `name` in bytes/s; None if unknown."""
    return device_lookup(PEAK_BANDWIDTH, name)


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


def play_floor(cfg, layout, context: int, sessions: int, bandwidth: float, k: int = 2, d: int | None = None,
               item: int = 2) -> dict:
    """The bandwidth floor of steady play (a rolling DiagD rollout, docs/diagd.md section 7) for `sessions` games
    batched as one rollout: every pass reads the weights (less the embedding table) once and each session's whole
    ring of K/V (the attention kernel reads masked columns too), `d` passes per frame (null: s_spa, one frame at a
    time). cfg: a ModelConfig (n_kv_heads < n_heads: GQA, fewer K/V bytes); item: bytes per value (bf16: 2).
    -> the bytes and frames/s no implementation can beat at `bandwidth` bytes/s."""
    from mcar.core.model import Transformer

    with torch.device("meta"):
        weights = Transformer(cfg).num_params(embeddings=False) * item
    s_spa = (layout.h - 1) * k + layout.w
    d = s_spa if d is None else d
    ring = context + -(-s_spa // d) - 1
    kv = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * item * ring * layout.frame_len
    frame_seconds = d * (weights + sessions * kv) / bandwidth
    return dict(weight_bytes=weights, kv_bytes_per_session=kv, passes_per_frame=d,
                fps_per_session=1 / frame_seconds, fps_total=sessions / frame_seconds)
