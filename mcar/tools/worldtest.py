"""`mcar worldtest [hydra overrides]` (conf/worldtest.yaml): the command line of mcar.crafter.world_tests."""
from omegaconf import DictConfig

from mcar.crafter.world_tests import world_tests
from mcar.hydra_app import hydra_tool
from mcar.wandb_run import finishing


@hydra_tool("worldtest")
@finishing
def main(cfg: DictConfig) -> None:
    world_tests(cfg)
