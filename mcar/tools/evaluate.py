"""`mcar evaluate [hydra overrides]` (conf/evaluate.yaml): the command line of mcar.eval.evaluate.evaluate."""
from omegaconf import DictConfig

from mcar.eval.evaluate import evaluate
from mcar.hydra_app import hydra_tool
from mcar.wandb_run import finishing


@hydra_tool("evaluate")
@finishing
def main(cfg: DictConfig) -> None:
    evaluate(cfg)
