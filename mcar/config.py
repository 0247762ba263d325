"""OmegaConf resolvers used by conf/ (registered on import) and small config helpers."""
from __future__ import annotations

import math

import torch
from omegaconf import DictConfig, OmegaConf


def _precision() -> str:
    """bf16 mixed precision where a GPU is present, full fp32 on CPU."""
    return "bf16-mixed" if torch.cuda.is_available() else "32-true"


def register_resolvers() -> None:
    for name, fn in {"mcar_sum": lambda *xs: sum(int(x) for x in xs),
                     "mcar_prod": lambda *xs: math.prod(int(x) for x in xs), "mcar_precision": _precision}.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


def to_dict(cfg: DictConfig | dict | None) -> dict:
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg)
