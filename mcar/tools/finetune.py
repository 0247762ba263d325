"""`mcar finetune mask=diagd steps=1000 [init_from=path/to.ckpt]` (= `python finetune.py`): fine-tune a pre-trained
model.

Starts from the weights of `init_from` (default: the most trained last.ckpt, most steps then newest, of a
pre-training run of this data and model under checkpoints/, named in the log with its step and the runs passed
over), keeps that checkpoint's model config, and trains `steps` steps with a fresh optimiser into its own run dir.
`retoken=true` starts from a model of another patch VQ (e.g. the shipped vq=tiles world model on
`data=crafter_tiles_all_world vq=tiles_all`): each code reads as init_from's code with its pixels.
"""
from omegaconf import DictConfig

from mcar.hydra_app import hydra_tool
from mcar.train.finetune import prepare_finetune
from mcar.train.task import run


@hydra_tool("finetune")
def main(cfg: DictConfig) -> None:
    run(cfg, init_from=prepare_finetune(cfg))
