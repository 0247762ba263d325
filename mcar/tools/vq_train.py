"""`mcar vq_train [hydra overrides]` (conf/vq_train.yaml): train or fine-tune the VQ image tokenizer
(mcar/train/vq_training.py says how)."""
from omegaconf import DictConfig

from mcar.hydra_app import hydra_tool
from mcar.train.vq_training import train


@hydra_tool("vq_train")
def main(cfg: DictConfig) -> None:
    train(cfg)
