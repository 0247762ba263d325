"""Every file a job writes is whole or absent (mcar.atomic): a stop signal mid-write leaves the previous file (or
none) and no temp file, for the video writer, the per-frame and curve CSVs and the helper itself."""
import csv
import errno

import numpy as np
import pytest

from mcar.stopping import Stopped


class StopWhenWritten:
    """A table value whose writing is cut short by a stop signal (as SIGTERM mid-write would)."""

    def __str__(self):
        raise Stopped(15)


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_stop_during_a_rollout_video_leaves_no_empty_gif(tmp_path, monkeypatch):
    from PIL import Image

    from mcar.tokenizer.pictures import write_gif

    frames = np.zeros((3, 8, 8, 3), np.uint8)
    gif = write_gif(frames, tmp_path / "rollouts" / "step0000001.gif")
    before = gif.read_bytes()
    real = Image.Image.save

    def save_then_stop(self, fp, *args, **kwargs):
        real(self, fp, *args, **kwargs)
        with open(fp, "r+b") as f:
            f.truncate(0)  # the frames not yet written: a 0-byte file where the GIF goes
        raise Stopped(15)

    monkeypatch.setattr(Image.Image, "save", save_then_stop)
    with pytest.raises(Stopped):
        write_gif(frames + 1, gif)
    with pytest.raises(Stopped):
        write_gif(frames, tmp_path / "rollouts" / "step0000002.gif")
    assert gif.read_bytes() == before and not (tmp_path / "rollouts" / "step0000002.gif").exists()
    assert leftovers(tmp_path / "rollouts") == []


def test_a_stop_while_per_frame_csv_is_written_keeps_the_last_whole_table(tmp_path):
    from mcar.eval.reporting import per_frame_header, write_per_frame

    key = per_frame_header()[2]
    write_per_frame({"diagd": {key: [0.5, 0.25]}}, 1, tmp_path)
    before = (tmp_path / "per_frame.csv").read_text()
    with pytest.raises(Stopped):
        write_per_frame({"diagd": {key: [StopWhenWritten()]}}, 1, tmp_path)
    assert (tmp_path / "per_frame.csv").read_text() == before and leftovers(tmp_path) == []


def test_a_stop_while_the_world_tests_curves_are_written_keeps_the_last_whole_table(tmp_path):
    from mcar.eval.world_tests import write_curves

    path = tmp_path / "rollout_agreement.csv"
    point = dict(mean=0.5, lo=0.4, hi=0.6, tv=0.1, map=0.9, inventory=1.0, invented=0.0)
    columns, _ = write_curves({"free": [point]}, path)
    assert next(csv.reader(path.open())) == columns
    before = path.read_text()
    with pytest.raises(Stopped):
        write_curves({"longer": [point, point, {**point, "mean": StopWhenWritten()}]}, path)
    assert path.read_text() == before and leftovers(tmp_path) == []


def test_the_helper_says_a_full_disk_and_leaves_no_temp_file(tmp_path):
    from mcar.atomic import write_atomic, written_atomically

    write_atomic(tmp_path / "a.json", "{}\n")
    with pytest.raises(OSError, match=r"no space left on .* while writing a.json"):
        with written_atomically(tmp_path / "a.json") as tmp:
            tmp.write_text("{\"half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert (tmp_path / "a.json").read_text() == "{}\n" and leftovers(tmp_path) == []
