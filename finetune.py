"""Fine-tune a pre-trained model: `python finetune.py mask=diagd steps=1000 [init_from=path/to.ckpt]`.

Starts from the weights of `init_from` (default: the newest last.ckpt of a pre-training run under checkpoints/),
keeps that checkpoint's model config, and trains `steps` steps with a fresh optimiser into its own run dir.
"""
import sys

import hydra
from omegaconf import DictConfig

import mcar.config  # noqa: F401
from mcar.train.finetune import prepare_finetune
from mcar.train.task import check_renamed_overrides, run


@hydra.main(version_base="1.3", config_path="conf", config_name="finetune")
def main(cfg: DictConfig) -> None:
    init_from = prepare_finetune(cfg)
    run(cfg, init_from=init_from)


if __name__ == "__main__":
    check_renamed_overrides(sys.argv[1:])
    main()
