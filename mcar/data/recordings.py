"""Any game's recordings, no code: `python train.py data=recordings data.root=DIR`.

DIR holds episodes (<name>.mp4 + <name>.jsonl, one JSON record per frame) and actions.yaml, the action schema
(mcar.tokenizer.action_schema; `mcar record` writes all three from a Gymnasium game). Before anything is built
the data config is completed from the folder (`complete_config`): the action schema, its token count and ids,
the token grid read off the first frame (its size over the VQ's patch, at most `max_frame_tokens` a frame);
with `record` set, a Gymnasium game is first recorded into `root` (what it lacks; mcar.data.gym_env). With
`vq=patch` (the default) and no vq.path, a patch VQ is fitted on the training episodes on first use and cached
with the tokens under `tokens_root`; `vq=<group> vq.path=<folder>` tokenises with another. Frames are resized to
the grid times the VQ's downsampling and, with `fps`, resampled to that rate (every k-th frame and its action).
Bad records are counted, skipped and named once per episode; a schema error is one line naming the field.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from omegaconf import DictConfig, open_dict

from mcar.data.episodes import episode_files, read_schema
from mcar.data.token_clips import TokenDataModule
from mcar.tokenizer.actions import action_space

AUTO = "auto"


def recordings_key(root: Path, settings: dict) -> str:
    """A folder name for one recordings folder built one way (its tokens, its fitted VQ)."""
    text = json.dumps({"root": str(root.resolve()), **settings}, sort_keys=True)
    return f"{root.name}_{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def first_frame_size(root: Path) -> tuple[int, int]:
    """(H, W) of the first readable frame of the folder's episodes, as stored."""
    from mcar.tokenizer.video import FrameStream

    for mp4 in episode_files(root):
        stream = FrameStream(mp4)
        for _ in stream:
            return stream.stored_size
    raise ValueError(f"data.root={root}: no readable <name>.mp4 episode (with its <name>.jsonl) in the folder")


def token_grid(size: tuple[int, int], patch: int, max_tokens: int) -> tuple[int, int]:
    """A frame of `size` pixels -> (h, w) tokens of `patch` pixels, scaled down to at most `max_tokens`."""
    h, w = max(1, round(size[0] / patch)), max(1, round(size[1] / patch))
    if h * w > max_tokens:
        scale = math.sqrt(max_tokens / (h * w))
        h, w = max(1, int(h * scale)), max(1, int(w * scale))
    return h, w


def vq_patch(cfg: DictConfig) -> int:
    from mcar.tokenizer.vq_model import downsample

    return downsample(cfg.vq.arch)


def complete_config(cfg: DictConfig) -> None:
    """Fill the `auto` fields of cfg.data from its folder (schema, token ids, grid) and, for the fitted patch VQ,
    cfg.vq.path: where it is cached. A job's config is then whole before the model is built."""
    data = cfg.data
    if not data.get("root"):
        raise ValueError("data.root is required for data=recordings: the folder of <name>.mp4 + <name>.jsonl and "
                         "actions.yaml (docs/own-game.md; mcar record writes one)")
    root = Path(data.root)
    if data.get("record"):  # a Gymnasium game recorded on first use (experiment=pong), like any data build
        from mcar.data.gym_env import record_folder

        rec = dict(data.record)
        record_folder(str(rec.pop("env")), root, **rec)
    if not root.is_dir():
        raise FileNotFoundError(f"data.root={root}: no such folder")
    with open_dict(cfg):
        if data.actions == AUTO:
            data.actions = read_schema(root)
        space = action_space(data.actions)
        data.n_a = space.n_a if data.n_a == AUTO else data.n_a
        if data.action_vocab_size == AUTO:
            data.action_vocab_size = space.vocab_size
        if AUTO in (data.h, data.w):
            h, w = token_grid(first_frame_size(root), vq_patch(cfg), int(data.max_frame_tokens))
            data.h, data.w = (h if data.h == AUTO else data.h), (w if data.w == AUTO else data.w)
        if cfg.vq.name == "patch" and cfg.vq.path is None:
            key = recordings_key(root, {"h": data.h, "w": data.w, "vq": dict(cfg.vq.arch), "fps": data.fps})
            cfg.vq.path = str(Path(data.tokens_root) / key / "vq_patch")
            data.vq_fit = True


class RecordingsDataModule(TokenDataModule):
    complete_config = staticmethod(complete_config)  # mcar.data.common.complete_data_config calls it

    def __init__(self, root: str, tokens_root: str, vq_path: str | None = None, vq_fit: bool = False,
                 vq_arch: dict | None = None, fit: dict | None = None, fps: float | None = None,
                 max_frame_tokens: int = 400, tokenize_batch: int = 16, actions: dict | str = AUTO,
                 record: dict | None = None, **kw):
        """root: the recordings; vq_fit: fit the patch VQ at vq_path on first use (`fit`: its frames, codes'
        k-means iterations and seed); fps: the rate to train at (null: the recordings' own); record: what
        complete_config recorded into root (its env, episodes, ...), kept in the config."""
        if actions == AUTO or AUTO in (kw.get("h"), kw.get("w"), kw.get("n_a")):
            raise ValueError("data=recordings: the config was not completed from data.root (a job calls "
                             "mcar.data.recordings.complete_config first)")
        if not root:  # a checkpoint never says where data is read: its user does
            raise ValueError("data.root is required for data=recordings: the folder of the recordings (sampling a "
                             "checkpoint trained on them: data.root=<that folder>, or held_out=<a token folder>)")
        super().__init__(actions=None, **kw)
        self.schema = action_space(actions).schema  # plain dicts and lists
        self.root, self.tokens_root, self.vq_path, self.vq_fit = Path(root), Path(tokens_root), vq_path, vq_fit
        self.vq_arch = dict(vq_arch or {"patch": 16})
        self.fit = {"frames": 2000, "iters": 15, "seed": 0, **(fit or {})}
        self.fps, self.tokenize_batch = fps, tokenize_batch
        if fps is not None and not (isinstance(fps, (int, float)) and fps > 0):
            raise ValueError(f"data.fps={fps!r}: a rate > 0 in frames per second, or null (the recordings' own)")

    @property
    def tokens_dir(self) -> Path:
        from mcar.tokenizer.vq_model import vq_id

        key = recordings_key(self.root, {"h": self.layout.h, "w": self.layout.w, "fps": self.fps,
                                         "schema": self.schema})
        return self.tokens_root / key / f"tokens_{vq_id(self.vq_path).replace('@', '_')}"

    def frame_every(self) -> int:
        """Keep every k-th recorded frame: the recordings' rate (the schema's fps) over data.fps."""
        if self.fps is None:
            return 1
        recorded = self.schema.get("fps")
        if not recorded:
            raise ValueError(f"data.fps={self.fps}: {self.root}/actions.yaml gives no fps (the recordings' rate) "
                             f"to resample from")
        return max(1, round(float(recorded) / float(self.fps)))

    def prepare_data(self) -> None:
        from mcar.data.tokenize import tokenize_dir
        from mcar.tokenizer.vq_model import frame_size, load_vq, vq_id

        if self.vq_fit and not (Path(self.vq_path) / "config.json").exists():
            self.fit_vq()
        vq = load_vq(self.vq_path)
        tokenize_dir(self.root, self.tokens_dir, "recordings", vq, vq_id(self.vq_path), self.tokenize_batch,
                     self.clip_frames, size=frame_size(vq, self.layout.h, self.layout.w), space=self.schema,
                     every=self.frame_every())

    def fit_vq(self) -> None:
        """A patch VQ fitted on the training episodes' frames (k-means: a minute on a CPU), written whole or not at
        all (a folder renamed into place)."""
        import os
        import shutil

        import numpy as np
        import torch

        from mcar.tokenizer.patch_vq import fit_patch_vq
        from mcar.tokenizer.video import read_mp4

        patch, codes = self.vq_geometry()
        files = episode_files(self.root)
        train = files[:-self.val_episodes] if len(files) > self.val_episodes else files
        each = max(1, int(self.fit["frames"]) // max(1, len(train)))
        frames = []
        for mp4 in train:
            got, _ = read_mp4(mp4, (self.layout.h * patch, self.layout.w * patch))
            if len(got):
                frames.append(got[np.linspace(0, len(got) - 1, min(each, len(got))).astype(int)])
        if not frames:
            raise ValueError(f"data.root={self.root}: no readable frames to fit the patch VQ on")
        print(f"fitting a patch VQ ({codes} codes of {patch}x{patch} px) on {sum(map(len, frames))} frames of "
              f"{len(train)} episodes -> {self.vq_path}")
        vq, stats = fit_patch_vq(torch.from_numpy(np.concatenate(frames)), patch, codes, int(self.fit["iters"]),
                                 int(self.fit["seed"]))
        out = Path(self.vq_path)
        staging = out.with_name(out.name + ".part")
        shutil.rmtree(staging, ignore_errors=True)
        vq.save_pretrained(staging)
        (staging / "metrics.json").write_text(json.dumps(stats))  # inside the staging folder: renamed whole below
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, out)

    def vq_geometry(self) -> tuple[int, int]:
        """(patch pixels, codes) of the patch VQ to fit: the codebook is data.codebook_size."""
        from mcar.tokenizer.vq_model import downsample

        return downsample(self.vq_arch), self.codebook_size

    def resolved_vq_path(self) -> str | None:
        """The VQ that made the tokens (the IDM's code vectors)."""
        return self.vq_path
