"""The last lines of a training run, for someone who just ran it: how well the model predicts its held-out clips
(token agreement: the share of generated image tokens equal to the real ones) next to "nothing moves" (every
generated frame a copy of the last real one) and the ceiling (the real frames: 1.0), whether it beats "nothing
moves", where its videos and W&B run are, and the commands that take its checkpoint further.

`HeldOutAgreement` (conf/callbacks/default.yaml) measures at the end of training, on the validation clips, with
the greedy sampler the training mask is exact for (NTP after causal pre-training, DiagD after DiagD
fine-tuning); `print_summary` prints once the run is done (mcar.train.task)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from mcar.core.agreement import generated_agreement, nothing_moves
from mcar.core.sampler import build_sampler
from mcar.train.dashboard import generate_eager
from mcar.train.parallel import is_sharded
from mcar.wandb_run import finish, run_of

log = logging.getLogger("mcar")


@dataclass
class Agreement:
    model: float  # the model's generated tokens equal to the real ones
    nothing_moves: float  # the last real frame repeated, on the same tokens
    clips: int
    frames: int  # generated frames per clip
    sampler: str

    @property
    def beats(self) -> bool:
        return self.model > self.nothing_moves


def held_out_agreement(model, layout, schedule, clips: torch.Tensor, frames: int, codebook_size: int,
                       sampler: str = "diagd", batch_size: int = 16) -> Agreement:
    """Greedy `sampler` (ntp | diagd on `schedule`) of `frames`-frame clips from their first
    `schedule.prompt_frames` frames and all their actions, scored against the clips, and "nothing moves" on the
    same generated slots."""
    sampler = build_sampler({"name": sampler, "temperature": 0.0}, layout, frames, codebook_size, schedule)
    generated = torch.cat([generate_eager(sampler, model, b)[0] for b in clips.split(batch_size)])
    model.clear_cache()
    lay, P = sampler.layout, sampler.prompt_frames
    return Agreement(float(generated_agreement(generated, clips, lay, P).mean()),
                     float(generated_agreement(nothing_moves(clips, lay, P), clips, lay, P).mean()), len(clips),
                     frames - P, sampler.label)


def exact_sampler(mask: dict) -> str:
    """The sampler whose passes see what the training mask showed: NTP after causal training, DiagD after DiagD
    fine-tuning (a causal model sampled with DiagD sees less than it trained on, and scores lower)."""
    return "diagd" if str(mask.get("name", "causal")).startswith("diagd") else "ntp"


class HeldOutAgreement(Callback):
    """At the end of training: `held_out_agreement` on at most `max_clips` validation clips (every rank of a sharded
    model samples, rank 0 keeps the result in `.result`). A run of fewer than `min_steps` steps (a smoke test)
    skips it and says how to measure (`.skipped`): end-of-run work costs in proportion to the run."""

    def __init__(self, min_steps: int = 50, max_clips: int = 16):
        if min_steps < 0 or max_clips < 1:
            raise ValueError(f"callbacks.held_out_agreement: min_steps={min_steps} must be >= 0 and "
                             f"max_clips={max_clips} >= 1")
        self.min_steps, self.max_clips = min_steps, max_clips
        self.result: Agreement | None = None
        self.skipped: str | None = None
        self.wandb_dir: Path | None = None

    @torch.no_grad()
    def on_train_end(self, trainer, pl_module) -> None:
        run = run_of(trainer)
        if run is not None and trainer.is_global_zero:
            self.wandb_dir = Path(run.dir).parent  # <save_dir>/wandb/offline-run-<time>-<id>
        if not (trainer.is_global_zero or is_sharded(pl_module.model)) or trainer.datamodule is None:
            return
        if trainer.global_step < self.min_steps:
            self.skipped = (f"held-out agreement skipped: {trainer.global_step} steps < callbacks.held_out_agreement."
                            f"min_steps={self.min_steps}; measure it with: mcar evaluate ckpt=<the checkpoint below> "
                            f"'references=[copy_last]'")
            return
        clips = torch.cat([b["tokens"] for b in trainer.datamodule.val_dataloader()])[:self.max_clips]
        clips = clips.to(pl_module.device)
        mask = pl_module.hparams.mask
        log.info("held-out agreement: greedy %s on %d held-out clips of %d frames (callbacks.held_out_agreement: "
                 "max_clips, min_steps)", exact_sampler(mask), len(clips), pl_module.hparams.clip_frames)
        model, was_training = pl_module.model, pl_module.model.training
        model.eval()
        try:
            result = held_out_agreement(model, pl_module.layout, pl_module.schedule, clips,
                                        pl_module.hparams.clip_frames, trainer.datamodule.codebook_size,
                                        sampler=exact_sampler(mask))
        finally:
            model.train(was_training)
        if trainer.is_global_zero:
            self.result = result


def shown(path) -> str:
    """A path as the user typed it: relative to the working directory when under it."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def last_losses(metrics_csv: Path) -> str:
    """' (train/loss 1.234, val/loss 1.456 at the end)' from a run's dashboard/metrics.csv, '' when it has none."""
    import csv

    last: dict[str, str] = {}
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            last.update({k: v for k, v in row.items() if v and "loss" in k})
    said = ", ".join(f"{k} {float(v):.3f}" for k, v in sorted(last.items(), key=lambda kv: kv[0] != "train/loss"))
    return f" ({said} at the end)" if said else ""


def summary_lines(agreement: Agreement | None, steps: int, minutes: float, checkpoint: Path | None,
                  output_dir: Path, wandb_dir: Path | None, task: str, skipped: str | None = None) -> list[str]:
    lines = [f"== {task} done: {steps} steps in {minutes:.1f} min (data build included)"]
    if skipped:
        lines.append(skipped)
    if agreement is not None:
        a = agreement
        lines += [f"held-out token agreement (share of generated image tokens equal to the real ones; {a.clips} "
                  f"held-out clips x {a.frames} generated frames, {a.sampler}):",
                  f"  this model      {a.model:.3f}",
                  f"  nothing moves   {a.nothing_moves:.3f}  (every generated frame a copy of the last real one)",
                  "  ceiling         1.000  (the real frames)"]
        if a.beats:
            lines.append(f"  -> the model beats \"nothing moves\" by {a.model - a.nothing_moves:.3f}: it predicts "
                         f"what changes")
        else:
            lines.append(f"  -> the model does not beat \"nothing moves\" ({a.model - a.nothing_moves:+.3f}): "
                         f"train longer (trainer.max_steps) or on more data (data.episodes)")
    if any((output_dir / "dashboard").glob("val_step*")):  # videos were made (not before val_dashboard.min_steps)
        lines.append(f"videos (real | NTP | DiagD at each validation): {shown(output_dir / 'dashboard')}/")
    if (output_dir / "dashboard" / "metrics.csv").is_file():
        lines.append(f"loss curves{last_losses(output_dir / 'dashboard' / 'metrics.csv')}: "
                     f"{shown(output_dir / 'dashboard')}/loss.png, metrics.csv")
    if wandb_dir is not None:
        lines.append(f"W&B run: {shown(wandb_dir)}  (an offline run uploads with: wandb sync {shown(wandb_dir)})")
    if checkpoint is None:
        lines.append("no checkpoint written (checkpoint.every_n_steps=null)")
        return lines
    if not checkpoint.exists():
        lines.append(f"no checkpoint at {shown(checkpoint)}")
        return lines
    folder = shown(checkpoint.parent)
    lines += [f"checkpoint: {shown(checkpoint)}", "next:"]
    if task == "train":
        lines.append(f"  fine-tune for DiagD: python finetune.py mask=diagd steps=150 init_from={shown(checkpoint)}")
    lines += [f"  generate a clip:     mcar generate ckpt={folder} prompt=0",
              f"  evaluate:            mcar evaluate ckpt={folder}",
              f"  play it:             pip install -e '.[play]' && mcar play ckpt={folder}"]
    return lines


def print_summary(trainer, cfg, output_dir, checkpoint: Path | None, seconds: float) -> None:
    """The run's last lines (rank 0), from its HeldOutAgreement callback when it has one."""
    if not trainer.is_global_zero:
        return
    measured = next((c for c in trainer.callbacks if isinstance(c, HeldOutAgreement)), None)
    lines = summary_lines(measured and measured.result, trainer.global_step, seconds / 60, checkpoint,
                          Path(output_dir), measured and measured.wandb_dir, cfg.task, measured and measured.skipped)
    if run_of(trainer) is not None:  # W&B's own closing lines come before these, not after
        finish()
    print("\n" + "\n".join(lines), flush=True)

