"""The training dashboard: after each validation, ground truth | NTP | DiagD videos of a val prompt (decoded by
the VQ, the action under each frame), the speed row of each sampler, and once at fit start the attention masks
(training mask and the configured sampler's schedule) as images. Everything goes to the run's output dir
(dashboard/) and, when the logger is W&B, to W&B as well."""
from __future__ import annotations

import contextlib
import csv
import logging
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from mcar.atomic import written_atomically
from mcar.core.agreement import generated_agreement
from mcar.core.precision import compute_dtype
from mcar.core.sampler import build_sampler
from mcar.tokenizer.pictures import (
    comparison_frames,
    data_action_space,
    mask_image,
    schedule_table,
    write_png,
    write_video,
)
from mcar.train.parallel import is_sharded
from mcar.wandb_run import log_media, log_table, run_of

log = logging.getLogger("mcar")
SPEED_COLUMNS = ["step", "sampler", "passes", "fps", "tp", "seconds"]


def sampling_autocast(device: torch.device):
    """Sampling the training model: its weights stay float32 (mixed-precision training), so on CUDA the passes run
    under bfloat16 autocast, as training's forward does (and the KV cache is set up in bfloat16 then, see
    `Transformer.setup_cache`); CPU samples in float32, unchanged."""
    if compute_dtype(device) != torch.float32:
        return torch.autocast(device.type, dtype=compute_dtype(device))
    return contextlib.nullcontext()


def generate_eager(sampler, model, clips: torch.Tensor):
    """Sample with the training model as it is, compiled blocks run eagerly: the sampler's pass shapes would
    otherwise recompile them at every validation (training compile=true). bfloat16 autocast on CUDA."""
    with torch.compiler.set_stance("force_eager"), sampling_autocast(clips.device):
        return sampler.generate(model, clips)


class ValDashboard(Callback):
    def __init__(self, sampler: dict, output_dir: str, data_name: str, codebook_size: int,
                 vq_path: str | None = None, n_clips: int = 1, max_frames: int | None = 4, fps: float = 4,
                 videos: bool = True, actions: str | dict | None = None, min_steps: int = 0):
        """actions: the data's action space when it is not named by data_name (data.actions: vpt | mineworld, or
        a recordings folder's schema).
        min_steps: validations before this step sample nothing (a smoke run's end costs seconds)."""
        self.sampler_cfg, self.data_name, self.codebook_size = dict(sampler), data_name, codebook_size
        self.action_space = data_action_space({"name": data_name, "actions": actions})
        self.vq_path, self.n_clips, self.max_frames, self.fps, self.videos = vq_path, n_clips, max_frames, fps, videos
        self.out = Path(output_dir) / "dashboard"
        self.min_steps = min_steps
        self._samplers, self._vq, self._speed_rows, self._layout = None, None, [], None

    # ---- setup --------------------------------------------------------------------------------------------
    def samplers(self, pl_module, frames: int) -> dict:
        """NTP and DiagD on the run's schedule (the training mask's), built once."""
        if self._samplers is None:
            sched = pl_module.schedule
            # every sampling option but the static / compiled path's: the training model samples eagerly
            common = {k: v for k, v in self.sampler_cfg.items() if k not in ("name", "static", "compile",
                                                                             "static_widths")}
            lay = pl_module.layout
            cb = self.codebook_size
            self._samplers = {"ntp": build_sampler({"name": "ntp", **common}, lay, frames, cb, sched),
                              f"diagd k={sched.k}": build_sampler({"name": "diagd", **common}, lay, frames, cb, sched)}
        return self._samplers

    def vq(self):
        """The VQ that decodes the data's tokens, loaded once; False when it cannot (no videos then)."""
        if self._vq is None:
            from mcar.tokenizer.vq_model import load_vq

            try:
                self._vq = load_vq(self.vq_path)
                if self._vq.config.num_vq_embeddings < self.codebook_size:
                    raise ValueError(f"its codebook ({self._vq.config.num_vq_embeddings}) is smaller than the "
                                     f"data's ({self.codebook_size})")
            except (FileNotFoundError, ValueError) as e:
                log.warning("validation videos off: cannot decode tokens with the VQ (%s)", e)
                self._vq = False
        return self._vq

    def on_fit_start(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        frames = pl_module.hparams.clip_frames
        sampler = build_sampler(self.sampler_cfg, pl_module.layout, frames, schedule=pl_module.schedule)
        images = {"masks/train": write_png(mask_image(pl_module.mask_factory.table()),
                                           self.out / "mask_train.png"),
                  f"masks/sampler_{sampler.name}": write_png(mask_image(schedule_table(sampler)),
                                                             self.out / f"mask_sampler_{sampler.name}.png")}
        run = run_of(trainer)
        if run is not None:
            log_media(run, images)

    # ---- each validation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        clips = getattr(pl_module, "val_prompts", None)
        # a sharded model needs every rank in every forward (all-gathers): all ranks sample, rank 0 reports
        sharded = is_sharded(pl_module.model)
        if clips is None or trainer.sanity_checking or not (trainer.is_global_zero or sharded):
            return
        if trainer.global_step < self.min_steps:
            log.info("validation at step %d: no dashboard sampling before step %d (val_dashboard.min_steps)",
                     trainer.global_step, self.min_steps)
            return
        lay, frames = pl_module.layout, pl_module.hparams.clip_frames
        frames = min(frames, self.max_frames or frames)
        clips = clips[: self.n_clips, : lay.n_slots(frames)]
        model, step = pl_module.model, trainer.global_step
        was_training = model.training
        model.eval()
        generated, rows = {}, []
        try:
            for label, sampler in self.samplers(pl_module, frames).items():
                tokens, stats = generate_eager(sampler, model, clips)
                generated[label] = tokens
                n_frames = len(clips) * (frames - sampler.prompt_frames)
                rows.append([step, label, stats.passes, n_frames / max(stats.seconds, 1e-9),
                             stats.tokens_per_second, stats.seconds])
        finally:
            model.clear_cache()
            model.train(was_training)
        if not trainer.is_global_zero:
            return
        self._speed_rows += rows
        self.write_speed()
        self.save_tokens(clips, generated, frames, step)
        samplers = self.samplers(pl_module, frames)
        acc = {f"val_gen/{label.split()[0]}_token_acc":
               float(generated_agreement(t, clips, lay, samplers[label].prompt_frames).mean())
               for label, t in generated.items()}
        pl_module.log_dict({**acc, **{f"val_speed/{r[1].split()[0]}_{k}": float(v) for r in rows
                                      for k, v in zip(("passes", "fps", "tp"), r[2:5])}}, rank_zero_only=True)
        try:  # a picture must never stop a training run
            video = self.write_video(clips, generated, step)
        except Exception as e:  # noqa: BLE001
            log.warning("validation video at step %d failed: %s: %s", step, type(e).__name__, e)
            video = None
        run = run_of(trainer)
        if run is not None:
            log_table(run, "val/speed", SPEED_COLUMNS, self._speed_rows)
            if video is not None:
                log_media(run, {"val/video": video})

    def save_tokens(self, clips: torch.Tensor, generated: dict, frames: int, step: int) -> None:
        """Ground truth and every sampler's tokens -> val_generations/step<N>.pt (for evaluation offline)."""
        folder = self.out.parent / "val_generations"
        with written_atomically(folder / f"step{step:07d}.pt") as tmp:
            torch.save({"step": step, "frames": frames, "layout": vars(self._layout), "ground_truth": clips.cpu(),
                        "generated": {label: t.cpu() for label, t in generated.items()}}, tmp)

    def write_speed(self) -> None:
        with written_atomically(self.out / "val_speed.csv") as tmp, open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(SPEED_COLUMNS)
            w.writerows(self._speed_rows)

    def write_video(self, clips: torch.Tensor, generated: dict, step: int) -> Path | None:
        """ground truth | NTP | DiagD, the clips one after another -> dashboard/val_step<N>.{mp4,gif}."""
        vq = self.vq() if self.videos else False
        if not vq:
            return None
        video = np.concatenate([comparison_frames({"ground truth": clips[i]} | {label: t[i] for label, t in
                                                                                 generated.items()},
                                                  self._layout, self.codebook_size, vq, self.action_space)
                                for i in range(len(clips))])
        return write_video(video, self.out / f"val_step{step:07d}", self.fps)[1]

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._layout = pl_module.layout
