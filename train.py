"""Pre-train an MC-AR model: `python train.py model=700m` (see conf/train.yaml for every option)."""
import sys

import hydra
from omegaconf import DictConfig

import mcar.config  # noqa: F401  (registers the config resolvers before Hydra composes)
from mcar.train.task import check_renamed_overrides, run


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    check_renamed_overrides(sys.argv[1:])
    main()
