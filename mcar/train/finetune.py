"""Fine-tuning set-up: find the pre-trained checkpoint and adopt its model config."""
from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, open_dict

from mcar.checkpoint.config import adopt_checkpoint_config, command_line_overrides
from mcar.checkpoint.io import load_checkpoint

log = logging.getLogger("mcar")


def newest_pretrained(checkpoint_root: str | Path) -> Path:
    """The newest last.ckpt under checkpoint_root that is not itself a fine-tuning run."""
    found = [p for p in Path(checkpoint_root).glob("*/last.ckpt") if not p.parent.name.startswith("finetune")]
    if not found:
        raise FileNotFoundError(
            f"init_from: no pre-trained checkpoint (*/last.ckpt) under {checkpoint_root}; "
            f"run train.py first or pass init_from=/path/to.ckpt"
        )
    return max(found, key=lambda p: p.stat().st_mtime)


def prepare_finetune(cfg: DictConfig) -> str:
    """Resolve cfg.init_from and copy the checkpoint's model config and layout checks into cfg."""
    path = Path(cfg.init_from) if cfg.get("init_from") else newest_pretrained(cfg.paths.checkpoint_root)
    hp = load_checkpoint(path).get("hyper_parameters", {})
    if "arch" not in hp:
        raise ValueError(f"init_from: {path} is not an mcar training checkpoint (no model config inside)")
    adopt_checkpoint_config(cfg, hp, f"init_from={path}")
    data = cfg.data
    for field in ("h", "w", "n_a"):
        if hp["layout"][field] != data[field]:
            raise ValueError(f"init_from: {path} was trained with data.{field}={hp['layout'][field]}, "
                             f"but this run has data.{field}={data[field]}")
    if hp["arch"]["vocab_size"] != data.vocab_size:
        raise ValueError(f"init_from: {path} has vocab_size={hp['arch']['vocab_size']}, "
                         f"but data.vocab_size={data.vocab_size}")
    asked = [o for o in command_line_overrides() if o.split("=")[0].lstrip("+~") == "model"]
    if asked and asked[-1].split("=", 1)[1] != hp.get("model_name"):
        raise ValueError(f"{asked[-1]}: fine-tuning keeps the model of init_from ({path}: "
                         f"{hp.get('model_name', 'its own config')}); drop {asked[-1]}, or pass init_from= a "
                         f"checkpoint of that model")
    with open_dict(cfg):
        cfg.init_from = str(path)
        cfg.model.arch = hp["arch"]
        cfg.model.name = hp.get("model_name", cfg.model.name)
    log.info("fine-tuning %s (model %s)", path, cfg.model.name)
    return str(path)
