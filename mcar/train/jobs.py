"""One Hydra job of a training run: its name (a multirun job's number, its W&B group), its checkpoint dir, the
checkpoint it resumes, renamed overrides refused by name, and its W&B run closed whatever happens."""
from __future__ import annotations

import functools
import logging
import re
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from mcar.hydra_app import CONF_DIR
from mcar.train.checkpoint_io import is_sharded_checkpoint

log = logging.getLogger("mcar")

# overrides of the keys that moved into config groups: train.py / finetune.py refuse them with the new name
RENAMED = {"optim.warmup_steps": "lr_schedule.warmup_steps", "optim.min_lr_ratio": "lr_schedule.min_lr_ratio"}


def check_renamed_overrides(args: list[str]) -> list[str]:
    """Exit with the new name when a command line overrides a renamed key (Hydra would only say it is unknown)."""
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in RENAMED:
            sys.exit(f"{key} is now {RENAMED[key]} (conf/lr_schedule/): pass {arg.replace(key, RENAMED[key], 1)}")
    return args


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


def write_hydra_record(cfg: DictConfig, output_dir: str | Path) -> None:
    """Hydra's record of the job (.hydra/config.yaml: the config as it ran, hydra.yaml, overrides.yaml), written
    once this run owns its output dir; conf/train.yaml turns Hydra's own early write off (hydra.output_subdir)."""
    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    record = Path(output_dir) / ".hydra"
    record.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, record / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hc}), record / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(list(hc.overrides.task)), record / "overrides.yaml")


def command_line_overrides() -> list[str]:
    """The Hydra job's command-line overrides ([] outside a Hydra app)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def relocate_assets(node):
    """Every string leaf of a checkpoint's config through hydra_app.relocated_asset."""
    from mcar.hydra_app import relocated_asset

    if isinstance(node, dict):
        return {k: relocate_assets(v) for k, v in node.items()}
    if isinstance(node, list):
        return [relocate_assets(v) for v in node]
    return relocated_asset(node)


# Hydra's instantiate keys: the only config keys that make Hydra import and call something
HYDRA_CODE_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")
CODE_KEY = re.compile(r"_\w+_")  # and any other key of that shape a later Hydra may give a meaning
FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
GROUP_OPTION = re.compile(r"[A-Za-z0-9_]+")


def packaged_group_config(group: str, option) -> dict | None:
    """This install's mcar/conf/<group>/<option>.yaml, unresolved, on top of the same-group configs its defaults
    list extends (crafter_tiles extends crafter); None when the group has no such option."""
    path = CONF_DIR / group / f"{option}.yaml"
    if not isinstance(option, str) or not GROUP_OPTION.fullmatch(option) or not path.is_file():
        return None  # a name such as ../x never leaves conf/<group>/
    node = OmegaConf.load(path)
    defaults = list(node.pop("defaults", None) or [])
    layers = [entry for entry in defaults if isinstance(entry, str)]  # other groups' entries ({/vq@...: small})
    if "_self_" not in layers:
        layers.append("_self_")
    merged = OmegaConf.create()
    for entry in layers:
        merged = OmegaConf.merge(merged, node if entry == "_self_" else packaged_group_config(group, entry) or {})
    return OmegaConf.to_container(merged, resolve=False)


def is_code_key(key) -> bool:
    return isinstance(key, str) and (key in HYDRA_CODE_KEYS or CODE_KEY.fullmatch(key) is not None)


def code_keys(node, field: str):
    """The dotted names of every Hydra instantiate key in a nested config."""
    if isinstance(node, dict):
        for key, v in node.items():
            yield from [f"{field}.{key}"] if is_code_key(key) else code_keys(v, f"{field}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from code_keys(v, f"{field}[{i}]")


def checked_checkpoint_value(value, packaged, source: str, field: str, origin: str | None, hint: str = ""):
    """A config value stored in a checkpoint -> itself (tuples as lists), once it is found to be data only: numbers,
    strings, bools, None, and lists and mappings of those. A checkpoint is data, never code, so each Hydra
    instantiate key (`_target_`, `_partial_`, `_args_`, `_recursive_`, ...) in it must equal the one at the same
    place in `packaged` (this install's config group, `origin`), and no string may be an interpolation (`${...}`
    reads environment variables and other config values): anything else is refused, naming the field (`hint`
    says what to do instead)."""
    own = f"a checkpoint's config is data, never code{hint}"
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            where = f"{field}.{key}"
            if is_code_key(key):
                if origin is None:
                    raise ValueError(f"{source}: refused the checkpoint's {where}={v!r}: code may be named only by "
                                     f"mcar's own config groups (mcar/conf/); {own}")
                want = packaged.get(key) if isinstance(packaged, dict) else None
                if not isinstance(packaged, dict) or key not in packaged or v != want:
                    said = f"{want!r}" if isinstance(packaged, dict) and key in packaged else "no such key"
                    raise ValueError(f"{source}: refused the checkpoint's {where}={v!r}: {origin} has {said} there, "
                                     f"and {own}")
                out[key] = v
            elif not isinstance(key, str) or not FIELD_NAME.fullmatch(key):
                raise ValueError(f"{source}: refused the checkpoint's {field}: its key {key!r} is not a config field "
                                 f"name; {own}")
            else:
                out[key] = checked_checkpoint_value(v, packaged.get(key) if isinstance(packaged, dict) else None,
                                                    source, where, origin, hint)
        return out
    if isinstance(value, (list, tuple)):
        theirs = packaged if isinstance(packaged, list) else []
        return [checked_checkpoint_value(v, theirs[i] if i < len(theirs) else None, source, f"{field}[{i}]", origin,
                                         hint) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        raise ValueError(f"{source}: refused the checkpoint's {field}={value!r}: an interpolation, which would read "
                         f"environment variables or other config values; {own}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{source}: refused the checkpoint's {field}: a {type(value).__name__}, not a plain value "
                     f"(number, string, bool, list or mapping of those); {own}")


def checkpoint_group_config(group: str, node, source: str) -> dict:
    """A config group as a checkpoint stores it (its data, VQ or schedule) -> the plain config to adopt: checked
    against this install's mcar/conf/<group>/<its name>.yaml (checked_checkpoint_value), asset paths relocated."""
    if not isinstance(node, dict):
        raise ValueError(f"{source}: refused the checkpoint's {group}: a {type(node).__name__}, not a config mapping")
    name = node.get("name")
    packaged = packaged_group_config(group, name)
    origin = None if packaged is None else f"mcar/conf/{group}/{name}.yaml"
    hint = f" (to choose the {group} config yourself, pass {group}=<option> on the command line)"
    named = next(code_keys(node, group), None)
    if packaged is None and named is not None:
        raise ValueError(f"{source}: refused the checkpoint's {named}: code may be named only as mcar's own config "
                         f"group has it, and mcar/conf/{group}/ has no config {name!r} (the checkpoint's "
                         f"{group}.name); a checkpoint's config is data, never code{hint}")
    return own_locations(group, relocate_assets(checked_checkpoint_value(node, packaged, source, group, origin,
                                                                          hint)), packaged)


# where a config group builds and writes: this install's own settings, never a checkpoint's (a checkpoint's data.root
# decided where generate / evaluate / play built data, anywhere on disk; its vq_train_overrides are Hydra override
# strings: a VQ `out=` anywhere, 1e6 episodes on 64 workers, a hydra.searchpath)
OWN_LOCATIONS = {"data": ("root", "vq_train_overrides")}


def own_locations(group: str, adopted: dict, packaged: dict | None) -> dict:
    """The adopted config with OWN_LOCATIONS taken from this install's config of the same name (left out where it
    has none: the command line then gives them, e.g. data.root=)."""
    for key in OWN_LOCATIONS.get(group, ()):
        adopted.pop(key, None)
        if packaged is not None and key in packaged:
            adopted[key] = packaged[key]
    return adopted


# model fields of a checkpoint that finetune copies into its config: plain values too (no interpolation)
COPIED_MODEL_FIELDS = ("arch", "model_name")


def adopt_checkpoint_config(cfg: DictConfig, hp: dict, source, groups=("data", "vq")) -> list[str]:
    """Take the config groups a checkpoint carries (its data and VQ, for sampling also its schedule) unless the
    command line names them: `mcar finetune` after `mcar train data=synthetic`, or `mcar evaluate ckpt=...`, need
    no data= repeated. A conflicting override is then checked against the checkpoint (check_data_fits). -> the
    groups taken. What is taken is data only (checkpoint_group_config): plain values, and Hydra's `_target_` keys
    exactly as this install's own config group has them, or the checkpoint is refused. Outside a Hydra app (a
    config composed in code) nothing is taken: the caller's config is whole."""
    for key in COPIED_MODEL_FIELDS:
        if key in hp:
            checked_checkpoint_value(hp[key], None, source, key, None)
    if not HydraConfig.initialized():
        return []
    keys = [(o.split("=", 1)[0].lstrip("+~"), o) for o in command_line_overrides() if "=" in o]
    chosen = {key.split("@")[0] for key, _ in keys if "." not in key}  # data=crafter: the user's own choice
    taken = [g for g in groups if hp.get(g) is not None and g not in chosen]
    adopted = {group: checkpoint_group_config(group, hp[group], source) for group in taken}
    with open_dict(cfg):
        for group in taken:  # asset paths (the VQ) of the install that trained it point into this one's
            cfg[group] = OmegaConf.create(adopted[group])
        # data.n_a=1 on the command line still applies, on top of the checkpoint's data (and is then checked)
        cfg.merge_with_dotlist([o.lstrip("+") for key, o in keys
                                if key.split(".")[0] in taken and "." in key and not o.startswith("~")])
    if taken:
        log.info("%s: %s as the checkpoint was trained (override with %s)", source, " and ".join(taken),
                 ", ".join(f"{g}=..." for g in taken))
    return taken
