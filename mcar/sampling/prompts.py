"""The prompt of a generation: a held-out clip, an episode of the data's token folder from a given frame, or an
image with one action per generated frame (`mcar generate`, `mcar play`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from mcar.core.layout import Layout
from mcar.data.common import build_datamodule
from mcar.sampling.held_out import held_out_folder, held_out_source
from mcar.tokenizer.actions import action_space
from mcar.tokenizer.clips import join_clip
from mcar.tokenizer.pictures import data_action_space


def episode_clip(cfg: DictConfig, name: str, start: int, frames: int, layout: Layout) -> torch.Tensor:
    """(N,) clip of `frames` frames of episode `name` from frame `start`: from the checkpoint's shipped held-out
    episodes when it is one of them (nothing to build), else from the data's token folder."""
    from mcar.data.token_clips import TokenClips

    shipped = held_out_folder(cfg)
    if shipped is not None and (shipped / f"{name}.frames.npy").exists():
        folder = shipped
    else:
        dm = build_datamodule(cfg.data)
        if not hasattr(dm, "tokens_dir"):
            raise ValueError(f"prompt={name}: data={cfg.data.name} has no episodes; give a held-out clip id "
                             f"(prompt=0)")
        known = dm.episode_names() if hasattr(dm, "episode_names") else None  # before anything is built
        if known is not None and name not in known:
            raise ValueError(f"prompt={name}: data={cfg.data.name} has no such episode; episodes: "
                             f"{', '.join(known[:20])}" + (" ..." if len(known) > 20 else ""))
        dm.prepare_data()
        folder = Path(dm.tokens_dir)
    f = folder / f"{name}.frames.npy"
    if not f.exists():
        names = sorted(p.name[: -len(".frames.npy")] for p in folder.glob("*.frames.npy"))
        raise ValueError(f"prompt={name}: no episode {f}; episodes: {', '.join(names[:20])}"
                         + (" ..." if len(names) > 20 else ""))
    source = TokenClips(folder, [name], layout, frames, cfg.data.codebook_size)  # clip i starts at frame i
    if not 0 <= start < len(source):
        n = len(np.load(f, mmap_mode="r"))
        raise ValueError(f"prompt={name}:{start}: the episode has {n} frames; a {frames}-frame clip must "
                         f"start in [0, {n - frames}]")
    return source.clip(start)


def image_clip(cfg: DictConfig, layout: Layout, vq) -> torch.Tensor:
    """prompt_image + actions -> (N,) clip: the image's tokens, then zeros for the frames to generate."""
    from PIL import Image

    from mcar.tokenizer.vq_model import encode_tokens, frame_size

    path = Path(cfg.prompt_image)
    if not path.is_file():
        raise FileNotFoundError(f"prompt_image: file not found: {path}")
    if not cfg.actions:
        raise ValueError("prompt_image needs actions=[...]: one action per frame to generate")
    H, W = frame_size(vq, layout.h, layout.w)
    try:
        img = Image.open(path).convert("RGB").resize((W, H), Image.BICUBIC)
    except (OSError, Image.DecompressionBombError) as e:  # UnidentifiedImageError is an OSError
        raise ValueError(f"prompt_image={path}: not an image this can read ({type(e).__name__}); give a PNG or "
                         f"JPEG frame") from None
    ids = encode_tokens(vq, torch.from_numpy(np.array(img))[None].to(vq.device))[0].flatten().cpu()  # (h*w,)
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
    """An action given by name (in the data's action space `space`, one that names its actions) or as n_a local
    ids -> the ids."""
    if isinstance(a, str) and space and action_space(space).names:
        return action_space(space).encode_name(a)
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
