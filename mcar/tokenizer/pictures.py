"""Pictures for people: token clips -> decoded frames, side-by-side videos with the action under each frame (the
one comparison video of generate, evaluate and the training dashboard: `comparison_frames` + `write_video`),
gif / png writers (mp4: mcar.tokenizer.video), and the attention mask of a schedule as an image. Pure functions,
no W&B here."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from mcar.atomic import written_atomically
from mcar.core.layout import Layout
from mcar.tokenizer.clips import split_clip


# ------------------------------------------------------------------------------------------------ tokens -> pixels
def invalid_image_tokens(clips: torch.Tensor, layout: Layout, codebook_size: int) -> tuple[torch.Tensor, int]:
    """The sampler draws from the whole vocabulary: an image slot may get an action id. -> (clips with such ids
    replaced by code 0, how many there were). Counted in the row's notes, never silently."""
    img = layout.is_image(clips.shape[1] // layout.frame_len).to(clips.device)
    bad = (clips >= codebook_size) & img
    return clips.masked_fill(bad, 0), int(bad.sum())


@torch.no_grad()
def decode_frames(vq, ids: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """(B, T, h, w) token ids -> (B, T, 3, H, W) float frames in [0, 1], decoded by the VQ."""
    from mcar.tokenizer.vq_model import decode_tokens

    n_codes = vq.quantize.n_e if hasattr(vq.quantize, "n_e") else vq.config.num_vq_embeddings
    if int(ids.max()) >= n_codes:
        raise ValueError(f"token id {int(ids.max())} is outside the VQ's codebook of {n_codes}: "
                         f"decode with the VQ the data was tokenised with (vq.path)")
    flat = ids.flatten(0, 1).to(vq.device)
    out = torch.cat([decode_tokens(vq, chunk).float().cpu() for chunk in flat.split(batch_size)])
    return out.add(1).div(2).clamp(0, 1).view(*ids.shape[:2], *out.shape[1:])


def to_u8(frames: torch.Tensor) -> np.ndarray:
    """(..., 3, H, W) in [0, 1] -> (..., H, W, 3) uint8."""
    return frames.mul(255).round().clamp(0, 255).to(torch.uint8).movedim(-3, -1).numpy()


# ------------------------------------------------------------------------------------------------ action text
def data_action_space(data) -> str | dict | None:
    """The action space of a data config: a name in mcar.tokenizer.actions.ACTION_SPACES, or the schema mapping
    a recordings folder declares (data=recordings); None for synthetic data: labels show ids."""
    from collections.abc import Mapping

    from mcar.tokenizer.action_schema import plain
    from mcar.tokenizer.actions import ACTION_SPACES

    space = data.get("actions") or data.get("name")
    if isinstance(space, Mapping):
        return plain(space)
    return space if space in ACTION_SPACES else None


def action_labels(actions: torch.Tensor, space: str | dict | None) -> list[str]:
    """(T, n_a) local action ids -> one short label per frame."""
    from mcar.tokenizer.actions import action_space

    labeller = action_space(space) if space else None
    out = []
    for ids in actions.tolist():
        try:
            if labeller is not None:
                out.append(labeller.label(ids))
                continue
        except ValueError:
            pass
        out.append("a=" + ",".join(map(str, ids)))
    return out


# ------------------------------------------------------------------------------------------------ layout
def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def caption(img: np.ndarray, text: str, where: str = "below", height: int | None = None) -> np.ndarray:
    """(H, W, 3) uint8 + a text strip above or below it."""
    H, W, _ = img.shape
    height = height or max(12, min(24, H // 8))
    strip = Image.new("RGB", (W, height), (0, 0, 0))
    ImageDraw.Draw(strip).text((2, 1), text, fill=(255, 255, 255), font=_font(height - 3))
    parts = [np.asarray(strip), img] if where == "above" else [img, np.asarray(strip)]
    return np.concatenate(parts, 0)


def side_by_side(columns: dict[str, np.ndarray], labels: list[str], gap: int = 4, first_frame: int = 0) -> np.ndarray:
    """{title: (T, H, W, 3) uint8} -> (T, H', W', 3) uint8: the columns side by side, each frame captioned with
    its column title and index (from `first_frame`) above and its action label below."""
    T = len(next(iter(columns.values())))
    frames = []
    for t in range(T):
        tiles = [caption(caption(v[t], f"{k}  t={first_frame + t}", "above"), labels[t] if t < len(labels) else "",
                         "below")
                 for k, v in columns.items()]
        sep = np.full((tiles[0].shape[0], gap, 3), 255, np.uint8)
        frames.append(np.concatenate([x for tile in tiles for x in (tile, sep)][:-1], 1))
    return np.stack(frames)


def comparison_frames(clips: dict[str, torch.Tensor], layout: Layout, codebook_size: int, vq,
                      action_space: str | None, first_frame: int = 0) -> np.ndarray:
    """{title: (N,) token clip} -> (T, H', W', 3) uint8: the clips VQ-decoded side by side (image slots holding an
    action id shown as code 0), the first clip's actions under each frame (captioned from `first_frame`). A
    ValueError when the VQ cannot decode them."""
    columns, actions = {}, None
    for title, clip in clips.items():
        clip = invalid_image_tokens(clip[None].cpu(), layout, codebook_size)[0]
        ids, acts = split_clip(clip, layout, codebook_size)
        actions = acts[0] if actions is None else actions
        columns[title] = to_u8(decode_frames(vq, ids)[0])
    return side_by_side(columns, action_labels(actions, action_space), first_frame=first_frame)


def comparison_stream(clips: dict[str, torch.Tensor], layout: Layout, codebook_size: int, vq,
                      action_space: str | None, chunk: int = 16):
    """`comparison_frames` one frame at a time, decoded `chunk` frames at a time: a clip of any length is never
    held decoded in memory (generate frames=2000)."""
    L = layout.frame_len
    frames = len(next(iter(clips.values()))) // L
    for t0 in range(0, frames, chunk):
        part = {title: clip[t0 * L:(t0 + chunk) * L] for title, clip in clips.items()}
        yield from comparison_frames(part, layout, codebook_size, vq, action_space, first_frame=t0)


# ------------------------------------------------------------------------------------------------ writers
GIF_FRAMES = 256  # a gif holds every frame in memory (PIL): longer videos' gifs stop here, their mp4s do not


def write_video(frames, base: str | Path, fps: float = 4) -> tuple[Path, Path]:
    """(T, H, W, 3) uint8, or an iterable of (H, W, 3) frames (streamed: never all in memory) -> <base>.mp4 (for
    files, every frame) and <base>.gif (for W&B and browsers, the first GIF_FRAMES): both paths."""
    from mcar.tokenizer.video import write_mp4  # PyAV: only where a video is written (a GPU machine may lack it)

    base, first = Path(base), []

    def kept(stream):
        for f in stream:
            if len(first) < GIF_FRAMES:
                first.append(f)
            yield f

    mp4 = write_mp4(kept(frames), base.with_name(base.name + ".mp4"), fps)
    return mp4, write_gif(np.stack(first), base.with_name(base.name + ".gif"), fps)


def write_gif(frames: np.ndarray, path: str | Path, fps: float = 4) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    imgs = [Image.fromarray(f) for f in frames]
    with written_atomically(path, keep_suffix=True) as tmp:  # a stop mid-write leaves no half a GIF
        imgs[0].save(tmp, save_all=True, append_images=imgs[1:], duration=int(1000 / fps), loop=0)
    return path


def write_png(img: np.ndarray, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_atomically(path, keep_suffix=True) as tmp:
        Image.fromarray(img).save(tmp)
    return path


# ------------------------------------------------------------------------------------------------ masks
def mask_image(table, max_px: int = 1024) -> np.ndarray:
    """A SlotTable's (S, S) attention mask (query rows, key columns) -> (<= max_px)^2 uint8, white = visible.
    Built a band of rows at a time and average-pooled (grey = partly visible): a 16-frame clip never needs
    the whole S x S mask in memory."""
    S = len(table.pos)
    f, mod, keys = -(-S // max_px), table.mask_mod(), torch.arange(S)
    bands = []
    for r0 in range(0, S, 64 * f):
        q = torch.arange(r0, min(S, r0 + 64 * f))
        band = mod(None, None, q[:, None], keys[None, :]).float()[None, None]  # (1, 1, rows, S)
        bands.append(torch.nn.functional.avg_pool2d(band, f, ceil_mode=True)[0, 0] if f > 1 else band[0, 0])
    return torch.cat(bands).mul(255).round().to(torch.uint8).numpy()


def schedule_table(sampler):
    """The one-pass visibility table of a sampler's schedule (causal for NTP)."""
    return sampler.schedule().table(sampler.full)
