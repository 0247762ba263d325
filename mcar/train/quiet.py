"""Start-up notices of Lightning and W&B that say nothing about the run, each stopped where it is made, in one
place (tests/test_quiet.py holds a short run's output to it):

- "💡 Tip: ... litlogger ...": Lightning's advert on every Trainer without its LitLogger (a log filter).
- "`Trainer(limit_val_batches=1.0)` was configured so 100% ...": said when the default is passed explicitly;
  conf/trainer/default.yaml leaves it null (Lightning's default, all batches).
- "Checkpoint directory ... exists and is not empty": our own owner lock (mcar.train.ownership) made the folder
  non-empty; `Checkpoints` warns only about checkpoints there, and not when resuming from them.
- The model summary table with "FLOPs 0" (Lightning counts FLOPs only with an example input): off in
  conf/trainer/default.yaml; the run's first log line gives the parameter count.
- "`isinstance(treespec, LeafSpec)` is deprecated": torch >= 2.10 on Lightning's own _pytree (not our code).
- "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable":
  ours is (ClipDataModule.train_dataloader starts at the resumed global step: exact resume, the soak test).
- W&B's "The anonymous setting has no effect": Lightning's WandbLogger passes anonymous=None, which wandb warns
  about (`wandb_logger` drops the key).
"""
from __future__ import annotations

import logging
import warnings

from lightning.pytorch.loggers import WandbLogger

LIGHTNING_INFO = "lightning.pytorch.utilities.rank_zero"


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


def quiet_lightning() -> None:
    """Drop the notices above that a filter can reach (idempotent)."""
    log = logging.getLogger(LIGHTNING_INFO)
    if not any(isinstance(f, _DropAdverts) for f in log.filters):
        log.addFilter(_DropAdverts())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")


def wandb_logger(quiet: bool = True, **kwargs) -> WandbLogger:
    """Lightning's WandbLogger without the `anonymous` key it always passes to wandb.init (conf/logger/wandb.yaml);
    quiet: W&B's own banners and closing history/summary panel left out (the run's summary names the W&B run)."""
    logger = WandbLogger(**kwargs)
    logger._wandb_init.pop("anonymous", None)
    if quiet:
        logger._wandb_init["settings"] = {**dict(logger._wandb_init.get("settings") or {}), "quiet": True}
    return logger
