"""Clip indexing in O(episodes) memory gives the same clips in the same order as the table of
every (episode, first frame) it replaced, and maps no more shards at once than it may."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcar.core.layout import Layout
from mcar.data.index import build_index
from mcar.data.token_clips import TokenClips

LAYOUT, CODES, ACTIONS = Layout(2, 3, 1), 16, 4


def write_episodes(folder, lengths: list[int]) -> tuple[list[str], dict]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(lengths))
    names = [f"ep{i:03d}" for i in range(len(lengths))]
    for name, T in zip(names, lengths):
        np.save(folder / f"{name}.frames.npy", rng.integers(0, CODES, (T, 2, 3)).astype(np.uint16))
        np.save(folder / f"{name}.actions.npy", rng.integers(0, ACTIONS, (T, 1)).astype(np.uint16))
    index = build_index(folder, {"codebook_size": CODES, "n_a": 1, "action_vocab_size": ACTIONS})
    return names, {e["name"]: e for e in index["episodes"]}


def table_of_starts(folder, names, frames, stride):
    """The old indexing, an oracle sharing no code with TokenClips: every (episode, first frame) in a list."""
    starts = []
    for e, name in enumerate(names):
        T = len(np.load(folder / f"{name}.frames.npy"))
        starts += [(e, t) for t in range(0, T - frames + 1, stride)]
    return starts


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 13), min_size=1, max_size=6), frames=st.integers(1, 5),
       stride=st.integers(1, 4))
def test_the_same_clips_in_the_same_order_as_the_table_of_starts(tmp_path_factory, lengths, frames, stride):
    folder = tmp_path_factory.mktemp("tokens")
    names, entries = write_episodes(folder, lengths)
    clips = TokenClips(folder, names, LAYOUT, frames, CODES, stride, ACTIONS, entries)
    oracle = table_of_starts(folder, names, frames, stride)
    assert len(clips) == len(oracle)
    for i, (e, t) in enumerate(oracle):
        assert clips.locate(i) == (e, t)
        toks = np.load(folder / f"{names[e]}.frames.npy")[t:t + frames]
        acts = np.load(folder / f"{names[e]}.actions.npy")[t:t + frames]
        want = np.concatenate([toks.reshape(frames, -1), acts.astype(np.int64) + CODES], axis=1).reshape(-1)
        assert np.array_equal(clips.clip(i).numpy(), want)
    with pytest.raises(IndexError):
        clips.locate(len(oracle))


def test_memory_is_per_episode_and_a_clip_reads_only_its_frames(tmp_path, monkeypatch):
    import os

    names, entries = write_episodes(tmp_path, [9] * 40)
    clips = TokenClips(tmp_path, names, LAYOUT, 3, CODES, 2, ACTIONS, entries)
    assert len(clips) == 40 * 4 and clips.ends.shape == (40,)  # one number per episode, not one per clip
    asked = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: asked.append(n) or pread(fd, n, offset))
    clips.clip(5)
    assert sorted(asked) == [3 * 1 * 2, 3 * 2 * 3 * 2]  # 3 frames of actions (n_a = 1), of 2x3 uint16 tokens
    (tmp_path / "ep039.frames.npy").write_bytes((tmp_path / "ep039.frames.npy").read_bytes()[:200])
    with pytest.raises(ValueError, match="ep039.frames.npy"):  # cut short after the index was made
        [clips.clip(i) for i in range(len(clips))]


@pytest.mark.parametrize("path", ["local", "stream"])
def test_bench_data_reports_startup_memory_and_step_time_on_vpt_geometry(tmp_path, path):
    """`mcar bench data`: synthetic VPT shards written once (then reused; for the stream path packed once), one JSON
    row with the fields the targets read."""
    from mcar.bench.data_speed import run_data

    from .conftest import compose

    cfg = compose("bench", ["bench.mode=data", "bench.data.frames=3000", "bench.data.episode_frames=500",
                            f"bench.data.dir={tmp_path}", "bench.data.workers=1", "bench.data.batch_size=2",
                            "bench.data.steps=5", "bench.data.warmup_steps=1", f"bench.data.path={path}"])
    row = run_data(cfg)
    assert {"frames", "startup_s", "rss_mb_per_worker", "data_ms_per_step"} <= set(row)
    assert row["frames"] == 3000 and row["path"] == path and row["batch_shape"] == [2, 16 * (14 * 24 + 11)]
    # the last episode is validation; the stream stores clips every clip_frames frames (pack_stream's stride)
    assert row["clips"] == 5 * (500 - 16 + 1) if path == "local" else 5 * (500 // 16)
    assert (row["stream_packed_s"] is None) == (path == "local")
    assert row["startup_s"] > 0 and row["data_ms_per_step"] > 0 and 0 < row["uss_mb_per_worker"] <= \
        row["rss_mb_per_worker"]
    index = tmp_path / "synthetic_vpt_3000f_500" / "index.json"
    made = index.stat().st_mtime_ns
    assert run_data(cfg)["frames"] == 3000 and index.stat().st_mtime_ns == made  # the shards are reused


def test_a_child_that_ended_is_left_out_of_the_workers_memory():
    """A child process of the bench that is not a loader worker may have ended, not yet reaped (seen under pytest
    after the stream tests: ProcessLookupError on /proc/<pid>/smaps_rollup of a zombie)."""
    import subprocess
    import time
    from pathlib import Path

    from mcar.bench.data_speed import worker_pids, workers_memory_mb

    child = subprocess.Popen(["true"])
    try:
        for _ in range(500):  # until it is a zombie: ended, not reaped
            if Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.01)
        assert child.pid in worker_pids()
        assert all(0 <= uss <= rss for rss, uss in workers_memory_mb())
    finally:
        child.wait()


def test_mcar_bench_data_prints_one_json_line_at_the_target_batch(tmp_path):
    """`mcar bench data` as a user runs it: the last line printed is the JSON row, measured at the target
    batch, 8 clips of 16 frames, with no batch given (bench.batch_size, the other modes' default, is 1)."""
    import json

    from .conftest import run_script

    p = run_script("-m mcar.cli bench", "data", "bench.data.frames=800", "bench.data.episode_frames=400",
                   f"bench.data.dir={tmp_path}", "bench.data.workers=0", "bench.data.steps=2",
                   "bench.data.warmup_steps=0", f"hydra.run.dir={tmp_path}")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"frames", "startup_s", "rss_mb_per_worker", "data_ms_per_step"} <= set(row)
    assert row["frames"] == 800 and row["batch_size"] == 8 and row["batch_shape"] == [8, 16 * (14 * 24 + 11)]
    assert json.loads((tmp_path / "bench_data.json").read_text()) == row


def test_bench_tokenizer_measures_cpu_and_predicts_a_gpu():
    """Mcar bench tokenizer: encoder FLOPs per frame (4x the pixels, 4x the FLOPs: convolutions), CPU encode and
    decode frames/s measured, one GPU's frames/s = utilisation x TF32 peak / FLOPs."""
    from mcar.bench.tokenize_speed import encoder_flops_per_frame, run_tokenizer
    from mcar.tokenizer.vq_model import build_vq

    from .conftest import compose

    cfg = compose("bench", ["bench.mode=tokenizer", "vq@bench.tokenizer.vq=small", "bench.tokenizer.size=[64,64]",
                            "bench.tokenizer.batch=2", "bench.tokenizer.steps=1"])
    row = run_tokenizer(cfg)
    assert row["vq"] == "small" and row["cpu_frames_per_s"] > 0 and row["decode_frames_per_s_per_core"] > 0
    vq = build_vq(cfg.bench.tokenizer.vq.arch, l2_codes=False)
    assert row["gpu_frames_per_s_predicted"] == pytest.approx(0.4 * 989e12 / 2 / encoder_flops_per_frame(vq, (64, 64)),
                                                              rel=0.01)
    small, large = encoder_flops_per_frame(vq, (32, 32)), encoder_flops_per_frame(vq, (64, 64))
    assert 3.5 < large / small < 4.5  # the mid-block's attention adds a little more than 4x
