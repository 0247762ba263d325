"""Crafter episodes, made on first use: `python train.py data=crafter` (data=crafter_tiles_small: the main job).

prepare_data() runs three cached stages under `root` (each skipped when its output is there, each with progress):
    1. the VQ                  the committed small VQ, `vq.path`, or one trained under root/vq (vq_train=true: a
                               training job lends the module its `vq_trainer`; a sampling tool never trains one)
    2. <setting>/episodes/     generated Crafter episodes (mp4 + jsonl)   mcar.crafter.gen
    3. <setting>/tokens_<vq>/  token shards + index                       mcar.data.tokenize
Frames are rendered at the token grid (data.h, data.w) times the VQ's downsampling (x16: 224x384).
<setting> names the generator seed, frames per episode and policy mix (seed0_128f_explorer75_random25), so
changing them never mixes episodes; more episodes extend the same folder.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from mcar.data.token_clips import TokenDataModule


def digest(settings: dict) -> str:
    """8 hex digits naming a setting's full values (its folder: other settings, other episodes)."""
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]


class CrafterDataModule(TokenDataModule):
    def __init__(self, root: str, episodes: int = 12, frames_per_episode: int = 128, gen_seed: int = 0,
                 policy_mix: dict | None = None, workers: int = 2, vq_path: str | None = None,
                 vq_train: bool = False, vq_train_overrides: list | None = None, tokenize_batch: int = 16,
                 view: list | tuple | None = None, daylight: float | None = None, lossless: bool = False,
                 recall: dict | None = None, placing: dict | None = None, **kw):
        """vq_train: tokenise with a VQ trained under root/vq/best, by `vq_trainer` (root=, overrides=, grid=): set in
        code by a training job (mcar.train.task), never by a config. view: Crafter's grid in tiles (W, H), None
        for its default 9x9. daylight: a fixed light level in (0, 1] (1: always noon), None for Crafter's cycle.
        lossless: episodes as bit-exact RGB video (default: yuv444p at crf 12). recall: the explorer's and the
        wanderer's recall plans (mcar.crafter.gen.RECALL_DEFAULTS' keys; {}: those), None: none. placing: the
        wanderer's placed obstacles (PLACING_DEFAULTS' keys; {}: those), None: none."""
        super().__init__(**kw)
        self.root, self.n_episodes, self.frames_per_episode = Path(root), episodes, frames_per_episode
        self.gen_seed, self.policy_mix, self.workers = gen_seed, dict(policy_mix or {}), workers
        self.vq_path, self.vq_train, self.vq_train_overrides = vq_path, vq_train, list(vq_train_overrides or [])
        self.tokenize_batch = tokenize_batch
        self.vq_trainer: Callable | None = None  # a training job's to set
        self.view = None if view is None else tuple(int(v) for v in view)
        if self.view is not None and (len(self.view) != 2 or min(self.view) < 3):
            raise ValueError(f"data.view={list(view)}: Crafter's grid in tiles, [W, H], each >= 3 (e.g. [24, 14])")
        if daylight is not None and not 0 < float(daylight) <= 1:
            raise ValueError(f"data.daylight={daylight}: a light level in (0, 1] (1: always noon), or null for "
                             f"Crafter's day-night cycle")
        self.daylight = None if daylight is None else float(daylight)
        self.lossless = bool(lossless)
        from omegaconf import DictConfig, OmegaConf

        from mcar.crafter.gen import placing_settings, recall_settings

        def plain(x):
            return OmegaConf.to_container(x, resolve=True) if isinstance(x, DictConfig) else x

        self.recall, self.placing = plain(recall), plain(placing)
        self.recall_settings = recall_settings(self.recall)  # a bad setting fails now
        self.placing_settings = placing_settings(self.placing)

    @property
    def set_dir(self) -> Path:
        """One folder per generator setting, e.g. root/seed0_128f_explorer75_random25 (more episodes reuse it)."""
        mix = self.policy_mix or {"random": 0.25, "explorer": 0.75}
        total = sum(mix.values())
        policies = "_".join(f"{k}{round(100 * v / total)}" for k, v in sorted(mix.items()))
        # an explicit view is named even when it is Crafter's own 9x9: its frames are drawn at another size
        view = "" if self.view is None else f"_view{self.view[0]}x{self.view[1]}"
        light = "" if self.daylight is None else f"_daylight{self.daylight:g}"
        video = "_lossless" if self.lossless else ""
        # recall plans, placed obstacles: a short digest of their full settings (other settings, other episodes)
        extras = "".join(f"_{name}{digest(settings)}" for name, settings in
                         (("recall", self.recall_settings), ("placing", self.placing_settings)) if settings is not None)
        return self.root / f"seed{self.gen_seed}_{self.frames_per_episode}f_{policies}{view}{light}{video}{extras}"

    @property
    def episodes_dir(self) -> Path:
        return self.set_dir / "episodes"

    def episode_names(self) -> list[str]:
        from mcar.crafter.gen import episode_name

        return [episode_name(self.gen_seed, i) for i in range(self.n_episodes)]

    def resolved_vq_path(self) -> str | None:
        """The VQ in use: trained under root/vq when asked, else vq.path, else the committed one (None)."""
        return str(self.vq_root / "vq" / "best") if self.vq_train else self.vq_path

    @property
    def vq_root(self) -> Path:
        """Where data.vq_train=true trains (root/vq, root/vq_episodes): one per Crafter view."""
        return self.root if self.view in (None, (9, 9)) else self.root / f"view{self.view[0]}x{self.view[1]}"

    @property
    def tokens_dir(self) -> Path:
        from mcar.tokenizer.vq_model import vq_id

        return self.set_dir / f"tokens_{vq_id(self.resolved_vq_path()).replace('@', '_')}"

    def prepare_data(self) -> None:
        from mcar.crafter.gen import generate
        from mcar.data.index import stale_index
        from mcar.data.tokenize import tokenize_dir
        from mcar.tokenizer.vq_model import frame_size, load_vq, vq_id

        if self.vq_train and not self.vq_ready():
            self.train_vq()
        path = self.resolved_vq_path()
        vq = load_vq(path)
        t0 = time.time()
        generate(self.episodes_dir, self.n_episodes, self.frames_per_episode, self.gen_seed,
                 self.policy_mix or None, self.workers, size=frame_size(vq, self.layout.h, self.layout.w),
                 view=self.view, daylight=self.daylight, lossless=self.lossless, recall=self.recall,
                 placing=self.placing)
        t1 = time.time()
        stale = stale_index(self.tokens_dir, self.episode_names()) if (self.tokens_dir / "index.json").exists() \
            else "no index.json yet"
        if stale is None:
            print(f"crafter data ready in {self.root} (cached)")
            return
        if (self.tokens_dir / "index.json").exists():
            print(f"{self.tokens_dir}/index.json is stale ({stale}): tokenising what is missing, rebuilding it")
        tokenize_dir(self.episodes_dir, self.tokens_dir, "crafter", vq, vq_id(path), self.tokenize_batch,
                     min_frames=self.clip_frames, size=frame_size(vq, self.layout.h, self.layout.w))
        print(f"crafter data: generation {t1 - t0:.0f}s, tokenisation {time.time() - t1:.0f}s")

    def vq_ready(self) -> bool:
        """data.vq_train=true: the VQ under root/vq finished its training (a training cut off after its first
        validation leaves an under-trained best/ with no done.json: it is trained on, never used)."""
        from mcar.tokenizer.vq_model import vq_finished

        return vq_finished(self.vq_root / "vq")

    def train_vq(self) -> None:
        """Train a VQ into root/vq with the training job's vq_trainer (on Crafter episodes under root/vq_episodes)."""
        trainer = self.vq_trainer
        if trainer is None:
            raise FileNotFoundError(f"data.vq_train=true: no trained VQ in {self.vq_root / 'vq' / 'best'} yet; a "
                                    f"training job trains it first (python train.py data=<this data> "
                                    f"data.vq_train=true); other tools only use one")
        view = [] if self.view is None else [f"generate.view=[{self.view[0]},{self.view[1]}]"]
        trainer(root=self.vq_root, overrides=[*view, *self.vq_train_overrides], grid=(self.layout.h, self.layout.w))
