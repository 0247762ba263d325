"""Generate a clip with a trained world model and write it as mp4 + gif (VQ-decoded, next to the ground truth).

    mcar generate ckpt=checkpoints/<run>/last.ckpt sampler=diagd schedule.k=2 prompt=3
    mcar generate ckpt=... prompt=crafter_s1_e00011:40 frames=16      # episode[:first frame]
    mcar generate ckpt=... frames=128                                   # any length: a rolling KV cache
    mcar generate ckpt=... prompt_image=frame.png 'actions=[move_left,move_left,do,noop]'

prompt: a held-out clip id (0 .. number of validation clips - 1), or an episode name of the data's token
folder with an optional first frame. prompt_image + actions: a first frame (any size; resized to the frame the
VQ turns into the data's h x w tokens: x16, 224x384) and one action per generated frame (Crafter action names,
or local action ids; n_a ids per frame as a list when n_a > 1); there is no ground truth then. Writes
<output dir>/<prompt>_<sampler>.{mp4,gif,pt}.

frames: any number. Past `sampler.context` frames (null: the checkpoint's clip_frames) the model sees the last
`context` frames on a rolling KV cache (docs/diagd.md section 7): the same passes per frame however long the clip.
A held-out prompt limits frames to its episodes' length; prompt_image + actions has no limit.
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig

from mcar.atomic import written_atomically
from mcar.core.devices import set_threads
from mcar.hydra_app import hydra_tool, to_dict
from mcar.sampling.world_model import WorldModel
from mcar.tokenizer.pictures import comparison_stream, data_action_space, invalid_image_tokens, write_video

log = logging.getLogger("mcar.generate")


def generate(cfg: DictConfig) -> dict:
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    wm = WorldModel.from_config(cfg)
    layout, cb = wm.layout, wm.codebook_size
    frames = len(cfg.actions) + 1 if cfg.prompt_image else (cfg.frames or wm.trained_frames)
    sampler = wm.sampler(frames, schedule={"prompt_frames": 1} if cfg.prompt_image else None)
    clip, has_gt, stem = wm.prompt(frames)
    tokens, stats = wm.generate(clip[None], sampler)
    n_bad = invalid_image_tokens(tokens, layout, cb)[1]
    if n_bad:
        log.warning("%d generated image tokens were action ids: shown as code 0", n_bad)
    clips = ({"ground truth": clip} if has_gt else {}) | {sampler.label: tokens[0]}
    video = comparison_stream(clips, layout, cb, wm.vq, data_action_space(cfg.data))  # decoded as it is written
    out = Path(cfg.paths.output_dir)
    base = out / f"{stem}_{sampler.name}"
    mp4, gif = write_video(video, base, cfg.fps)
    with written_atomically(base.with_suffix(".pt")) as tmp:
        torch.save({"generated": tokens, "prompt": clip, "has_ground_truth": has_gt,
                    "sampler": to_dict(cfg.sampler), "context": sampler.context, "schedule": asdict(sampler.config),
                    "passes": stats.passes, "seconds": stats.seconds}, tmp)
    generated = frames - sampler.prompt_frames
    log.info("%s: %d frames (%d prompt) with %s in %d passes (%.1f per frame), %.2fs (%.2f frames/s)%s -> %s and %s",
             stem, frames, sampler.prompt_frames, sampler.label, stats.passes, stats.passes / generated,
             stats.seconds, generated / max(stats.seconds, 1e-9),
             f", a rolling window of {sampler.context} frames" if sampler.rolls() else "", mp4, gif)
    log.info("longer: frames=N (held-out prompts: up to their episodes' length; prompt_image=... actions=[...]: any)")
    return {"mp4": mp4, "gif": gif, "passes": stats.passes, "passes_per_frame": stats.passes / generated}


@hydra_tool("generate")
def main(cfg: DictConfig) -> None:
    generate(cfg)
