"""Score a VQ on held-out whole frames: PSNR, SSIM, codebook usage, and a PNG of originals above reconstructions.

    python -m mcar.vq_eval --episodes data/crafter/episodes [--vq mcar/assets/vq_crafter_small] [--png out.png]
    python -m mcar.vq_eval --episodes ... --vq checkpoints/vq_small/best --export mcar/assets/vq_crafter_small
        (stores the VQ there with fp16 weights, then scores that stored copy and writes metrics.json beside it)

Every `--stride`-th frame of every episode in the folder is scored (use episodes the VQ never trained on).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from mcar.data.episodes import episode_files
from mcar.tokenizer.vq import check_frame_size, decode_latents, load_vq, save_vq, to_input
from mcar.train.vq import frame_scores, load_frames, save_grid


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", required=True)
    ap.add_argument("--vq", default=None, help="diffusers VQModel folder (default: the committed small VQ)")
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--png", default=None, help="write originals above their reconstructions here")
    ap.add_argument("--show", type=int, default=3, help="frames in the PNG")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--export", default=None, help="store the VQ here (fp16 safetensors) and score that copy")
    ap.add_argument("--size", type=int, nargs=2, default=None, metavar=("H", "W"),
                    help="resize frames to H x W (multiples of the VQ's downsampling); default: as stored")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    vq = load_vq(a.vq)
    if a.export:
        save_vq(vq, a.export, half=True)
        vq = load_vq(a.export)
    files = episode_files(a.episodes)
    size = check_frame_size(vq, a.size, "--size") if a.size else None
    frames = load_frames(files, a.stride, desc="held-out frames", size=size)
    m = evaluate(vq, frames)
    print(f"{len(files)} episodes, {m['frames']} frames: PSNR {m['psnr']:.2f} dB, SSIM {m['ssim']:.4f}, "
          f"codebook usage {m['usage']:.1%} ({m['codes_used']} of {vq.quantize.n_e})")
    if a.png:
        pick = frames[torch.linspace(0, len(frames) - 1, a.show).long()]
        with torch.no_grad():
            x = to_input(pick)
            rec = decode_latents(vq, vq.quantize(vq.encode(x).latents)[0])
        save_grid(Path(a.png), x, rec)
    if a.export:
        (Path(a.export) / "metrics.json").write_text(json.dumps(
            {**m, "source": str(a.vq), "episodes": str(a.episodes), "n_episodes": len(files), "stride": a.stride},
            indent=1))
    return m


if __name__ == "__main__":
    main()
