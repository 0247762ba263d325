"""W&B in one place (offline by default, conf/logger/wandb.yaml): open a tool's run from its `logger` config or find
a trainer's, log tables, curves, pictures and videos, and close the run whatever happens. Training, evaluate and
the world tests use it; wandb is imported only when a run exists."""
from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def wants_wandb(cfg: DictConfig) -> bool:
    """Whether the config's `logger` is W&B (logger=csv or none: no run)."""
    logger = cfg.get("logger")
    return bool(logger) and "wandb" in str(logger.get("_target_", "")).lower()


def open_run(cfg: DictConfig):
    """A sampling tool's W&B run from cfg.logger, its whole config recorded; None when the logger is not W&B."""
    if not wants_wandb(cfg):
        return None
    import hydra

    run = hydra.utils.instantiate(cfg.logger).experiment
    run.config.update(OmegaConf.to_container(cfg, resolve=True), allow_val_change=True)
    return run


def run_of(trainer):
    """The W&B run behind a Lightning trainer's loggers, or None."""
    for lg in trainer.loggers:
        if type(lg).__name__ == "WandbLogger":
            return lg.experiment
    return None


def log_table(run, key: str, columns: list[str], rows: list[list], curve: tuple[str, str, str, str] | None = None):
    """rows under `key` as a W&B table; curve (x, y, stroke, title): also a line plot of it, under `key`_curve."""
    import wandb

    table = wandb.Table(columns=columns, data=rows)
    payload = {key: table}
    if curve is not None:
        x, y, stroke, title = curve
        payload[f"{key}_curve"] = wandb.plot.line(table, x, y, stroke=stroke, title=title)
    run.log(payload)


def log_media(run, media: dict[str, Path]) -> None:
    """{key: file}: a .png as an image, an .mp4 or .gif as a video."""
    import wandb

    run.log({key: wandb.Image(str(path)) if Path(path).suffix == ".png"
             else wandb.Video(str(path), format=Path(path).suffix[1:]) for key, path in media.items()})


def finish() -> None:
    """Close the current W&B run, if any (W&B's closing lines come out now)."""
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.finish()


def finishing(fn):
    """A job wrapper: whatever happens, the W&B run is closed, so the next multirun job opens its own."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            finish()

    return wrapped
