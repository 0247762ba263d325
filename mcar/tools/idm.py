"""`mcar idm [hydra overrides]` (conf/idm.yaml): the command line of mcar.train.idm_training.train_idm."""
from omegaconf import DictConfig

from mcar.hydra_app import hydra_tool
from mcar.train.idm_training import train_idm


@hydra_tool("idm")
def main(cfg: DictConfig) -> None:
    train_idm(cfg)
