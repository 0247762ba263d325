"""`mcar posttrain init_from=<ckpt> [steps=100 sampler=ntp posttrain.rewards.action=...]` (= `python posttrain.py`):
GRPO on the model's own rollouts from fresh simulator worlds (`posttrain.data`, Crafter's by default), rewarded
against the simulator (mcar/train/posttrain.py).

Starts from the weights of `init_from` (default: the most trained pre-training run of this data and model), keeps its
model and data config, and trains `steps` steps into its own run dir; `ckpt_path=last` resumes.
"""
import hydra
from omegaconf import DictConfig, open_dict

from mcar.hydra_app import hydra_tool
from mcar.train.finetune import prepare_finetune
from mcar.train.task import run


@hydra_tool("posttrain")
def main(cfg: DictConfig) -> None:
    init_from = prepare_finetune(cfg)
    with open_dict(cfg):
        cfg.init_from = init_from  # the KL anchor (module.reference)
    # built after the checkpoint's data config is adopted: its layout and VQ are the model's
    run(cfg, init_from=init_from, datamodule=hydra.utils.instantiate(cfg.posttrain.data))
