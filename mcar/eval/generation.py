"""Generation for evaluation: the held-out clips, which of them to use, the VQ that decodes them, timed sampling,
the teacher-forced loss on the sampler's schedule and the reference rows (ground truth, noise, copy_last)."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm

from mcar.checkpoint.config import adopt_checkpoint_config
from mcar.core.devices import sync
from mcar.core.schedule import ScheduleConfig
from mcar.data.common import build_datamodule
from mcar.tokenizer.clips import copy_last


class ShippedHeldOut:
    """The held-out clips a checkpoint ships beside it (<run folder>/held_out: its data's validation episodes as
    token shards, made by `export_held_out`): what a sampling tool needs of the data, with nothing to build.
    val_source: non-overlapping `frames`-frame clips of every episode (as the data's validation set);
    tokens_name: the token folder they were copied from (it names the VQ; the IDM checks it)."""

    def __init__(self, folder: Path, data: DictConfig, frames: int):
        from mcar.core.layout import Layout
        from mcar.data.index import read_index
        from mcar.data.token_clips import TokenClips

        index = read_index(folder)
        self.tokens_dir, self.tokens_name = folder, index["meta"].get("tokens")
        layout = Layout(data.h, data.w, data.n_a)
        names = [e["name"] for e in index["episodes"] if e["frames"] >= frames]
        entries = {e["name"]: e for e in index["episodes"]}
        self.val_source = TokenClips(folder, names, layout, frames, data.codebook_size, frames,
                                     data.action_vocab_size, entries)


def held_out_folder(cfg: DictConfig) -> Path | None:
    """cfg.held_out -> the token folder of shipped held-out clips, or None for the data's own validation episodes.
    auto: <checkpoint's folder>/held_out when it exists (the shipped model's), else None; data: None; a path."""
    from mcar.checkpoint.load import resolve_ckpt

    value = OmegaConf.select(cfg, "held_out", default="auto")
    if value in (None, "data"):
        return None
    if value == "auto":
        folder = resolve_ckpt(cfg.ckpt).parent / "held_out"
        return folder if (folder / "index.json").is_file() else None
    folder = Path(value)
    if not (folder / "index.json").is_file():
        raise FileNotFoundError(f"held_out={value}: no index.json there (auto: the checkpoint's held_out/ folder "
                                f"or the data's validation episodes; data: always the data's)")
    return folder


def held_out_data(cfg: DictConfig, frames: int):
    """The held-out clips, `frames` frames long, in `.val_source`: the checkpoint's shipped ones (held_out=auto
    finds them; nothing to build), else the configured data's module, built on first use and set up."""
    with open_dict(cfg):
        cfg.data.clip_frames = frames
    shipped = held_out_folder(cfg)
    if shipped is not None:
        return ShippedHeldOut(shipped, cfg.data, frames)
    dm = build_datamodule(cfg.data)
    dm.prepare_data()
    dm.setup("validate")
    return dm


def export_held_out(dm, out: str | Path) -> Path:
    """Copy a token data module's validation episodes (their shards) into `out`, an index.json beside them: what
    `held_out=auto` reads when `out` is <run folder>/held_out. The data is built first if it is not yet."""
    import shutil

    from mcar.data.files import write_json
    from mcar.data.index import build_index, read_index
    from mcar.data.shards import shard_paths

    dm.prepare_data()
    dm.setup("validate")
    src, out = Path(dm.tokens_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in dm.val_source.episode_names:
        for path in shard_paths(src, name):
            shutil.copyfile(path, out / path.name)
    meta = {**read_index(src)["meta"], "tokens": src.name}
    write_json(out / "meta.json", meta)
    build_index(out, meta)
    return out


def held_out_source(cfg: DictConfig, frames: int):
    """The validation clips (held-out episodes) of the configured data, `frames` frames long."""
    return held_out_data(cfg, frames).val_source


def pick_clips(source, n_clips: int, ids=None) -> list[int]:
    """Explicit `clips` ids, else n_clips evenly spaced over the held-out set (little overlap between clips)."""
    n = len(source)
    if ids:
        bad = [i for i in ids if not 0 <= int(i) < n]
        if bad:
            raise ValueError(f"clips={list(ids)}: ids {bad} out of range; the held-out set has {n} clips (0..{n - 1})")
        return [int(i) for i in ids]
    if n == 0:
        raise ValueError("the held-out set has no clip of that length (lower frames=, or use more val episodes)")
    k = min(n_clips, n)
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def load_vq_for(cfg: DictConfig, device: torch.device | str = "cpu"):
    """The VQ that decodes the data's tokens (vq.path; the committed small VQ when the data names none)."""
    from mcar.tokenizer.vq_model import load_vq

    return load_vq(OmegaConf.select(cfg, "vq.path", default=None)).to(device)


def load_for_sampling(cfg: DictConfig):
    """A sampling job's (module, hyperparameters, VQ, device): cfg.ckpt on cfg.device in cfg.dtype, checked against
    cfg.data, and the VQ that decodes the data's tokens (mcar.generate, mcar.play)."""
    from mcar.checkpoint.load import check_data_fits, load_model, sampling_dtype
    from mcar.core.devices import resolve_device

    device = resolve_device(cfg.device)
    module, hp = load_model(cfg.ckpt, device, sampling_dtype(cfg.get("dtype"), device))
    adopt_checkpoint_config(cfg, hp, f"ckpt={cfg.ckpt}", groups=("data", "vq", "schedule"))
    check_data_fits(module.layout, hp, cfg.data)
    return module, hp, load_vq_for(cfg, device), device


@torch.no_grad()
def generate_clips(model, sampler, clips: torch.Tensor, batch_size: int, warmup: bool = True):
    """clips (n, N) -> generated (n, N) and speed {fps, tp, step, seconds}; timing excludes the warm-up."""
    if warmup:
        sampler.generate(model, clips[:batch_size])
    out, seconds, tokens, passes = [], 0.0, 0, 0
    for batch in tqdm(clips.split(batch_size), desc=f"generate {sampler.name}", mininterval=5):
        sync(batch.device)
        tokens_b, stats = sampler.generate(model, batch)  # times itself, synchronised on GPU
        out.append(tokens_b)
        seconds, tokens, passes = seconds + stats.seconds, tokens + stats.tokens, max(passes, stats.passes)
    model.clear_cache()
    sched = sampler.schedule()
    frames = len(clips) * (sched.frames - sched.prompt_frames)
    return torch.cat(out), {"fps": frames / seconds, "tp": tokens / seconds, "step": passes, "seconds": seconds}


@torch.no_grad()
def teacher_forced_loss(model, sampler, clips: torch.Tensor, batch_size: int) -> float:
    """Mean cross-entropy of every generated image token, the clips' own tokens fed on the sampler's schedule."""
    nll = torch.cat([sampler.teacher_forced(model, b, keep_logits=False).nll for b in clips.split(batch_size)])
    model.clear_cache()
    return float(nll.double().mean())


REFERENCES = ("ground_truth", "noise", "copy_last")


def reference_clips(kind: str, clips: torch.Tensor, gen_slots: torch.Tensor, codebook_size: int, seed: int = 0):
    """Reference rows: 'ground_truth' (the clips themselves: PSNR inf, the ceiling), 'noise' (random generated
    tokens, the floor) or 'copy_last' (every generated frame is the last prompt frame's image: "nothing moves").
    Prompt frames and every action stay the clips' own."""
    if kind == "ground_truth":
        return clips.clone()
    if kind == "noise":
        out = clips.clone()
        g = torch.Generator().manual_seed(seed)
        out[:, gen_slots] = torch.randint(0, codebook_size, (len(clips), len(gen_slots)), generator=g).to(out)
        return out
    if kind == "copy_last":
        return copy_last(clips, gen_slots)
    raise ValueError(f"references: unknown {kind!r}; choose from {', '.join(REFERENCES)}")


def sampler_label(sampler) -> str:
    """'ntp', or 'diagd k=2[ d=28][ proxy=above][ full]': the sampler and its schedule."""
    if sampler.name != "diagd":
        return sampler.name
    c = sampler.config
    return (f"diagd k={c.k}" + (f" d={c.d}" if c.d is not None else "")
            + (f" proxy={c.proxy}" if c.proxy != ScheduleConfig.proxy else "") + (" full" if c.full else ""))
