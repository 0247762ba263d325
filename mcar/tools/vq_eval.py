"""`mcar vq_eval episodes=... [vq_path=...] [png=out.png]` (conf/vq_eval.yaml): score a VQ on held-out whole frames
(PSNR, SSIM, codebook usage) and draw originals above reconstructions.

    mcar vq_eval episodes=data/crafter/episodes [vq_path=mcar/assets/vq_crafter_small] [png=out.png]
    mcar vq_eval episodes=... vq_path=checkpoints/vq_small/best export=mcar/assets/vq_crafter_small
        (stores the VQ there with fp16 weights, then scores that stored copy and writes metrics.json beside it)

Every `stride`-th frame of every episode in the folder is scored (use episodes the VQ never trained on). The old
`--episodes ... --size H W` spelling works too.
"""
import json
from pathlib import Path

import torch

from mcar.atomic import write_atomic
from mcar.core.devices import set_threads
from mcar.data.episodes import episode_files
from mcar.eval.vq_scores import evaluate
from mcar.hydra_app import compose_tool
from mcar.tokenizer.vq_model import check_frame_size, decode_latents, load_vq, save_vq, to_input
from mcar.train.vq_training import load_frames, save_grid


def main(argv: list[str] | None = None) -> dict:
    c = compose_tool("vq_eval", argv)
    set_threads(int(c.threads))
    vq = load_vq(c.vq_path)
    if c.export:
        save_vq(vq, c.export, half=True)
        vq = load_vq(c.export)
    files = episode_files(c.episodes)
    size = check_frame_size(vq, list(c.size), "size") if c.size else None
    frames = load_frames(files, int(c.stride), desc="held-out frames", size=size)
    m = evaluate(vq, frames)
    print(f"{len(files)} episodes, {m['frames']} frames: PSNR {m['psnr']:.2f} dB, SSIM {m['ssim']:.4f}, "
          f"codebook usage {m['usage']:.1%} ({m['codes_used']} of {vq.quantize.n_e})")
    if c.png:
        pick = frames[torch.linspace(0, len(frames) - 1, int(c.show)).long()]
        with torch.no_grad():
            x = to_input(pick)
            rec = decode_latents(vq, vq.quantize(vq.encode(x).latents)[0])
        save_grid(Path(c.png), x, rec)
    if c.export:
        write_atomic(Path(c.export) / "metrics.json", json.dumps(
            {**m, "source": str(c.vq_path), "episodes": str(c.episodes), "n_episodes": len(files), "stride": c.stride},
            indent=1))
    return m
