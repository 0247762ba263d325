"""Generate a clip with a trained world model and write it as mp4 + gif (VQ-decoded, next to the ground truth).

    python -m mcar.generate ckpt=checkpoints/<run>/last.ckpt sampler=diagd schedule.k=2 prompt=3
    python -m mcar.generate ckpt=... prompt=crafter_s1_e00011:40 frames=16      # episode[:first frame]
    python -m mcar.generate ckpt=... prompt_image=frame.png 'actions=[move_left,move_left,do,noop]'

prompt: a held-out clip id (0 .. number of validation clips - 1), or an episode name of the data's token
folder with an optional first frame. prompt_image + actions: a first frame (any size; resized to the frame the
VQ turns into the data's h x w tokens: x16, 224x384) and one action per generated frame (Crafter action names,
or local action ids; n_a ids per frame as a list when n_a > 1); there is no ground truth then. Writes <output dir>/<prompt>_<sampler>.{mp4,gif,pt}.
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import mcar.config  # noqa: F401  (registers resolvers)
from mcar.config import to_dict
from mcar.core.layout import Layout
from mcar.core.sampler import build_sampler
from mcar.eval.generation import held_out_source, load_for_sampling, sampler_label
from mcar.tokenizer.clips import join_clip, split_clip
from mcar.tokenizer.render import (action_labels, data_action_space, decode_frames, invalid_image_tokens, side_by_side,
                                   to_u8, write_gif)
from mcar.tokenizer.video import write_mp4
from mcar.data.common import build_datamodule

log = logging.getLogger("mcar.generate")


def episode_clip(cfg: DictConfig, name: str, start: int, frames: int, layout: Layout) -> torch.Tensor:
    """(N,) clip of `frames` frames of episode `name` from the data's token folder, from frame `start`."""
    from mcar.data.tokens import TokenClips

    dm = build_datamodule(cfg.data)
    if not hasattr(dm, "tokens_dir"):
        raise ValueError(f"prompt={name}: data={cfg.data.name} has no episodes; give a held-out clip id (prompt=0)")
    dm.prepare_data()
    f = Path(dm.tokens_dir) / f"{name}.frames.npy"
    if not f.exists():
        names = sorted(p.name[: -len(".frames.npy")] for p in Path(dm.tokens_dir).glob("*.frames.npy"))
        raise ValueError(f"prompt={name}: no episode {f}; episodes: {', '.join(names[:20])}"
                         + (" ..." if len(names) > 20 else ""))
    source = TokenClips(dm.tokens_dir, [name], layout, frames, cfg.data.codebook_size)  # clip i starts at frame i
    if not 0 <= start < len(source):
        n = len(np.load(f, mmap_mode="r"))
        raise ValueError(f"prompt={name}:{start}: the episode has {n} frames; a {frames}-frame clip must "
                         f"start in [0, {n - frames}]")
    return source.clip(start)


def image_clip(cfg: DictConfig, layout: Layout, vq) -> torch.Tensor:
    """prompt_image + actions -> (N,) clip: the image's tokens, then zeros for the frames to generate."""
    from PIL import Image

    from mcar.tokenizer.vq import encode_tokens, frame_size

    path = Path(cfg.prompt_image)
    if not path.is_file():
        raise FileNotFoundError(f"prompt_image: file not found: {path}")
    if not cfg.actions:
        raise ValueError("prompt_image needs actions=[...]: one action per frame to generate")
    H, W = frame_size(vq, layout.h, layout.w)
    img = Image.open(path).convert("RGB").resize((W, H), Image.BICUBIC)
    ids = encode_tokens(vq, torch.from_numpy(np.asarray(img))[None].to(vq.device))[0].flatten().cpu()  # (h*w,)
    if int(ids.max()) >= cfg.data.codebook_size:
        raise ValueError(f"prompt_image: the VQ gave token {int(ids.max())} but data.codebook_size="
                         f"{cfg.data.codebook_size}: use the VQ the model's data was tokenised with (vq.path)")
    # frame t's action leads to frame t+1; the last one is never used
    space = data_action_space(cfg.data)
    acts = torch.tensor([parse_action(a, space, layout.n_a) for a in cfg.actions] + [[0] * layout.n_a])
    images = torch.zeros(len(acts), len(ids), dtype=torch.long)
    images[0] = ids
    return join_clip(images, acts, cfg.data.codebook_size)


def parse_action(a, space: str | None, n_a: int) -> list[int]:
    """An action given by name (in the data's action space `space`, Crafter's) or as n_a local ids -> the ids."""
    if isinstance(a, str) and space == "crafter":
        from mcar.tokenizer.actions import action_space

        return action_space("crafter").encode({"action": a})
    ids = list(a) if OmegaConf.is_list(a) or isinstance(a, (list, tuple)) else [a]
    if len(ids) != n_a or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"actions: {a!r} is not {n_a} local action id(s)")
    return ids


def prompt_clip(cfg: DictConfig, layout: Layout, frames: int, vq) -> tuple[torch.Tensor, bool, str]:
    """-> (clip (N,), has ground truth, a file-name stem)."""
    if cfg.prompt_image:
        return image_clip(cfg, layout, vq), False, Path(cfg.prompt_image).stem
    p = str(cfg.prompt)
    if p.isdigit():
        source = held_out_source(cfg, frames)
        if int(p) >= len(source):
            raise ValueError(f"prompt={p}: the held-out set has {len(source)} clips of {frames} frames "
                             f"(ids 0..{len(source) - 1})")
        return source.clip(int(p)), True, f"clip{p}"
    name, _, start = p.partition(":")
    return episode_clip(cfg, name, int(start or 0), frames, layout), True, p.replace(":", "_")


def generate(cfg: DictConfig) -> dict:
    torch.manual_seed(cfg.seed)
    module, hp, vq, device = load_for_sampling(cfg)
    layout, cb = module.layout, cfg.data.codebook_size
    frames = len(cfg.actions) + 1 if cfg.prompt_image else (cfg.frames or hp["clip_frames"])
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


@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    generate(cfg)


if __name__ == "__main__":
    main()
