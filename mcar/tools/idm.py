"""`mcar idm [hydra overrides]` (conf/idm.yaml): the command line of mcar.eval.idm.train_idm."""
from omegaconf import DictConfig

from mcar.eval.idm import train_idm
from mcar.hydra_app import hydra_tool


@hydra_tool("idm")
def main(cfg: DictConfig) -> None:
    train_idm(cfg)
