"""The task wrapper behind `mcar train` and `mcar finetune`: builds data, module, callbacks, logger and trainer from
the Hydra config (each a `_target_` node: `data`, `module`, `callbacks`, `logger`, `trainer`), resolves checkpoints,
and always closes the W&B run (so multirun jobs each get their own run)."""
from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf, open_dict

from mcar.assets import assets_by_name
from mcar.atomic import write_atomic
from mcar.checkpoint.io import (
    AtomicCheckpointIO,
    check_sharded_checkpoint,
    check_state_shapes,
    is_sharded_checkpoint,
    load_checkpoint,
)
from mcar.core.devices import set_threads
from mcar.core.layout import Layout
from mcar.core.sampler import check_sampler_config
from mcar.data.common import build_datamodule, complete_data_config
from mcar.hydra_app import to_dict
from mcar.stopping import on_stop_say
from mcar.train.callbacks import Checkpoints, build_callbacks
from mcar.train.finetune import initial_state
from mcar.train.jobs import (
    check_run_name,
    checkpoint_dir,
    finalize_run_name,
    resolve_ckpt_path,
    stop_note,
    take_free_run_name,
    write_hydra_record,
)
from mcar.train.module import MCARModule
from mcar.train.ownership import check_fresh_checkpoint_dir, claim, release
from mcar.train.quiet import quiet_lightning
from mcar.train.summary import print_summary
from mcar.wandb_run import finishing

log = logging.getLogger("mcar")


def build_module(cfg: DictConfig) -> MCARModule:
    """The configured `module` node (conf/train.yaml) instantiated with plain values: its `optim` and `lr_schedule`
    stay config dicts (instantiated in configure_optimizers), checked here so a bad target fails before any work."""
    for group in ("optim", "lr_schedule"):
        hydra.utils.instantiate(cfg[group])
    return hydra.utils.instantiate(cfg.module, _recursive_=False, _convert_="all")


def build_trainer(cfg: DictConfig, output_dir: str, extra_callbacks: list[Callback] = ()) -> L.Trainer:
    """The configured trainer with the `callbacks` group, then `extra_callbacks` (benchmarks). Lightning's own
    checkpointing is off unless a configured callback checkpoints. output_dir: where the run writes (the callbacks
    read ${paths.output_dir}, which is that directory under Hydra)."""
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
    quiet_lightning()
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


@finishing
def run(cfg: DictConfig, init_from: str | None = None, callbacks: list[Callback] = (), datamodule=None) -> dict:
    """Fit a model as configured. init_from: a checkpoint whose weights start the run (fine-tuning); callbacks:
    added to the configured ones (benchmarks); datamodule: the training batches (None: the `data` group's clips;
    post-training passes its simulator starts)."""
    check_run_name(cfg.run_name)
    finalize_run_name(cfg)
    with on_stop_say(lambda: stop_note(cfg, init_from)):  # the stop's line names the checkpoint and the resume
        return _fit(cfg, cfg.paths.output_dir, resolve_ckpt_path(cfg), init_from, callbacks, datamodule)


def _fit(cfg: DictConfig, output_dir: str, ckpt_path: str | None, init_from: str | None, callbacks,
         datamodule=None) -> dict:
    set_threads(cfg.get("threads"))
    L.seed_everything(cfg.seed, workers=True)
    if datamodule is None:
        complete_data_config(cfg)  # data=recordings: its grid and actions, read from its folder
    layout = Layout.of(cfg.data)
    # bad sampler or schedule values fail now, not at the first validation (the schedule is built once: the mask
    # factory and the samplers take the same object)
    check_sampler_config(to_dict(cfg.sampler), layout, cfg.data.clip_frames, to_dict(cfg.schedule))
    datamodule = build_datamodule(cfg.data) if datamodule is None else datamodule
    if getattr(datamodule, "vq_train", False):  # training jobs train the VQ their data needs (diffusers: imported then)
        from mcar.train.vq_training import train_for_data

        datamodule.vq_trainer = train_for_data
    with torch.device("cpu"):
        module = build_module(cfg)
    resumed = None  # the resumed checkpoint, read once (shards: torch.distributed.checkpoint checks each tensor)
    if ckpt_path and is_sharded_checkpoint(Path(ckpt_path)):
        check_sharded_checkpoint(ckpt_path)  # torch.distributed.checkpoint unpickles its index with plain pickle
    elif ckpt_path:
        resumed = load_checkpoint(ckpt_path)
        check_state_shapes(module, resumed["state_dict"], ckpt_path)
    if init_from:
        state = initial_state(cfg, init_from)
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
    locks, made = [claim(output_dir, "output dir", cfg.run_name)], []
    failed = True
    try:
        write_hydra_record(cfg, output_dir)
        if cfg.checkpoint.every_n_steps is not None:
            if ckpt_path is None:  # a fresh run (or fine-tuning) writes into an empty checkpoint dir only
                take_free_run_name(cfg)
                check_fresh_checkpoint_dir(checkpoint_dir(cfg), cfg.run_name)
            if not checkpoint_dir(cfg).exists():
                made.append(checkpoint_dir(cfg))
            locks.append(claim(checkpoint_dir(cfg), "checkpoint dir", cfg.run_name))
        result = _train(cfg, output_dir, module, datamodule, ckpt_path, callbacks)
        failed = False
        return result
    finally:
        for lock in locks:
            release(lock)
        if failed and module.first_batch_at is None:  # refused before its first step: no run left behind
            forget_run_records(output_dir, made)


def forget_run_records(output_dir: str | Path, made_dirs: list[Path]) -> None:
    """What a run wrote before its first step: its config records in the output dir (which Hydra then removes
    when nothing else is in it: mcar.hydra_app.remove_unused_run_dir) and the checkpoint dirs it created, if
    still empty."""
    shutil.rmtree(Path(output_dir) / ".hydra", ignore_errors=True)
    (Path(output_dir) / "resolved_config.yaml").unlink(missing_ok=True)
    for folder in made_dirs:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _train(cfg: DictConfig, output_dir: str, module, datamodule, ckpt_path: str | None, callbacks) -> dict:
    trainer = build_trainer(cfg, output_dir, callbacks)
    for callback in trainer.callbacks:  # a resumed run finds its own checkpoints there: nothing to warn about
        if isinstance(callback, Checkpoints):
            callback.resuming = ckpt_path is not None
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if trainer.logger:
        trainer.logger.log_hyperparams({"config": resolved})
    if trainer.is_global_zero:
        write_atomic(Path(output_dir) / "resolved_config.yaml", OmegaConf.to_yaml(assets_by_name(resolved)))
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}  # the summary's loss line says them
    checkpoint = checkpoint_dir(cfg) / "last.ckpt" if cfg.checkpoint.every_n_steps is not None else None
    print_summary(trainer, cfg, output_dir, checkpoint, time.perf_counter() - start)
    return metrics
