"""`mcar train [hydra overrides]` (= `python train.py`): pre-train an MC-AR model (conf/train.yaml has every option)."""
from omegaconf import DictConfig

from mcar.hydra_app import hydra_tool
from mcar.train.task import run


@hydra_tool("train")
def main(cfg: DictConfig) -> None:
    run(cfg)
