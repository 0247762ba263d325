"""The task wrapper behind train.py and finetune.py: builds data, module, callbacks, logger and trainer from the
Hydra config (each a `_target_` node: `data`, `module`, `callbacks`, `logger`, `trainer`), resolves checkpoints,
and always closes the W&B run (so multirun jobs each get their own run)."""
from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf, open_dict

import mcar.config  # noqa: F401  (registers resolvers)
from mcar.config import to_dict
from mcar.core.layout import Layout
from mcar.train.module import MCARModule
from mcar.train.ownership import check_fresh_checkpoint_dir, claim, release
from mcar.core.sampler import build_sampler
from mcar.data.common import build_datamodule

log = logging.getLogger("mcar")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Stream to a temporary file, then rename: a kill mid-save never corrupts the last good checkpoint, and
    the checkpoint is never held in memory as one byte string (Lightning's default does; a 700M model's
    10 GB checkpoint then runs a 24 GiB machine out of memory)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)


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
    mcar.eval.table3 stages) alike. Not Lightning's default rich bar: it draws nothing in a pipe, and it reads the
    logged metrics after every step, a host sync per step on CUDA (`.item()`)."""
    return TQDMProgressBar(refresh_rate=max(1, int(refresh_rate)))


# overrides of the keys that moved into config groups: train.py / finetune.py refuse them with the new name
RENAMED = {"optim.warmup_steps": "lr_schedule.warmup_steps", "optim.min_lr_ratio": "lr_schedule.min_lr_ratio"}


def check_renamed_overrides(args: list[str]) -> None:
    """Exit with the new name when a command line overrides a renamed key (Hydra would only say it is unknown)."""
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in RENAMED:
            sys.exit(f"{key} is now {RENAMED[key]} (conf/lr_schedule/): pass {arg.replace(key, RENAMED[key], 1)}")


def finish_wandb(fn):
    """Task wrapper: whatever happens, close the W&B run so the next multirun job opens its own."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            try:
                import wandb

                if wandb.run is not None:
                    wandb.finish()
            except ImportError:
                pass

    return wrapped


def hydra_job() -> tuple[bool, int, str]:
    """(is multirun, job number, group name) of the current Hydra job; (False, 0, 'mcar') outside Hydra."""
    if not HydraConfig.initialized():
        return False, 0, "mcar"
    hc = HydraConfig.get()
    multi = hc.mode == RunMode.MULTIRUN
    group = Path(hc.sweep.dir).name if multi else hc.job.name
    return multi, hc.job.num if multi else 0, group


def finalize_run_name(cfg: DictConfig) -> None:
    multi, num, group = hydra_job()
    with open_dict(cfg):
        if multi:
            cfg.run_name = f"{cfg.run_name}-j{num}"
        if cfg.get("logger") and "group" in cfg.logger:
            cfg.logger.group = group


def checkpoint_dir(cfg: DictConfig) -> Path:
    """checkpoint.dir (default <paths.checkpoint_root>/<run_name>): where Checkpoints writes and `last` resumes."""
    return Path(OmegaConf.select(cfg, "checkpoint.dir", default=None) or
                Path(cfg.paths.checkpoint_root) / cfg.run_name)


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """ckpt_path: null -> fresh run; 'last' -> this run's last.ckpt; else a file that must exist (or the folder
    of a sharded checkpoint: trainer=fsdp trainer.strategy.save_distributed_checkpoint=true)."""
    p = cfg.get("ckpt_path")
    if p is None:
        return None
    path = checkpoint_dir(cfg) / "last.ckpt" if p == "last" else Path(p)
    if not (path.is_file() or is_sharded_checkpoint(path)):
        hint = f" (run '{cfg.run_name}' has no last.ckpt yet)" if p == "last" else ""
        raise FileNotFoundError(f"ckpt_path: checkpoint not found: {path}{hint}")
    return str(path)


def is_sharded_checkpoint(path: Path) -> bool:
    """A folder of per-rank shards (torch.distributed.checkpoint) with Lightning's meta.pt beside them."""
    return path.is_dir() and (path / "meta.pt").is_file()


def load_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04" and head[:1] != b"\x80":  # torch.save's zip archive, or its legacy pickle
        raise ValueError(f"{path} is not a checkpoint written by torch.save: it starts with {head!r}, not a zip "
                         f"archive (a text file, or the wrong path?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # truncated or not a checkpoint at all
        raise ValueError(f"cannot read checkpoint {path}: {e}") from e


def check_state_shapes(module: torch.nn.Module, state: dict, source: str) -> None:
    """Raise a clear error naming every tensor whose name or shape differs from the module's."""
    own = module.state_dict()
    wrong = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
             for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if wrong or missing or unexpected:
        lines = wrong + [f"{k}: missing in checkpoint" for k in missing] + \
                [f"{k}: not in this model" for k in unexpected]
        shown = "\n  ".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
        raise ValueError(f"checkpoint {source} does not fit this model ({len(lines)} tensors differ):\n  {shown}")


def build_module(cfg: DictConfig) -> MCARModule:
    """The configured `module` node (conf/train.yaml) instantiated with plain values: its `optim` and `lr_schedule`
    stay config dicts (instantiated in configure_optimizers), checked here so a bad target fails before any work."""
    for group in ("optim", "lr_schedule"):
        hydra.utils.instantiate(cfg[group])
    return hydra.utils.instantiate(cfg.module, _recursive_=False, _convert_="all")


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


def build_trainer(cfg: DictConfig, output_dir: str, extra_callbacks: list[Callback] = ()) -> L.Trainer:
    """The configured trainer with the `callbacks` group, then `extra_callbacks` (benchmarks). Lightning's own
    checkpointing is off unless a configured callback checkpoints. output_dir: where the run writes (the callbacks
    read ${paths.output_dir}, which is that directory under Hydra)."""
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
    callbacks = build_callbacks(cfg.get("callbacks")) + list(extra_callbacks)
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    logger = hydra.utils.instantiate(cfg.logger) if cfg.get("logger") else False
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=logger,
                                      enable_checkpointing=checkpointing, plugins=[AtomicCheckpointIO()],
                                      _convert_="partial")
    use_tensor_cores_for_fp32(trainer.strategy.root_device)
    return trainer


def use_tensor_cores_for_fp32(device: torch.device) -> None:
    """On CUDA, fp32 matmuls (the fp32 parts of mixed precision, a 32-true run) take TF32 tensor cores: torch's
    "high" precision. Without it they run at a fraction of the GPU's rate (and Lightning warns)."""
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("high")


@finish_wandb
def run(cfg: DictConfig, init_from: str | None = None, callbacks: list[Callback] = ()) -> dict:
    """Fit a model as configured. init_from: a checkpoint whose weights start the run (fine-tuning); callbacks:
    added to the configured ones (benchmarks)."""
    finalize_run_name(cfg)
    return _fit(cfg, cfg.paths.output_dir, resolve_ckpt_path(cfg), init_from, callbacks)


def _fit(cfg: DictConfig, output_dir: str, ckpt_path: str | None, init_from: str | None, callbacks) -> dict:
    L.seed_everything(cfg.seed, workers=True)

    layout = Layout(cfg.data.h, cfg.data.w, cfg.data.n_a)
    # bad sampler or schedule values fail now, not at the first validation
    build_sampler(to_dict(cfg.sampler), layout, cfg.data.clip_frames, schedule=to_dict(cfg.schedule))
    datamodule = build_datamodule(cfg.data)
    with torch.device("cpu"):
        module = build_module(cfg)
    resumed = None  # the resumed checkpoint, read once (shards: torch.distributed.checkpoint checks each tensor)
    if ckpt_path and not is_sharded_checkpoint(Path(ckpt_path)):
        resumed = load_checkpoint(ckpt_path)
        check_state_shapes(module, resumed["state_dict"], ckpt_path)
    if init_from:
        state = load_checkpoint(init_from)["state_dict"]
        check_state_shapes(module, state, init_from)
        module.load_state_dict(state)
    log.info("model %s: %.2fM parameters (%.2fM without embeddings)", cfg.model.name,
             module.num_params() / 1e6, module.num_params(embeddings=False) / 1e6)
    module.build_optimizer()  # bad optim values fail now, naming the field, not at the first step
    max_steps = int(cfg.trainer.max_steps)
    if max_steps == 0 or max_steps < -1:
        raise ValueError(f"trainer.max_steps={max_steps}: nothing to train (a positive number of steps, or -1 "
                         f"for max_epochs)")
    if resumed is not None:
        done = int(resumed.get("global_step", 0))
        del resumed  # Lightning reads the file again when it restores the state
        if 0 < max_steps <= done:
            log.warning("ckpt_path=%s: this run already finished (step %d, trainer.max_steps=%d): nothing to "
                        "train; raise trainer.max_steps to train on", ckpt_path, done, max_steps)
            return {}

    # the config is checked: now this run takes its directories (owned, writable) before any step
    locks = [claim(output_dir, "output dir", cfg.run_name)]
    try:
        if cfg.checkpoint.every_n_steps is not None:
            if ckpt_path is None:  # a fresh run (or fine-tuning) writes into an empty checkpoint dir only
                check_fresh_checkpoint_dir(checkpoint_dir(cfg), cfg.run_name)
            locks.append(claim(checkpoint_dir(cfg), "checkpoint dir", cfg.run_name))
        return _train(cfg, output_dir, module, datamodule, ckpt_path, callbacks)
    finally:
        for lock in locks:
            release(lock)


def _train(cfg: DictConfig, output_dir: str, module, datamodule, ckpt_path: str | None, callbacks) -> dict:
    trainer = build_trainer(cfg, output_dir, callbacks)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if trainer.logger:
        trainer.logger.log_hyperparams({"config": resolved})
    if trainer.is_global_zero:
        OmegaConf.save(cfg, Path(output_dir) / "resolved_config.yaml", resolve=True)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    log.info("done: %s; checkpoints in %s", metrics, checkpoint_dir(cfg))
    return metrics
