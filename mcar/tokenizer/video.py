"""mp4 in and out (PyAV), the one writer and the one reader of the project. Reading never raises on a damaged
file: it returns what decoded and why it stopped. Writing is atomic: a file is whole or absent."""
from __future__ import annotations

import itertools
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from mcar.atomic import written_atomically


def _even(frame: np.ndarray) -> np.ndarray:
    """Pad H and W to even sizes (H.264 with yuv420p needs them); even frames are returned as they are."""
    H, W = frame.shape[:2]
    return np.pad(frame, ((0, H % 2), (0, W % 2), (0, 0))) if H % 2 or W % 2 else frame


def write_mp4(frames, path: str | Path, fps: float = 4, crf: int | None = None, pix_fmt: str = "yuv420p",
              preset: str | None = None, codec: str = "libx264") -> Path:
    """frames: (T, H, W, 3) uint8 or an iterable of (H, W, 3) -> an H.264 mp4 at `path` (returned).

    Written to a temp name and renamed. Defaults suit videos for people (yuv420p, libx264's own crf and preset;
    odd sizes are padded); episodes pass crf=12, pix_fmt="yuv444p": yuv444p keeps pixel-art colour edges
    (yuv420p halves chroma: ~30 dB against the render, 444 at crf 12: ~39). Lossless: codec="libx264rgb",
    pix_fmt="rgb24", crf=0 reads back bit for bit (pixel art: about 4 kB a frame at 224x384)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {k: str(v) for k, v in (("crf", crf), ("preset", preset)) if v is not None}
    with written_atomically(path, keep_suffix=True) as tmp:
        _encode(frames, tmp, fps, codec, pix_fmt, options)
    return path


def _encode(frames, tmp: Path, fps: float, codec: str, pix_fmt: str, options: dict) -> None:
    # the index first (faststart): a cut file still decodes
    with av.open(str(tmp), mode="w", options={"movflags": "+faststart"}) as out:
        stream = None
        for f in frames:
            f = _even(f)
            if stream is None:
                stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(65535))
                stream.height, stream.width = f.shape[:2]
                stream.pix_fmt = pix_fmt
                stream.options = options
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                out.mux(packet)
        if stream is not None:
            for packet in stream.encode():
                out.mux(packet)


class FrameStream:
    """Iterates an mp4's frames as (H, W, 3) uint8, resized to `size` = (H, W) when given (None: as stored);
    afterwards `.count`, `.error` (None if it ended well) and `.stored_size` (H, W as stored; None: no frame)."""

    def __init__(self, path: str | Path, size: tuple[int, int] | None = None):
        self.path, self.size, self.count, self.error, self.stored_size = Path(path), size, 0, None, None

    def __iter__(self):
        h, w = self.size or (None, None)
        try:
            with av.open(str(self.path)) as container:
                for frame in container.decode(video=0):
                    self.count += 1
                    self.stored_size = self.stored_size or (frame.height, frame.width)
                    yield frame.to_ndarray(format="rgb24", width=w, height=h)
        except Exception as e:  # PyAV raises several error types for damaged files
            self.error = f"{type(e).__name__}: {e}"
        if self.count == 0 and self.error is None:
            self.error = "no video frames"


def mp4_frame_count(path: str | Path) -> int:
    """The video frames an mp4 holds (its packets, read without decoding); 0 when it cannot be opened (a file cut
    off mid-write has no index)."""
    try:
        with av.open(str(path)) as container:
            return sum(1 for packet in container.demux(video=0) if packet.size)
    except Exception:  # PyAV raises several error types for damaged files
        return 0


def read_mp4(path: str | Path, size: tuple[int, int] | None = None, max_frames: int | None = None
             ) -> tuple[np.ndarray, str | None]:
    """-> ((T, H, W, 3) uint8 frames (resized to `size` when given), None or the reason decoding stopped early)."""
    stream = FrameStream(path, size)
    it = iter(stream)
    frames = list(itertools.islice(it, max_frames))
    it.close()
    if stream.count == 0 and stream.error is None:
        stream.error = "no video frames"
    h, w = size or (0, 0)
    return (np.stack(frames) if frames else np.zeros((0, h, w, 3), np.uint8)), stream.error
