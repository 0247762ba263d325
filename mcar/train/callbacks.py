"""The training callbacks conf/callbacks/ names (`_target_`), and how that group becomes a list of callbacks."""
from __future__ import annotations

from pathlib import Path

import hydra
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig

from mcar.hydra_app import to_dict


class SeenClips(Callback):
    """Appends the clip indices each rank trained on to <output_dir>/seen_clips_rank<r>.txt (data audit)."""

    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "clip_index" in batch:
            with open(self.output_dir / f"seen_clips_rank{trainer.global_rank}.txt", "a") as f:
                f.write(f"{trainer.global_step} {' '.join(map(str, batch['clip_index'].tolist()))}\n")


class Checkpoints(ModelCheckpoint):
    """Every N steps + last.ckpt, and also the final state when max_steps is not a multiple of N.

    Lightning saves a step's checkpoint in on_train_batch_end, before it logs that step's metrics: a kill in
    between would lose that log line for good (the resume starts after the step). So a step checkpoint carries
    the step's pending log line and a resume logs it first (at worst the same line twice, never a gap), except
    the final step's: its line follows at once, and a finished run is not trained again."""

    PENDING_LOG = "mcar_pending_step_log"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        connector, loop = trainer._logger_connector, trainer.fit_loop
        if not (trainer.training and loop.epoch_loop._batches_that_stepped == trainer.global_step - 1
                and connector.should_update_logs):
            return  # not between a step's checkpoint and its log line (e.g. the final save at on_train_end)
        if 0 < trainer.max_steps <= trainer.global_step:
            # the last step's line is logged right after; a run resumed from here with a larger max_steps would
            # log it twice (a finished run is not trained again, so the line would serve nothing after a kill)
            return
        metrics = {k: float(v) for k, v in connector.metrics["log"].items()}
        if metrics:
            checkpoint[self.PENDING_LOG] = {"step": loop.epoch_loop._batches_that_stepped,
                                            "metrics": {**metrics, "epoch": trainer.current_epoch}}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        self._pending_log = checkpoint.get(self.PENDING_LOG)

    resuming = False  # set by the task (mcar.train.task) when the run resumes from a checkpoint

    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath) -> None:  # Lightning's private check, pinned
        """Only checkpoints count (not our owner lock), and not when the run resumes from them."""
        if self.save_top_k != 0 and not self.resuming and any(Path(dirpath).glob("*.ckpt")):
            rank_zero_warn(f"Checkpoint directory {dirpath} already holds checkpoints: new ones may overwrite them.")

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        pending, self._pending_log = getattr(self, "_pending_log", None), None
        if pending and trainer.loggers:
            for logger in trainer.loggers:
                logger.log_metrics(pending["metrics"], step=pending["step"])
                logger.save()

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        last = Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            trainer.save_checkpoint(last)
            self._last_global_step_saved = trainer.global_step


def progress_bar(refresh_rate: int = 1) -> TQDMProgressBar:
    """A tqdm bar refreshed every `refresh_rate` steps (log_every_n_steps), on a terminal and in piped logs (nohup,
    mcar.tools.table3 stages) alike. Not Lightning's default rich bar: it draws nothing in a pipe, and it reads the
    logged metrics after every step, a host sync per step on CUDA (`.item()`)."""
    return TQDMProgressBar(refresh_rate=max(1, int(refresh_rate)))


def build_callbacks(cfg: DictConfig | None) -> list[Callback]:
    """The `callbacks` group, in order: a null entry, or one whose `enabled` is false / null / 0, is left out;
    `enabled` is not an argument of the target; a target that returns None adds nothing."""
    entries = {name: node for name, node in (cfg or {}).items() if node is not None}
    for name, node in entries.items():
        if "_target_" not in node:
            raise ValueError(f"callbacks.{name}: no _target_ (a callback entry names its class with _target_)")
    callbacks: list[Callback] = []
    for node in entries.values():
        if not node.get("enabled", True):  # read alone: a disabled entry's other values are never resolved
            continue
        node = to_dict(node)
        node.pop("enabled", None)
        callback = hydra.utils.instantiate(node, _convert_="all")
        if callback is not None:
            callbacks.append(callback)
    return callbacks
