"""A checkpoint's config is data, never code: the groups a checkpoint carries (data, VQ, schedule) adopted by the
tools that load it, each value checked against this install's own config group (mcar/conf/<group>/<name>.yaml)."""
from __future__ import annotations

import logging
import re

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from mcar.hydra_app import CONF_DIR, command_line_overrides

log = logging.getLogger("mcar")


def relocate_assets(node):
    """Every string leaf of a checkpoint's config through mcar.assets.relocated_asset."""
    from mcar.assets import relocated_asset

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
OWN_LOCATIONS = {"data": ("root", "vq_train_overrides", "workers", "num_workers")}  # processes: this machine's


def own_settings(group: str, current, adopted: dict) -> dict:
    """Where this run's own config (an experiment's data.root, say) names the same option of the group as the
    checkpoint did, its OWN_LOCATIONS values: the user's, never the checkpoint's."""
    if current is None or current.get("name") != adopted.get("name"):
        return {}
    return {key: current[key] for key in OWN_LOCATIONS.get(group, ()) if key in current}


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


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """Command-line `key=value` overrides set on `cfg` as Hydra sets them: parsed by Hydra's grammar (a YAML dotlist
    would read data.recall={a:1,b:2} as the keys 'a:1' and 'b:2'), a mapping merged into the one there."""
    for override in OverridesParser.create().parse_overrides(overrides):
        OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True, force_add=True)


def adopt_checkpoint_config(cfg: DictConfig, hp: dict, source, groups=("data", "vq"),
                            overrides: list[str] | None = None) -> list[str]:
    """Take the config groups a checkpoint carries (its data and VQ, for sampling also its schedule) unless the
    command line names them: `mcar finetune` after `mcar train data=synthetic`, or `mcar evaluate ckpt=...`, need
    no data= repeated. A conflicting override is then checked against the checkpoint (check_data_fits). -> the
    groups taken. What is taken is data only (checkpoint_group_config): plain values, and Hydra's `_target_` keys
    exactly as this install's own config group has them, or the checkpoint is refused. overrides: the words the
    config was composed with (None: the Hydra app's command line; outside a Hydra app, a config composed in code
    by a test, nothing is taken: the caller's config is whole)."""
    for key in COPIED_MODEL_FIELDS:
        if key in hp:
            checked_checkpoint_value(hp[key], None, source, key, None)
    if overrides is None and not HydraConfig.initialized():
        return []
    words = command_line_overrides() if overrides is None else overrides
    keys = [(o.split("=", 1)[0].lstrip("+~"), o) for o in words if "=" in o]
    chosen = {key.split("@")[0] for key, _ in keys if "." not in key}  # data=crafter: the user's own choice
    taken = [g for g in groups if hp.get(g) is not None and g not in chosen]
    adopted = {group: checkpoint_group_config(group, hp[group], source) for group in taken}
    with open_dict(cfg):
        for group in taken:  # asset paths (the VQ) of the install that trained it point into this one's
            cfg[group] = OmegaConf.create(adopted[group] | own_settings(group, cfg.get(group), adopted[group]))
        # data.n_a=1 on the command line still applies, on top of the checkpoint's data (and is then checked)
        apply_overrides(cfg, [o for key, o in keys if key.split(".")[0] in taken and "." in key
                              and not o.startswith("~")])
    if taken:
        log.info("%s: %s as the checkpoint was trained (override with %s)", source, " and ".join(taken),
                 ", ".join(f"{g}=..." for g in taken))
    return taken
