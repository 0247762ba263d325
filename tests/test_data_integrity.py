"""Data folders and run folders shared by several processes stay whole. Two Crafter
generators on one folder, a cut-off mp4, a stale or empty index, a 0-byte meta.json, a full disk, convert over a
trained run, a refused run's Hydra record, sweep results written in parallel."""
import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mcar.atomic import write_atomic, write_json
from mcar.data.files import FolderLock, read_json
from tests.conftest import REPO, SMALL_DATA, job_overrides, run_script, script_env


def test_two_generators_on_one_folder_leave_whole_episodes(tmp_path):
    """Both finish; every episode's mp4 holds one frame per jsonl record; no temp files left (it used to crash one
    and leave mp4s that decode 0 frames, counted as finished)."""
    from mcar.tokenizer.video import mp4_frame_count

    cmd = [sys.executable, "-m", "mcar.cli", "crafter_gen", f"out={tmp_path / 'eps'}", "episodes=3", "frames=12",
           "size=[32,48]"]
    env = {**script_env(), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    files = sorted(f.name for f in (tmp_path / "eps").iterdir())
    assert [f for f in files if not f.endswith((".mp4", ".jsonl"))] == [], files
    for mp4 in (tmp_path / "eps").glob("*.mp4"):
        records = len(mp4.with_suffix(".jsonl").read_text().splitlines())
        assert records == 12 and mp4_frame_count(mp4) == records


def test_a_cut_off_episode_is_made_again(tmp_path):
    from mcar.crafter.gen import episode_complete, generate

    generate(tmp_path, 1, 8, size=(32, 48))
    mp4 = next(tmp_path.glob("*.mp4"))
    mp4.write_bytes(mp4.read_bytes()[:200])  # a kill mid-write of an older version, or a full disk
    assert not episode_complete(mp4, mp4.with_suffix(".jsonl"))
    generate(tmp_path, 1, 8, size=(32, 48))
    assert episode_complete(mp4, mp4.with_suffix(".jsonl"))


def shards(folder, episodes: dict[str, int], h=3, w=4, n_a=2):
    from mcar.data.index import build_index
    from mcar.data.tokenize import _save_npy

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    meta = {"source": "synthetic", "codebook_size": 32, "n_a": n_a, "action_vocab_size": 8}
    write_json(folder / "meta.json", meta)
    for name, frames in episodes.items():
        _save_npy(folder / f"{name}.actions.npy", rng.integers(0, 8, (frames, n_a)).astype(np.uint16))
        _save_npy(folder / f"{name}.frames.npy", rng.integers(0, 32, (frames, h, w)).astype(np.uint16))
    return build_index(folder, meta)


def test_a_stale_index_is_found_and_rebuilt(tmp_path):
    """A kill between the last shard and the index rebuild left a 4-episode index over 6 shards: trusted, it trained
    every later run on the wrong split."""
    from mcar.data.index import stale_index
    from mcar.data.token_clips import TokenDataModule

    folder = tmp_path / "tokens"
    shards(folder, {f"e{i}": 6 for i in range(4)})
    assert stale_index(folder) is None
    index = read_json(folder / "index.json")
    shards(folder, {f"e{i}": 6 for i in range(6)})
    write_json(folder / "index.json", index)  # the old index over the new shards
    assert "shards not in the index" in stale_index(folder)
    assert stale_index(folder, [*(f"e{i}" for i in range(6)), "e9"]).startswith("shards not in the index")
    (folder / "e0.frames.npy").unlink()
    (folder / "e0.actions.npy").unlink()
    assert stale_index(folder) is not None

    class Folder(TokenDataModule):
        tokens_dir = folder

    dm = Folder(h=3, w=4, n_a=2, codebook_size=32, action_vocab_size=8, clip_frames=3, batch_size=2)
    train, val = dm.make_sources()
    assert stale_index(folder) is None
    assert [e["name"] for e in read_json(folder / "index.json")["episodes"]] == [f"e{i}" for i in range(1, 6)]
    assert len(train.episode_names) + len(val.episode_names) == 5


def test_an_empty_index_is_rebuilt_and_an_empty_meta_is_named(tmp_path):
    from mcar.data.token_clips import TokenDataModule
    from mcar.data.tokenize import check_meta

    folder = tmp_path / "tokens"
    shards(folder, {f"e{i}": 6 for i in range(3)})
    (folder / "index.json").write_text("")  # a full disk used to leave this, and a JSONDecodeError naming nothing

    class Folder(TokenDataModule):
        tokens_dir = folder

    Folder(h=3, w=4, n_a=2, codebook_size=32, action_vocab_size=8, clip_frames=3, batch_size=2).make_sources()
    assert len(read_json(folder / "index.json")["episodes"]) == 3
    (folder / "meta.json").write_text("")
    with pytest.raises(ValueError, match=f"{folder}/meta.json is not valid JSON \\(empty"):
        check_meta(folder, {"source": "synthetic"})


def test_a_full_disk_names_the_path_and_leaves_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "index.json"
    write_json(target, {"old": True})

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=f"no space left on {tmp_path} while writing index.json"):
        write_atomic(target, "{}")
    assert json.loads(target.read_text()) == {"old": True} and sorted(tmp_path.iterdir()) == [target]


def test_a_full_disk_during_a_checkpoint_save_says_so_and_removes_its_temp_file(tmp_path, monkeypatch):
    """Torch.save on a full disk fails with "inline_container.cc ... unexpected pos" naming no path."""
    import shutil

    from mcar.checkpoint.io import AtomicCheckpointIO

    def partial_save(obj, f):
        open(f, "wb").write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", partial_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1024))
    (tmp_path / "step1.ckpt").write_bytes(b"earlier")
    with pytest.raises(OSError, match=f"no space left on {tmp_path} .* while saving last.ckpt; the earlier "
                                      f"checkpoints are intact"):
        AtomicCheckpointIO().save_checkpoint({}, tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1.ckpt"]


def test_convert_refuses_to_overwrite_a_trained_run(tmp_path):
    from mcar.tools.convert import convert_mineworld

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.ckpt").write_bytes(b"a trained run")
    with pytest.raises(FileExistsError, match="already holds checkpoints \\(last.ckpt\\).*overwrite=true"):
        convert_mineworld(tmp_path / "nowhere", tmp_path / "run")
    assert (tmp_path / "run" / "last.ckpt").read_bytes() == b"a trained run"


def test_a_refused_run_writes_nothing_into_the_owners_output_dir(tmp_path):
    """The second of two runs on one output dir is refused; the owner's .hydra/config.yaml stays the owner's."""
    lock = FolderLock(tmp_path / "out", ".mcar-run.lock")
    assert lock.acquire(run_name="owner")
    (tmp_path / "out" / ".hydra").mkdir()
    (tmp_path / "out" / ".hydra" / "config.yaml").write_text("the owner's config\n")
    p = run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path), "logger=none", "trainer.max_steps=1",
                   check=False)
    lock.release()
    assert p.returncode != 0 and "belongs to another run that is still going" in p.stderr
    assert (tmp_path / "out" / ".hydra" / "config.yaml").read_text() == "the owner's config\n"
    assert not (tmp_path / "out" / ".hydra" / "overrides.yaml").exists()


def _add_row(sweep, i, barrier):
    from mcar.eval.reporting import merge_rows

    barrier.wait()  # all at once
    merge_rows(sweep, [{"model": f"m{i}", "sampler": "diagd", "psnr": float(i)}])


def test_parallel_jobs_of_a_sweep_keep_every_row(tmp_path):
    """Gather_sweep's read-modify-write of results.csv used to run unlocked: jobs finishing together lost rows."""
    import multiprocessing

    from mcar.eval.reporting import read_table

    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(6)
    procs = [ctx.Process(target=_add_row, args=(tmp_path, i, barrier)) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert sorted(r["model"] for r in read_table(tmp_path / "results.csv")) == [f"m{i}" for i in range(6)]
