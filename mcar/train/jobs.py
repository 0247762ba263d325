"""One Hydra job of a training run: its name (a multirun job's number, its W&B group), its checkpoint dir and the
checkpoint it resumes."""
from __future__ import annotations

import logging
import re
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from mcar.atomic import write_atomic
from mcar.checkpoint.io import is_sharded_checkpoint, load_weights_only
from mcar.hydra_app import hydra_job

log = logging.getLogger("mcar")

def finalize_run_name(cfg: DictConfig) -> None:
    multi, num, group = hydra_job()
    with open_dict(cfg):
        if multi:
            cfg.run_name = f"{cfg.run_name}-j{num}"
        if cfg.get("logger") and "group" in cfg.logger:
            cfg.logger.group = group


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.,=+-]*")


def check_run_name(name) -> str:
    """run_name names a folder under paths.checkpoint_root (and a W&B run): a plain name, no path in it, so a run
    never writes outside the checkpoint root (`run_name=../../x`)."""
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"run_name={name!r}: a plain name is needed (letters, digits and _ . , = + -, starting "
                         f"with a letter or digit; no / and no ..), it names the run's folder under "
                         f"paths.checkpoint_root")
    return name


def take_free_run_name(cfg: DictConfig) -> None:
    """A fresh run whose run_name already holds checkpoints (the same command run twice) becomes <run_name>-2, -3,
    ... (said in the log); `ckpt_path=last` with the first name still resumes the first run. An explicit
    checkpoint.dir is left as given (check_fresh_checkpoint_dir refuses it if taken)."""
    if not OmegaConf.is_interpolation(cfg.checkpoint, "dir"):
        return
    taken = lambda d: d.is_dir() and any(d.glob("*.ckpt"))  # a live run without checkpoints yet: claim() refuses
    first, n = cfg.run_name, 1
    while taken(checkpoint_dir(cfg)):
        n += 1
        with open_dict(cfg):
            cfg.run_name = f"{first}-{n}"
    if n > 1:
        log.warning("run_name %s already holds a run's checkpoints: this fresh run is %s (resume the first with "
                    "ckpt_path=last run_name=%s)", first, cfg.run_name, first)


def checkpoint_dir(cfg: DictConfig) -> Path:
    """checkpoint.dir (default <paths.checkpoint_root>/<run_name>): where Checkpoints writes and `last` resumes."""
    return Path(OmegaConf.select(cfg, "checkpoint.dir", default=None) or
                Path(cfg.paths.checkpoint_root) / cfg.run_name)


def newest_step_checkpoint(folder: Path) -> Path | None:
    """The step checkpoint (step<N>.ckpt, a file or a sharded folder) with the highest N in folder, None if none."""
    found = []
    for path in folder.glob("step*.ckpt"):
        m = re.fullmatch(r"step=?(\d+)\.ckpt", path.name)
        if m and (path.is_file() or is_sharded_checkpoint(path)):
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def checkpoint_step(path: Path) -> int | None:
    """The global step a checkpoint file was saved at (read memory-mapped: its tensors stay on disk), None for a
    sharded folder or a file that is not a whole checkpoint."""
    if not path.is_file():
        return None
    try:
        step = load_weights_only(path, "checkpoint", mmap=True).get("global_step")
    except ValueError:
        return None
    return int(step) if isinstance(step, int) else None


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """ckpt_path: null -> fresh run; 'last' -> this run's newest complete checkpoint: last.ckpt, unless a step
    checkpoint is newer (a run stopped between writing a step checkpoint and last.ckpt has none, or an older one);
    else a file that must exist (or the folder of a sharded checkpoint: trainer=fsdp
    trainer.strategy.save_distributed_checkpoint=true)."""
    p = cfg.get("ckpt_path")
    if p is None:
        return None
    path = checkpoint_dir(cfg) / "last.ckpt" if p == "last" else Path(p)
    if p == "last":
        step = newest_step_checkpoint(path.parent) if path.parent.is_dir() else None
        n = int(re.search(r"\d+", step.name).group()) if step is not None else None
        if step is not None and not (path.is_file() or is_sharded_checkpoint(path)):
            log.warning("ckpt_path=last: %s has no last.ckpt (stopped while writing one?): resuming from %s",
                        path.parent, step.name)
            return str(step)
        at = checkpoint_step(path) if step is not None else None
        if at is not None and n > at:
            log.warning("ckpt_path=last: %s's last.ckpt is at step %d, %s is newer (stopped between the two "
                        "writes): resuming from %s", path.parent, at, step.name, step.name)
            return str(step)
    if not (path.is_file() or is_sharded_checkpoint(path)):
        hint = f" (run '{cfg.run_name}' has no last.ckpt yet)" if p == "last" else ""
        raise FileNotFoundError(f"ckpt_path: checkpoint not found: {path}{hint}")
    return str(path)


def write_hydra_record(cfg: DictConfig, output_dir: str | Path) -> None:
    """Hydra's record of the job (.hydra/config.yaml: the config as it ran, hydra.yaml, overrides.yaml), written
    once this run owns its output dir; conf/train.yaml turns Hydra's own early write off (hydra.output_subdir)."""
    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    record = Path(output_dir) / ".hydra"
    write_atomic(record / "config.yaml", OmegaConf.to_yaml(cfg))
    write_atomic(record / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hc})))
    write_atomic(record / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(hc.overrides.task))))


def resume_command(cfg: DictConfig, init_from: str | None = None) -> str:
    """The command line that resumes this run from its checkpoints: the tool, this job's overrides, its final
    run_name (a multirun job's -j<N>, a taken name's -2) and ckpt_path=last (a fine-tuning run keeps its init_from)."""
    import shlex

    from mcar.hydra_app import command_line_overrides

    keep = [o for o in command_line_overrides()
            if o.split("=", 1)[0].lstrip("+~") not in ("ckpt_path", "run_name", "init_from")]
    extra = [f"init_from={init_from}"] if init_from else []
    return shlex.join(["mcar", str(cfg.task), *keep, *extra, f"run_name={cfg.run_name}", "ckpt_path=last"])


def stop_note(cfg: DictConfig, init_from: str | None = None) -> str:
    """What a stopped training run leaves and how to go on: its last checkpoint and the resume command, or (no
    checkpoint written yet) that it starts again from scratch."""
    if cfg.checkpoint.every_n_steps is None:
        return "no checkpoints in this run (checkpoint.every_n_steps=null): nothing to resume"
    folder = checkpoint_dir(cfg)
    last = folder / "last.ckpt"
    kept = last if last.exists() else newest_step_checkpoint(folder) if folder.is_dir() else None
    if kept is None:
        return (f"no checkpoint yet in {folder} (the first at step {cfg.checkpoint.every_n_steps}); the same "
                f"command starts it again")
    return f"kept {kept}; resume with: {resume_command(cfg, init_from)}"
