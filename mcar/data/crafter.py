"""The embedded default: Crafter episodes, made on first use. `python train.py data=crafter`.

prepare_data() runs three cached stages under `root` (each skipped when its output is there, each with progress):
    1. <setting>/episodes/     generated Crafter episodes (mp4 + jsonl)   mcar.data.crafter_gen
    2. the VQ                  the committed small VQ, `vq.path`, or one trained under root/vq (vq_train=true)
    3. <setting>/tokens_<vq>/  token shards + index                       mcar.data.tokenize
<setting> names the generator seed, frames per episode and policy mix (seed0_128f_explorer75_random25), so
changing them never mixes episodes; more episodes extend the same folder.
"""
from __future__ import annotations

import time
from pathlib import Path

from mcar.data.tokens import TokenDataModule


class CrafterDataModule(TokenDataModule):
    def __init__(self, root: str, episodes: int = 12, frames_per_episode: int = 128, gen_seed: int = 0,
                 policy_mix: dict | None = None, workers: int = 2, vq_path: str | None = None,
                 vq_train: bool = False, vq_train_overrides: list | None = None, tokenize_batch: int = 16, **kw):
        super().__init__(**kw)
        self.root, self.n_episodes, self.frames_per_episode = Path(root), episodes, frames_per_episode
        self.gen_seed, self.policy_mix, self.workers = gen_seed, dict(policy_mix or {}), workers
        self.vq_path, self.vq_train, self.vq_train_overrides = vq_path, vq_train, list(vq_train_overrides or [])
        self.tokenize_batch = tokenize_batch

    @property
    def set_dir(self) -> Path:
        """One folder per generator setting, e.g. root/seed0_128f_explorer75_random25 (more episodes reuse it)."""
        mix = self.policy_mix or {"random": 0.25, "explorer": 0.75}
        total = sum(mix.values())
        policies = "_".join(f"{k}{round(100 * v / total)}" for k, v in sorted(mix.items()))
        return self.root / f"seed{self.gen_seed}_{self.frames_per_episode}f_{policies}"

    @property
    def episodes_dir(self) -> Path:
        return self.set_dir / "episodes"

    def episode_names(self) -> list[str]:
        from mcar.data.crafter_gen import episode_name

        return [episode_name(self.gen_seed, i) for i in range(self.n_episodes)]

    def resolved_vq_path(self) -> str | None:
        """The VQ in use: trained under root/vq when asked, else vq.path, else the committed one (None)."""
        return str(self.root / "vq" / "best") if self.vq_train else self.vq_path

    @property
    def tokens_dir(self) -> Path:
        from mcar.tokenizer.vq import vq_id

        return self.set_dir / f"tokens_{vq_id(self.resolved_vq_path()).replace('@', '_')}"

    def prepare_data(self) -> None:
        from mcar.data.crafter_gen import generate
        from mcar.data.tokenize import tokenize_dir
        from mcar.tokenizer.vq import load_vq, vq_id

        t0 = time.time()
        generate(self.episodes_dir, self.n_episodes, self.frames_per_episode, self.gen_seed,
                 self.policy_mix or None, self.workers)
        t1 = time.time()
        if self.vq_train and not (self.root / "vq" / "best" / "config.json").exists():
            train_vq(self.root, self.vq_train_overrides)
        path = self.resolved_vq_path()
        vq = load_vq(path)
        if (self.tokens_dir / "index.json").exists() and self._all_done():
            print(f"crafter data ready in {self.root} (cached)")
            return
        tokenize_dir(self.episodes_dir, self.tokens_dir, "crafter", vq, vq_id(path), self.tokenize_batch,
                     min_frames=self.clip_frames)
        print(f"crafter data: generation {t1 - t0:.0f}s, tokenisation {time.time() - t1:.0f}s")

    def _all_done(self) -> bool:
        done = {p.name[: -len(".frames.npy")] for p in self.tokens_dir.glob("*.frames.npy")}
        return set(self.episode_names()) <= done


def train_vq(root: Path, overrides: list[str]) -> None:
    """Train a small VQ with conf/vq_train.yaml (+ overrides), on Crafter episodes under root/vq_episodes."""
    import torch
    from omegaconf import OmegaConf

    from mcar.train.vq import train

    conf = Path(__file__).resolve().parents[2] / "conf"
    base = OmegaConf.load(conf / "vq_train.yaml")
    for key in ("defaults", "hydra"):
        base.pop(key, None)
    cfg = OmegaConf.merge(base, {"vq": OmegaConf.load(conf / "vq" / "small.yaml"),
                                 "paths": {"data_dir": str(root.parent), "checkpoint_root": str(root)}},
                          OmegaConf.from_dotlist([f"episodes={root / 'vq_episodes'}", f"out={root / 'vq'}",
                                                  *overrides]))
    threads = torch.get_num_threads()
    train(cfg)
    torch.set_num_threads(threads)  # vq_train's thread count is for its own background runs
