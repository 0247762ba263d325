"""A checkpoint ready to sample: one object every sampling tool and a Python user share (litgpt's `LLM.load`,
gpt-fast's `_load_model` + `generate`).

    wm = WorldModel.load("checkpoints/shipped/crafter_world_recall_grpo")  # plain Python: device, dtype "auto"
    clips = wm.held_out_clips(frames=8, n_clips=2)
    tokens, stats = wm.generate(clips, wm.sampler(frames=8))  # rolls a KV cache past wm.context frames
    wm.save_gif(tokens[0], "outputs/clip.gif")

`WorldModel.load(path, **overrides)` composes conf/sampling.yaml with the checkpoint and `overrides` (the keys a
sampling tool takes: `sampler.temperature=0.0`, `schedule.k=3`, ...); the tools, which compose their own config,
call `WorldModel.from_config(cfg)`. Either reads the checkpoint (weights only), adopts its data, VQ and schedule
config, checks the data fits and puts the model on `cfg.device` in `cfg.dtype`. The window a sampler sees at once
has one default, `context` (`sampler.context`, null: the checkpoint's clip length): generate, evaluate, play, the
world tests and post-training all roll past it the same way.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from mcar.checkpoint.config import adopt_checkpoint_config
from mcar.checkpoint.load import check_data_fits, load_model, sampling_dtype, warn_past_trained_length
from mcar.core.devices import device_memory, resolve_device, sync
from mcar.core.layout import Layout
from mcar.core.sampler import SampleStats, ScheduleSampler, build_sampler
from mcar.hydra_app import compose_tool, to_dict
from mcar.sampling.held_out import held_out_data, pick_clips
from mcar.sampling.prompts import prompt_clip
from mcar.tokenizer.pictures import comparison_frames, data_action_space, write_gif


def flat_keys(node: dict, prefix: str = ""):
    """{"sampler": {"temperature": 0}, "schedule.k": 3} -> ("sampler.temperature", 0), ("schedule.k", 3)."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from flat_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@dataclass
class WorldModel:
    """The model (a plain Transformer in eval mode), the layout it was trained on, its hyper-parameters, the device
    and the tool's config with the checkpoint's data, VQ and schedule adopted (`cfg`)."""

    model: torch.nn.Module
    layout: Layout
    hp: dict
    device: torch.device
    cfg: DictConfig

    @classmethod
    def load(cls, path: str | Path, device: str = "auto", dtype: str = "auto", **overrides) -> "WorldModel":
        """A checkpoint file or run folder -> ready to sample, no Hydra needed: the checkpoint carries its data,
        VQ and schedule config. overrides: dotted keys of conf/sampling.yaml, e.g. `**{"sampler.temperature": 0}`
        or `sampler={"temperature": 0}` (a mapping is flattened to its dotted keys)."""
        words = [f"ckpt={path}", f"device={device}", f"dtype={dtype}"]
        words += [f"{key}={json.dumps(value)}" for key, value in flat_keys(overrides)]
        try:
            cfg = compose_tool("sampling", words)
        except SystemExit as e:  # the command line's one-line refusal, as an error a Python caller can catch
            raise ValueError(str(e)) from None
        return cls.from_config(cfg, overrides=words)

    @classmethod
    def from_config(cls, cfg: DictConfig, overrides: list[str] | None = None) -> "WorldModel":
        """A sampling tool's composed config -> cfg.ckpt on cfg.device in cfg.dtype, checked against cfg.data (which
        takes the checkpoint's own data, VQ and schedule config where `overrides`, default the command line, do not
        set them)."""
        device = resolve_device(cfg.device)
        module, hp = load_model(cfg.ckpt, device, sampling_dtype(cfg.get("dtype"), device))
        adopt_checkpoint_config(cfg, hp, f"ckpt={cfg.ckpt}", ("data", "vq", "schedule"), overrides)
        check_data_fits(module.layout, hp, cfg.data)
        wm = cls(module.model, module.layout, hp, device, cfg)
        wm.check_fits_memory()  # a bad sampler.context or a checkpoint's huge clip fails now, in one line
        return wm

    def check_fits_memory(self) -> None:
        """The KV cache of one clip at `context` frames against the device's memory: a checkpoint whose clip_frames
        or layout asks for more is refused in one line (an allocator error or a MemoryError traceback before)."""
        arch, context = self.model.cfg, self.context
        slots = context * self.layout.frame_len
        dtype = next(self.model.parameters()).dtype
        need = 2 * arch.n_layers * arch.n_kv_heads * arch.head_dim * slots * torch.finfo(dtype).bits // 8
        have = device_memory(self.device)
        if need > have // 2:
            raise ValueError(f"ckpt={self.cfg.ckpt}: a window of {context} frames x {self.layout.frame_len} slots "
                             f"needs a {need / 2**30:.1f} GiB KV cache, more than half of this device's "
                             f"{have / 2**30:.1f} GiB: set sampler.context=<fewer frames>")

    @property
    def codebook_size(self) -> int:
        return int(self.cfg.data.codebook_size)

    @property
    def trained_frames(self) -> int:
        """The clip length the checkpoint was trained on."""
        return int(self.hp["clip_frames"])

    @property
    def context(self) -> int:
        """Frames the model sees at once (`sampler.context`; null: the trained clip length): longer clips roll a
        KV cache of the last `context` frames (docs/diagd.md section 7)."""
        value = OmegaConf.select(self.cfg, "sampler.context", default=None)
        context = self.trained_frames if value is None else int(value)
        if context < 2:
            raise ValueError(f"sampler.context={value} is invalid: the model must see >= 2 frames (the previous and "
                             f"the new); null: the checkpoint's {self.trained_frames}")
        return context

    @functools.cached_property
    def vq(self):
        """The VQ that decodes the data's tokens (vq.path; the committed small VQ when the data names none), loaded
        on first use (FileNotFoundError when absent: a tool that can do without it catches that)."""
        from mcar.tokenizer.vq_model import load_vq

        return load_vq(OmegaConf.select(self.cfg, "vq.path", default=None)).to(self.device)

    def sampler(self, frames: int, *, context: int | None = None, schedule: dict | None = None,
                **settings) -> ScheduleSampler:
        """The configured sampler (cfg.sampler on cfg.schedule) for clips of `frames` frames, rolling past `context`
        frames (None: `self.context`). schedule: schedule fields over cfg.schedule (k, prompt_frames, ...);
        settings: sampler fields over cfg.sampler (name, temperature, top_k, ...)."""
        scfg = to_dict(self.cfg.sampler) | settings
        scfg["context"] = self.context if context is None else int(context)
        warn_past_trained_length(min(frames, scfg["context"]), self.hp)  # a rolling window sees `context` at once
        return build_sampler(scfg, self.layout, frames, self.codebook_size,
                             schedule=to_dict(self.cfg.schedule) | (schedule or {}))

    @torch.no_grad()
    def generate(self, clips: torch.Tensor, sampler: ScheduleSampler, batch_size: int | None = None,
                 warmup: bool = False, progress: bool = False) -> tuple[torch.Tensor, SampleStats]:
        """clips (n, N) (prompt frames + every action) -> generated (n, N) on CPU and the stats of all batches
        (passes: the most of any batch). warmup: one untimed batch first (allocation, caches, kernels)."""
        batches = clips.split(batch_size or len(clips))
        if warmup:
            sampler.generate(self.model, batches[0].to(self.device))
        out, seconds, tokens, passes = [], 0.0, 0, 0
        for batch in tqdm(batches, desc=f"generate {sampler.label}", mininterval=5, disable=not progress):
            sync(self.device)
            generated, stats = sampler.generate(self.model, batch.to(self.device))  # times itself, synchronised
            out.append(generated.cpu())
            seconds, tokens, passes = seconds + stats.seconds, tokens + stats.tokens, max(passes, stats.passes)
        self.model.clear_cache()
        return torch.cat(out), SampleStats(passes, tokens, seconds)

    @torch.no_grad()
    def teacher_forced_loss(self, clips: torch.Tensor, sampler: ScheduleSampler,
                            batch_size: int | None = None) -> torch.Tensor:
        """(n,) float64: each clip's mean cross-entropy of its generated image tokens, the clips' own tokens fed on
        the sampler's schedule (every clip has as many: their mean is the mean over all tokens)."""
        nll = torch.cat([sampler.teacher_forced(self.model, b.to(self.device), keep_logits=False).nll.cpu()
                         for b in clips.split(batch_size or len(clips))])
        self.model.clear_cache()
        return nll.double().mean(1)

    def held_out(self, frames: int):
        """The held-out clips of `frames` frames (`.val_source`): the checkpoint's shipped ones, else its data's
        validation episodes (built on first use)."""
        return held_out_data(self.cfg, frames)

    def held_out_clips(self, frames: int, n_clips: int = 1, ids=None) -> torch.Tensor:
        """(n, N): `n_clips` evenly spaced held-out clips of `frames` frames (or those `ids`): prompt frames and
        every action, ready for `generate`."""
        return self.pick_held_out(frames, n_clips, ids)[2]

    def pick_held_out(self, frames: int, n_clips: int, ids=None):
        """`held_out_clips` with where they come from -> (the held-out data, as `held_out` gives it, the ids,
        (n, N) clips)."""
        data = self.held_out(frames)
        ids = pick_clips(data.val_source, n_clips, ids)
        return data, ids, torch.stack([data.val_source.clip(i) for i in ids])

    def save_gif(self, tokens: torch.Tensor, path: str | Path, fps: float = 4) -> Path:
        """A generated clip's tokens (N,) -> a GIF of its frames decoded by the checkpoint's VQ, each captioned
        with its action."""
        frames = comparison_frames({"generated": tokens}, self.layout, self.codebook_size, self.vq,
                                   data_action_space(self.cfg.data))
        return write_gif(frames, path, fps)

    def prompt(self, frames: int) -> tuple[torch.Tensor, bool, str]:
        """The configured prompt (cfg.prompt: a held-out clip id or episode[:frame]; or cfg.prompt_image + actions)
        as a clip of `frames` frames -> (clip (N,), has ground truth, a file-name stem)."""
        return prompt_clip(self.cfg, self.layout, frames, self.vq if self.cfg.get("prompt_image") else None)
