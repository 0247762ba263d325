"""This install's committed assets (mcar/assets/<name>: the small VQs) and how a config names them: by name, never
by the path of the checkout that wrote it (a checkpoint records mcar/assets/<name>; loading reads it back into
this install's own folder)."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

ASSETS = Path(__file__).resolve().parent / "assets"  # this install's committed asset folders


def asset_path(name: str) -> str:
    """The absolute path of a committed asset folder, mcar/assets/<name> (conf: `${mcar_asset:vq_crafter_tiles}`)."""
    if not (ASSETS / name).is_dir():
        raise FileNotFoundError(f"no committed asset {name!r} in {ASSETS} (there: "
                                f"{sorted(p.name for p in ASSETS.iterdir() if p.is_dir())})")
    return str(ASSETS / name)


def committed_asset(value) -> str | None:
    """The name of the committed asset a path names (<any install>/mcar/assets/<name>, or mcar/assets/<name> as a
    checkpoint records it), None for anything else."""
    if not isinstance(value, str) or "/" not in value:
        return None
    p = Path(value)
    if p.parent.name != "assets" or p.parent.parent.name != "mcar" or not (ASSETS / p.name).is_dir():
        return None
    return p.name


def relocated_asset(value):
    """A committed asset's path as a checkpoint's config has it -> this install's asset of that name, always (a
    path into another clone that exists on this machine would decode with that clone's files); anything else
    unchanged."""
    name = committed_asset(value)
    return value if name is None else asset_path(name)


def assets_by_name(node):
    """Every committed asset's path in a config (dicts, lists, strings) -> mcar/assets/<name>: what a checkpoint
    records, naming no machine's checkout (relocated_asset reads it back into the loading install)."""
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        return {k: assets_by_name(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [assets_by_name(v) for v in node]
    name = committed_asset(node)
    return node if name is None else f"mcar/assets/{name}"
