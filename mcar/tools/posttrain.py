"""`mcar posttrain init_from=<ckpt> [steps=100 sampler=ntp posttrain.rewards.action=...]` (= `python posttrain.py`):
GRPO on the model's own rollouts from fresh Crafter worlds, rewarded against the simulator (mcar/train/posttrain.py).

Starts from the weights of `init_from` (default: the most trained pre-training run of this data and model), keeps its
model and data config, and trains `steps` steps into its own run dir; `ckpt_path=last` resumes.
"""
from omegaconf import DictConfig, open_dict

from mcar.data.crafter_starts import StartsDataModule
from mcar.hydra_app import hydra_tool, to_dict
from mcar.train.finetune import prepare_finetune
from mcar.train.task import run


def _none_or_dict(node) -> dict | None:
    """A config node -> a dict; null stays None (no recall plans or placing: not their defaults, which {} means)."""
    return None if node is None else to_dict(node)


def starts_datamodule(cfg: DictConfig) -> StartsDataModule:
    """The run's training batches: `posttrain.starts` fresh worlds per step, clips of `posttrain.rollout_frames`."""
    data = cfg.data
    return StartsDataModule(layout=dict(h=data.h, w=data.w, n_a=data.n_a), codebook_size=data.codebook_size,
                            frames=cfg.posttrain.rollout_frames, vq_path=cfg.get("vq", {}).get("path"),
                            view=data.get("view"), daylight=data.get("daylight"),
                            policy_mix=to_dict(cfg.starts.policy_mix), starts=cfg.posttrain.starts,
                            seed_base=cfg.starts.seed_base, warmup=cfg.starts.warmup,
                            clips_per_world=cfg.starts.clips_per_world, recall=_none_or_dict(cfg.starts.get("recall")),
                            placing=_none_or_dict(cfg.starts.get("placing")))


@hydra_tool("posttrain")
def main(cfg: DictConfig) -> None:
    init_from = prepare_finetune(cfg)
    with open_dict(cfg):
        cfg.init_from = init_from  # the KL anchor (module.reference)
    run(cfg, init_from=init_from, datamodule=starts_datamodule(cfg))
