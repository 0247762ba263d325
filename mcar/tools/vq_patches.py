"""Fit a patch VQ (mcar.tokenizer.patch_vq) on the frames of a folder of episodes (mp4), and report it.

    mcar vq_patches episodes=data/crafter/<setting>/episodes out=mcar/assets/vq_crafter_tiles codes=256 \
        textures=crafter keep=mcar/assets/vq_crafter_tiles

(conf/vq_patches.yaml.) textures=crafter gives every tile Crafter can draw at the patch size a code of its own
(mcar.crafter.textures: 252 tiles; k-means fits the codes left over on the frames' patches that are none of
them); keep= keeps the ids of a previous VQ's codes that are such tiles.

The committed `vq_crafter_tiles` (conf/vq/tiles.yaml) was made with this command on the training episodes of
`data=crafter_tiles` (the last 2 episodes by name are held out and measured here: PSNR, exact patches, codes used).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from mcar.atomic import write_json
from mcar.hydra_app import compose_tool
from mcar.tokenizer import quality
from mcar.tokenizer.patch_vq import fit_patch_vq
from mcar.tokenizer.video import read_mp4
from mcar.tokenizer.vq_model import decode_tokens, encode_tokens, load_vq, to_uint8

TEXTURES = ("crafter",)  # textures=: the games whose every drawable tile can be listed (mcar.crafter.textures)


def read_frames(paths: list[Path]) -> torch.Tensor:
    frames = []
    for p in paths:
        video, err = read_mp4(p)
        if err:
            print(f"{p}: {err} (using the {len(video)} frames that decoded)")
        frames.append(video)
    return torch.from_numpy(np.concatenate(frames))


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of uint8 frames over all their pixels; inf where identical."""
    return quality.psnr(a, b, data_range=255.0).item()


def json_float(v: float) -> float | str:
    """v to 2 decimals, "inf" where infinite (the PSNR of identical frames; JSON has no infinity)."""
    return round(v, 2) if math.isfinite(v) else str(v)


def main(argv: list[str] | None = None) -> dict:
    c = compose_tool("vq_patches", argv)
    mp4s = sorted(Path(c.episodes).glob("*.mp4"))
    if len(mp4s) <= c.held_out:
        raise SystemExit(f"{c.episodes}: {len(mp4s)} mp4 episodes, need more than held_out={c.held_out}")
    train, held = mp4s[: len(mp4s) - c.held_out], mp4s[len(mp4s) - c.held_out:]
    if c.textures is not None and c.textures not in TEXTURES:
        raise SystemExit(f"textures={c.textures}: one of {list(TEXTURES)}, or null")
    t0 = time.time()
    fixed = keep = None
    if c.textures == "crafter":
        from mcar.crafter.textures import tile_textures

        tiles = tile_textures(c.patch)
        fixed = torch.from_numpy(np.stack(list(tiles.values())))
    if c.keep is not None:  # read before `out` is written: keep may be the folder being rebuilt
        keep = load_vq(c.keep).quantize.embedding.weight.detach().clone()
    vq, stats = fit_patch_vq(read_frames(train), c.patch, c.codes, c.iters, c.seed, fixed=fixed, keep=keep)
    if fixed is not None:  # every listed tile: its own code, decoding to its own pixels
        ids = encode_tokens(vq, fixed).view(-1)
        rec = to_uint8(decode_tokens(vq, ids.view(-1, 1, 1)))
        stats.update(texture_codes=int(ids.unique().numel()),
                     textures_exact=int((rec == fixed).flatten(1).all(1).sum()))
    held_frames = read_frames(held) if held else None
    if held_frames is not None:
        ids = torch.cat([encode_tokens(vq, f) for f in held_frames.split(64)])
        rec = torch.cat([to_uint8(decode_tokens(vq, i)) for i in ids.split(64)])
        exact = (rec == held_frames).all(-1).unfold(1, c.patch, c.patch).unfold(2, c.patch, c.patch)
        stats.update(held_out_frames=len(held_frames), held_out_psnr=json_float(psnr(rec, held_frames)),
                     held_out_exact_patches=round(float(exact.flatten(-2).all(-1).float().mean()), 4),
                     held_out_codes_used=int(ids.unique().numel()))
    stats.update(train_episodes=len(train), seconds=round(time.time() - t0, 1), command=" ".join(
        ["mcar vq_patches", f"episodes={c.episodes}", f"out={c.out}", f"codes={c.codes}", f"patch={c.patch}",
         f"held_out={c.held_out}", f"iters={c.iters}", f"seed={c.seed}"]
        + [f"{k}={c[k]}" for k in ("textures", "keep") if c[k] is not None]))
    vq.save_pretrained(c.out)
    write_json(Path(c.out) / "metrics.json", stats)
    print(json.dumps(stats))
    return stats
