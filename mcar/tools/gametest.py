"""`mcar gametest env=<Gymnasium id> ckpt=... [hydra overrides]` (conf/gametest.yaml): the command line of
mcar.eval.game_tests."""
from omegaconf import DictConfig

from mcar.eval.game_tests import game_tests
from mcar.hydra_app import hydra_tool


@hydra_tool("gametest")
def main(cfg: DictConfig) -> None:
    game_tests(cfg)
