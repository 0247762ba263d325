"""`mcar evaluate [hydra overrides]` (conf/evaluate.yaml): the command line of mcar.eval.evaluate.evaluate."""
from omegaconf import DictConfig

from mcar.eval.evaluate import evaluate
from mcar.hydra_app import hydra_tool
from mcar.train.jobs import finish_wandb


@hydra_tool("evaluate")
@finish_wandb
def main(cfg: DictConfig) -> None:
    evaluate(cfg)
