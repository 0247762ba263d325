"""VQ scores on held-out whole frames: PSNR, SSIM and codebook usage (`mcar vq_eval`, mcar/tools/vq_eval.py)."""
from __future__ import annotations

import torch
from tqdm import tqdm

from mcar.tokenizer.quality import frame_scores
from mcar.tokenizer.vq_model import decode_latents, to_input


@torch.no_grad()
def evaluate(vq, frames_u8: torch.Tensor, batch: int = 8) -> dict:
    psnr, ssim, ids = [], [], []
    for chunk in tqdm(frames_u8.split(batch), desc="scoring", unit="batch"):
        x = to_input(chunk)
        z_q, _, (_, _, idx) = vq.quantize(vq.encode(x).latents)
        rec = decode_latents(vq, z_q)
        p, s = frame_scores(x, rec)
        psnr.append(p), ssim.append(s), ids.append(idx)
    ids = torch.cat(ids)
    return {"frames": len(frames_u8), "psnr": torch.cat(psnr).mean().item(), "ssim": torch.cat(ssim).mean().item(),
            "usage": ids.unique().numel() / vq.quantize.n_e, "codes_used": ids.unique().numel()}
