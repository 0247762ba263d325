"""OmegaConf resolvers used by conf/ (registered on import) and small config helpers."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf


def _precision() -> str:
    """bf16 mixed precision where a GPU is present, full fp32 on CPU."""
    return "bf16-mixed" if torch.cuda.is_available() else "32-true"


def asset_path(name: str) -> str:
    """The absolute path of a committed asset folder, mcar/assets/<name> (conf: `${mcar_asset:vq_crafter_tiles}`)."""
    assets = Path(__file__).parent / "assets"
    if not (assets / name).is_dir():
        raise FileNotFoundError(f"no committed asset {name!r} in {assets} (there: "
                                f"{sorted(p.name for p in assets.iterdir() if p.is_dir())})")
    return str(assets / name)


def register_resolvers() -> None:
    for name, fn in {"mcar_sum": lambda *xs: sum(int(x) for x in xs),
                     "mcar_prod": lambda *xs: math.prod(int(x) for x in xs), "mcar_precision": _precision,
                     "mcar_asset": asset_path}.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


def to_dict(cfg: DictConfig | dict | None) -> dict:
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg)
