"""Generate a clip with a trained world model and write it as mp4 + gif (VQ-decoded, next to the ground truth).

    mcar generate ckpt=checkpoints/<run>/last.ckpt sampler=diagd schedule.k=2 prompt=3
    mcar generate ckpt=... prompt=crafter_s1_e00011:40 frames=16      # episode[:first frame]
    mcar generate ckpt=... prompt_image=frame.png 'actions=[move_left,move_left,do,noop]'

prompt: a held-out clip id (0 .. number of validation clips - 1), or an episode name of the data's token
folder with an optional first frame. prompt_image + actions: a first frame (any size; resized to the frame the
VQ turns into the data's h x w tokens: x16, 224x384) and one action per generated frame (Crafter action names,
or local action ids; n_a ids per frame as a list when n_a > 1); there is no ground truth then. Writes
<output dir>/<prompt>_<sampler>.{mp4,gif,pt}.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from mcar.checkpoint.load import warn_past_trained_length
from mcar.core.devices import set_threads
from mcar.core.sampler import build_sampler
from mcar.eval.generation import load_for_sampling, sampler_label
from mcar.eval.prompts import prompt_clip
from mcar.hydra_app import hydra_tool, to_dict
from mcar.tokenizer.clips import split_clip
from mcar.tokenizer.pictures import (
    action_labels,
    data_action_space,
    decode_frames,
    invalid_image_tokens,
    side_by_side,
    to_u8,
    write_gif,
)
from mcar.tokenizer.video import write_mp4

log = logging.getLogger("mcar.generate")


def generate(cfg: DictConfig) -> dict:
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    module, hp, vq, device = load_for_sampling(cfg)
    layout, cb = module.layout, cfg.data.codebook_size
    frames = len(cfg.actions) + 1 if cfg.prompt_image else (cfg.frames or hp["clip_frames"])
    warn_past_trained_length(frames, hp)
    scfg, schedule = to_dict(cfg.sampler), to_dict(cfg.schedule)
    if cfg.prompt_image:
        schedule["prompt_frames"] = 1
    sampler = build_sampler(scfg, layout, frames, cb, schedule=schedule)
    clip, has_gt, stem = prompt_clip(cfg, layout, frames, vq)
    tokens, stats = sampler.generate(module.model, clip[None].to(device))
    tokens = tokens.cpu()
    label = sampler_label(sampler)
    shown, n_bad = invalid_image_tokens(tokens, layout, cb)
    if n_bad:
        log.warning("%d generated image tokens were action ids: shown as code 0", n_bad)
    ids, acts = split_clip(shown, layout, cb)
    cols = {label: to_u8(decode_frames(vq, ids)[0])}
    if has_gt:
        cols = {"ground truth": to_u8(decode_frames(vq, split_clip(clip[None], layout, cb)[0])[0]), **cols}
    video = side_by_side(cols, action_labels(acts[0], data_action_space(cfg.data)))
    out = Path(cfg.paths.output_dir)
    base = out / f"{stem}_{sampler.name}"
    mp4, gif = write_mp4(video, base.with_suffix(".mp4"), cfg.fps), write_gif(video, base.with_suffix(".gif"), cfg.fps)
    torch.save({"generated": tokens, "prompt": clip, "has_ground_truth": has_gt, "sampler": scfg, "schedule": schedule,
                "passes": stats.passes, "seconds": stats.seconds}, base.with_suffix(".pt"))
    log.info("%s: %d frames (%d prompt) with %s in %d passes, %.2fs -> %s and %s", stem, frames,
             sampler.prompt_frames, label, stats.passes, stats.seconds, mp4, gif)
    return {"mp4": mp4, "gif": gif, "passes": stats.passes}


@hydra_tool("generate")
def main(cfg: DictConfig) -> None:
    generate(cfg)
