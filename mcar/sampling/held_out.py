"""The held-out clips a sampling job draws from: the ones a checkpoint ships beside it (<run folder>/held_out) or
its data's validation episodes, and which of them to use."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from mcar.core.layout import Layout
from mcar.data.common import build_datamodule


class ShippedHeldOut:
    """The held-out clips a checkpoint ships beside it (<run folder>/held_out: its data's validation episodes as
    token shards, made by `export_held_out`): what a sampling tool needs of the data, with nothing to build.
    val_source: non-overlapping `frames`-frame clips of every episode (as the data's validation set);
    tokens_name: the token folder they were copied from (it names the VQ; the IDM checks it)."""

    def __init__(self, folder: Path, data: DictConfig, frames: int):
        from mcar.data.index import read_index
        from mcar.data.token_clips import TokenClips

        index = read_index(folder)
        self.tokens_dir, self.tokens_name = folder, index["meta"].get("tokens")
        layout = Layout.of(data)
        names = [e["name"] for e in index["episodes"] if e["frames"] >= frames]
        entries = {e["name"]: e for e in index["episodes"]}
        self.val_source = TokenClips(folder, names, layout, frames, data.codebook_size, frames,
                                     data.action_vocab_size, entries)


def held_out_folder(cfg: DictConfig) -> Path | None:
    """cfg.held_out -> the token folder of shipped held-out clips, or None for the data's own validation episodes.
    auto: <checkpoint's folder>/held_out when it exists (the shipped model's), else None; data: None; a path."""
    from mcar.checkpoint.load import resolve_ckpt

    value = OmegaConf.select(cfg, "held_out", default="auto")
    if value in (None, "data"):
        return None
    if value == "auto":
        folder = resolve_ckpt(cfg.ckpt).parent / "held_out"
        return folder if (folder / "index.json").is_file() else None
    folder = Path(value)
    if not (folder / "index.json").is_file():
        raise FileNotFoundError(f"held_out={value}: no index.json there (auto: the checkpoint's held_out/ folder "
                                f"or the data's validation episodes; data: always the data's)")
    return folder


BUILD_LIMIT = 2000  # episodes a sampling tool builds at most to read held-out clips (a checkpoint's data may say more)


def held_out_data(cfg: DictConfig, frames: int):
    """The held-out clips, `frames` frames long, in `.val_source`: the checkpoint's shipped ones (held_out=auto
    finds them; nothing to build), else the configured data's module, built on first use and set up (at most
    BUILD_LIMIT episodes: a checkpoint's data config decides what it trained on, not what a sampling tool builds)."""
    with open_dict(cfg):
        cfg.data.clip_frames = frames
    shipped = held_out_folder(cfg)
    if shipped is not None:
        return ShippedHeldOut(shipped, cfg.data, frames)
    episodes = OmegaConf.select(cfg, "data.episodes", default=None)
    if episodes is not None and int(episodes) > BUILD_LIMIT:
        raise ValueError(f"data.episodes={episodes}: reading held-out clips would build {episodes} episodes first "
                         f"(more than {BUILD_LIMIT}); pass held_out=<a token folder of its validation episodes>")
    dm = build_datamodule(cfg.data)
    dm.prepare_data()
    dm.setup("validate")
    return dm


def export_held_out(dm, out: str | Path) -> Path:
    """Copy a token data module's validation episodes (their shards) into `out`, an index.json beside them: what
    `held_out=auto` reads when `out` is <run folder>/held_out. The data is built first if it is not yet."""
    import shutil

    from mcar.atomic import write_json
    from mcar.data.index import build_index, read_index
    from mcar.data.shards import shard_paths

    dm.prepare_data()
    dm.setup("validate")
    src, out = Path(dm.tokens_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in dm.val_source.episode_names:
        for path in shard_paths(src, name):
            shutil.copyfile(path, out / path.name)
    meta = {**read_index(src)["meta"], "tokens": src.name}
    write_json(out / "meta.json", meta)
    build_index(out, meta)
    return out


def held_out_source(cfg: DictConfig, frames: int):
    """The validation clips (held-out episodes) of the configured data, `frames` frames long."""
    return held_out_data(cfg, frames).val_source


def pick_clips(source, n_clips: int, ids=None) -> list[int]:
    """Explicit `clips` ids, else n_clips evenly spaced over the held-out set (little overlap between clips)."""
    n = len(source)
    if ids:
        bad = [i for i in ids if not 0 <= int(i) < n]
        if bad:
            raise ValueError(f"clips={list(ids)}: ids {bad} out of range; the held-out set has {n} clips (0..{n - 1})")
        return [int(i) for i in ids]
    if n == 0:
        raise ValueError("the held-out set has no clip of that length (lower frames=, or use more val episodes)")
    k = min(n_clips, n)
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})
