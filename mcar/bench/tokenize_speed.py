"""`mcar bench tokenizer`: what VQ-encoding a corpus costs. Measured here: the VQ's encoder frames/s (random weights
unless bench.tokenizer.vq.path is set: the cost does not depend on them) and mp4 decoding + resizing frames/s on
one core (VPT's 640x360 recordings, PyAV). Predicted for one GPU: its TF32 peak (half the dense bf16 peak of
mcar.core.flops; the tokeniser encodes in fp32, which cuDNN runs as TF32) x an assumed utilisation / the encoder's
FLOPs per frame (counted by torch's FlopCounterMode). Decoding stays on the CPU: a GPU needs about
gpu_frames_per_s / decode_frames_per_s_per_core cores beside it to be kept busy.

    mcar bench tokenizer [bench.tokenizer.vq.path=/weights/amused-vqvae] [bench.tokenizer.batch=32]
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

VPT_STORED = (360, 640)  # (H, W) of VPT's recordings


def encoder_flops_per_frame(vq, size: tuple[int, int]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from mcar.tokenizer.vq_model import encode_tokens

    frame = torch.zeros(1, *size, 3, dtype=torch.uint8)
    with FlopCounterMode(display=False) as counter:
        encode_tokens(vq, frame)
    return float(counter.get_total_flops())


def encode_frames_per_s(vq, size: tuple[int, int], batch: int, steps: int) -> float:
    from mcar.tokenizer.vq_model import encode_tokens

    frames = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (batch, *size, 3), dtype=np.uint8))
    encode_tokens(vq, frames)  # warm-up
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        encode_tokens(vq, frames)
        seconds.append(time.perf_counter() - t0)
    return batch / statistics.median(seconds)


def decode_frames_per_s(size: tuple[int, int], frames: int = 120) -> float:
    """A VPT-sized mp4 decoded and resized to `size` on this process's threads (PyAV)."""
    from mcar.tokenizer.video import FrameStream, write_mp4

    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, (8, *VPT_STORED, 3), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        mp4 = write_mp4((np.roll(block[i % 8], i, axis=1) for i in range(frames)), Path(tmp) / "vpt.mp4", fps=20)
        t0 = time.perf_counter()
        n = sum(1 for _ in FrameStream(mp4, size))
        return n / (time.perf_counter() - t0)


def run_tokenizer(cfg: DictConfig) -> dict:
    from mcar.core.flops import peak_of
    from mcar.tokenizer.vq_model import build_vq, load_vq

    t = cfg.bench.tokenizer
    size = (int(t.size[0]), int(t.size[1]))
    torch.manual_seed(0)
    vq = (load_vq(t.vq.path) if t.vq.path else build_vq(t.vq.arch, l2_codes=False)).eval()
    flops = encoder_flops_per_frame(vq, size)
    cpu = encode_frames_per_s(vq, size, int(t.batch), int(t.steps))
    decode = decode_frames_per_s(size)
    peak_bf16 = peak_of(str(t.gpu))
    if peak_bf16 is None:
        raise ValueError(f"bench.tokenizer.gpu={t.gpu!r}: not a GPU mcar.core.flops knows")
    gpu = float(t.gpu_utilisation) * peak_bf16 / 2 / flops
    params = sum(p.numel() for p in vq.parameters())
    return dict(mode="tokenizer", vq=str(t.vq.name), vq_params_m=round(params / 1e6, 1),
                frame_size=list(size), batch=int(t.batch), encoder_gflops_per_frame=float(f"{flops / 1e9:.4g}"),
                cpu_threads=torch.get_num_threads(), cpu_frames_per_s=round(cpu, 2),
                decode_frames_per_s_per_core=round(decode / max(1, torch.get_num_threads()), 1),
                gpu=str(t.gpu), gpu_utilisation_assumed=float(t.gpu_utilisation),
                gpu_frames_per_s_predicted=round(gpu, 0),
                gpu_days_per_10m_frames_predicted=round(1e7 / gpu / 86400, 2),
                decode_cores_per_gpu=round(gpu / (decode / max(1, torch.get_num_threads())), 1))
