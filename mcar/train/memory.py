"""Peak training memory per device, planned from measurements of the model at its real width and sequence length.

A training step's peak, at the start of the backward pass with every activation alive, is

    weights + AdamW state (12 bytes per parameter, fp32)  +  activations(L, T)

and at the end of the backward pass weights + AdamW state + gradients (16 bytes per parameter). activations(L, T)
is bilinear in the layer count L and the tokens per step T (batch x sequence rows): a fixed part, the head's
per-token part (logits and loss: T x vocab), a per-layer part (autocast's bf16 weight copies) and the per-token
per-layer part. It is measured, not modelled: training steps (forward, backward, fused AdamW) of the same model
cut to 1 and 2 layers, at batch 1 and 2 of the real sequence length, run on fake tensors (shapes only, no compute,
seconds for a 1.2B layer) and their peak read by torch's MemTracker, give the four coefficients; the planner then
scales them to the full depth and batch. On real tensors MemTracker reads the same bytes (tests/test_gpucheck.py).

Attention is measured with SDPA's causal kernel, which keeps O(S) per row for the backward pass as flex attention
does on a GPU; the dense CPU fallback keeps an S x S matrix no GPU run allocates. FSDP over N devices divides
weights, gradients and optimizer state by N and adds the unsharded parameters of the block being computed and of
the next one (prefetch), plus one block's gradients before their reduce-scatter. Not counted: the CUDA caching
allocator's fragmentation and the CUDA context (about 0.5-1 GiB), NCCL buffers, compile workspaces.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from mcar.core.model import ModelConfig, Transformer
from mcar.train.parallel import apply_activation_checkpointing

GiB = 2**30


def measure_step_peak(cfg: ModelConfig, batch: int, seq_len: int, autocast_dtype: torch.dtype | None = None,
                      activation_checkpointing: bool = False, device: str = "cpu", fake: bool = True,
                      steps: int = 2, residual_dtype: torch.dtype | None = None) -> int:
    """Peak bytes over `steps` training steps (from the second on, with AdamW state), read by MemTracker.
    fake=True runs on fake tensors: the same allocations, no compute. residual_dtype: Transformer.residual_dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    dev = torch.device(device)
    with FakeTensorMode() if fake else nullcontext(), dev:
        torch.manual_seed(0)
        model = Transformer(cfg)
        model.residual_dtype = residual_dtype
        if activation_checkpointing:
            apply_activation_checkpointing(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len))
        coords = torch.randint(1, 16, (seq_len, 4))
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            for _ in range(steps):
                tracker.reset_mod_stats()
                with torch.autocast(dev.type, dtype=autocast_dtype) if autocast_dtype else nullcontext():
                    logits = model(tokens, coords)  # mask None: SDPA's causal kernel (O(S) saved per row)
                F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        peak = tracker.get_tracker_snapshot("peak")
    return int(peak[dev]["Total"] if dev in peak else next(iter(peak.values()))["Total"])


def fit_activations(cfg: ModelConfig, seq_len: int, batch: int = 1, autocast_dtype: torch.dtype | None = torch.bfloat16,
                    activation_checkpointing: bool = False, device: str = "cpu", fake: bool = True,
                    residual_dtype: torch.dtype | None = None) -> dict:
    """activations(L, T) = c0 + per_token*T + per_layer*L + per_token_per_layer*L*T around a batch size, from
    1- and 2-layer models at `batch` and `batch`+1 clips of `seq_len` rows (measured peak minus weights and AdamW
    state). Measured at the batch it is used for: which moment of the step is the peak (the start of the backward
    pass, or late in it when gradients have piled up) depends on the tokens per step, not on the depth."""
    rows = []
    for n_layers in (1, 2):
        small = dataclasses.replace(cfg, n_layers=n_layers)
        for b in (batch, batch + 1):
            peak = measure_step_peak(small, b, seq_len, autocast_dtype, activation_checkpointing, device, fake,
                                     residual_dtype=residual_dtype)
            rows.append((n_layers, b * seq_len, peak - 12 * count_params(small)))
    a = torch.tensor([[1.0, t, L, L * t] for L, t, _ in rows], dtype=torch.float64)
    c = torch.linalg.solve(a, torch.tensor([v for *_, v in rows], dtype=torch.float64)).tolist()
    return {"c0": c[0], "per_token": c[1], "per_layer": c[2], "per_token_per_layer": c[3]}


def block_params(cfg: ModelConfig) -> int:
    attn = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + cfg.dim * cfg.dim
    return attn + 3 * cfg.dim * cfg.mlp_dim + 2 * cfg.dim  # + the two RMSNorm weights


def count_params(cfg: ModelConfig) -> int:
    """Parameters of Transformer(cfg), from the config alone."""
    return cfg.n_layers * block_params(cfg) + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def plan(cfg: ModelConfig, batch: int, seq_len: int, fit: dict, *, autocast_dtype=torch.bfloat16,
         fsdp_devices: int = 1) -> dict:
    """Predicted peak bytes per device of one training step of `batch` x `seq_len` rows, with its parts."""
    n_params, N = count_params(cfg), max(1, fsdp_devices)
    T, L = batch * seq_len, cfg.n_layers
    acts = fit["c0"] + fit["per_token"] * T + fit["per_layer"] * L + fit["per_token_per_layer"] * L * T
    gathered = 0.0
    if N > 1:  # two unsharded blocks (compute + prefetch) and one block's unreduced gradients
        gathered = block_params(cfg) * (2 * (2 if autocast_dtype == torch.bfloat16 else 4) + 4)
    peak = max(12 * n_params / N + acts, 16 * n_params / N) + gathered
    return {"batch_size": batch, "seq_len": seq_len, "tokens_per_step": T, "fsdp_devices": N,
            "weights_and_adamw_gib": round(12 * n_params / N / GiB, 3),
            "gradients_gib": round(4 * n_params / N / GiB, 3),
            "activations_gib": round(acts / GiB, 3), "fsdp_gathered_gib": round(gathered / GiB, 3),
            "activation_bytes_per_token_per_layer": round(fit["per_token_per_layer"]),
            "head_bytes_per_token": round(fit["per_token"]), "peak_gib": round(peak / GiB, 3), "peak_bytes": int(peak)}


def max_batch(cfg: ModelConfig, seq_len: int, budget_bytes: float, *, autocast_dtype=torch.bfloat16,
              activation_checkpointing: bool = False, fsdp_devices: int = 1, device: str = "cpu",
              limit: int = 1024, residual_dtype: torch.dtype | None = None) -> int:
    """The largest batch whose planned peak fits `budget_bytes` (0: not even batch 1); the peak grows with the
    batch, so a doubling then bisection search, each candidate planned from its own measurements."""
    def fits(b: int) -> bool:
        fit = fit_activations(cfg, seq_len, b, autocast_dtype, activation_checkpointing, device,
                              residual_dtype=residual_dtype)
        return plan(cfg, b, seq_len, fit, autocast_dtype=autocast_dtype, fsdp_devices=fsdp_devices)["peak_bytes"] \
            <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, 2 * hi
        if hi > limit:
            return lo
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_training(arch: dict, seq_len: int, batch: int, *, bf16: bool, activation_checkpointing: bool,
                  fsdp_devices: int = 1, budget_gib: float | None = 80.0, device: str = "cpu",
                  residual_bf16: bool = False) -> dict:
    """The training step of a config, planned: peak per device and its parts, bytes per token per layer, and
    the largest batch that fits `budget_gib` per device with and without activation checkpointing.
    residual_bf16: the stream between blocks in bf16 (train.yaml residual_dtype; under bf16 autocast only)."""
    cfg = ModelConfig(**arch)
    dtype = torch.bfloat16 if bf16 else None
    residual = torch.bfloat16 if bf16 and residual_bf16 else None
    out = {"params": count_params(cfg), "activation_checkpointing": activation_checkpointing,
           "precision": "bf16-mixed" if bf16 else "32-true",
           "residual_dtype": "bfloat16" if residual is not None else "float32"}
    fit = fit_activations(cfg, seq_len, batch, dtype, activation_checkpointing, device, residual_dtype=residual)
    out |= plan(cfg, batch, seq_len, fit, autocast_dtype=dtype, fsdp_devices=fsdp_devices)
    if budget_gib:
        out["budget_gib"] = budget_gib
        for ac in (False, True):
            out[f"max_batch_{'with' if ac else 'without'}_checkpointing"] = max_batch(
                cfg, seq_len, budget_gib * GiB, autocast_dtype=dtype, activation_checkpointing=ac,
                fsdp_devices=fsdp_devices, device=device, residual_dtype=residual)
    return out
