"""Crafter episodes (seeded generator, policy mix) -> tokens -> clips in the docs/diagd.md layout, split by episode."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mcar.crafter.data import CrafterDataModule
from mcar.crafter.gen import ACTIONS, generate, play_episode
from mcar.data.common import StepBatches
from mcar.tokenizer.video import read_mp4
from mcar.tokenizer.vq_model import save_vq
from tests.test_data_vpt import tiny_vq


def test_generator_is_seeded_and_cached(tmp_path):
    names = generate(tmp_path / "a", episodes=2, frames=12, seed=3, workers=1, size=(224, 384))
    assert names == ["crafter_s3_e00000", "crafter_s3_e00001"]
    mp4, jsonl = tmp_path / "a" / f"{names[0]}.mp4", tmp_path / "a" / f"{names[0]}.jsonl"
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    frames, err = read_mp4(mp4)
    assert err is None and frames.shape == (len(records), 224, 384, 3)
    assert [r["frame"] for r in records] == list(range(len(records)))
    assert all(ACTIONS[r["action_id"]] == r["action"] for r in records)
    stamp = mp4.stat().st_mtime_ns
    generate(tmp_path / "a", episodes=2, frames=12, seed=3, workers=1, size=(224, 384))  # cached: not rewritten
    assert mp4.stat().st_mtime_ns == stamp
    raw1, rec1 = play_episode(3, 0, 12, {"random": 0.25, "explorer": 0.75}, (224, 384))
    raw2, rec2 = play_episode(3, 0, 12, {"random": 0.25, "explorer": 0.75}, (224, 384))
    assert rec1 == rec2 == records and np.array_equal(raw1, raw2)
    assert np.abs(frames.astype(int) - raw1.astype(int)).mean() < 3  # near-lossless mp4


def test_explorer_holds_directions_and_acts():
    _, records = play_episode(0, 1, 120, {"explorer": 1.0}, (224, 384))
    acts = [r["action"] for r in records]
    assert records[0]["policy"] == "explorer"
    runs = [len(list(g)) for k, g in __import__("itertools").groupby(acts) if k.startswith("move")]
    assert max(runs) >= 3  # holds a direction for several steps
    assert "do" in acts and len(set(acts)) >= 5


def test_wanderer_walks_into_obstacles_and_back():
    """The collisions and loops data=crafter_tiles_world trains on: refused moves (the player stays) and out-and-back
    walks that return to a tile left a few steps before."""
    _, records = play_episode(0, 1, 96, {"wanderer": 1.0}, (144, 144), view=(9, 9), daylight=1.0)
    assert records[0]["policy"] == "wanderer"
    assert {r["action"] for r in records} <= {"noop", "move_left", "move_right", "move_up", "move_down"}
    before = [records[0]["pos"]] + [r["pos"] for r in records[:-1]]  # where each action started (pos is after it)
    moves = [(b, r["pos"]) for b, r in zip(before[1:], records[1:]) if r["action"] != "noop"]
    refused = sum(b == a for b, a in moves)
    assert 0.05 < refused / len(moves) < 0.5
    path = [tuple(r["pos"]) for r in records]
    returns = sum(path[t + k] == path[t] != path[t + 1] for t in range(len(path)) for k in (2, 4, 6)
                  if t + k < len(path))
    assert returns >= 5


@pytest.fixture(scope="module")
def crafter_dm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crafter")
    save_vq(tiny_vq(), tmp / "vq")
    dm = CrafterDataModule(root=str(tmp / "data"), episodes=3, frames_per_episode=24, gen_seed=0, workers=1,
                           policy_mix={"explorer": 1.0}, vq_path=str(tmp / "vq"), h=14, w=24, n_a=1,
                           codebook_size=16, action_vocab_size=17, clip_frames=4, batch_size=2, seed=0,
                           val_clips=2, val_episodes=1)
    dm.prepare_data()
    dm.setup()
    return dm


def test_clips_layout_and_split(crafter_dm):
    dm = crafter_dm
    train, val = dm.train_source, dm.val_source
    assert len(train) > 0 and len(val) > 0
    clip = train.clip(0)
    L = 14 * 24 + 1
    assert clip.shape == (4 * L,) and clip.dtype == torch.long
    per_frame = clip.view(4, L)
    assert (per_frame[:, :336] < 16).all() and (per_frame[:, 336:] >= 16).all() and (per_frame[:, 336:] < 33).all()
    # action slots are the jsonl actions of those frames, offset by the codebook size
    index = json.loads((dm.tokens_dir / "index.json").read_text())
    names = [e["name"] for e in index["episodes"]]
    assert len(names) == 3
    records = [json.loads(line) for line in (dm.episodes_dir / f"{names[0]}.jsonl").read_text().splitlines()]
    assert per_frame[:, 336].tolist() == [16 + r["action_id"] for r in records[:4]]
    # split by episode: the last episode is validation, never seen in training
    assert len(train.episode_names) == 2 and len(val.episode_names) == 1
    assert len(val) == index["episodes"][2]["frames"] // 4  # non-overlapping validation clips
    assert len(train) == sum(e["frames"] - 4 + 1 for e in index["episodes"][:2])  # every window (clip_stride 1)


def test_batches_pure_function_of_seed_and_step(crafter_dm):
    a = StepBatches(crafter_dm.train_source, 2, seed=0)
    b = StepBatches(crafter_dm.train_source, 2, seed=0)
    assert torch.equal(a[7]["tokens"], b[7]["tokens"]) and a[7]["tokens"].shape == (2, 4 * 337)
    assert not torch.equal(a[7]["clip_index"], StepBatches(crafter_dm.train_source, 2, seed=1)[7]["clip_index"]) \
        or len(crafter_dm.train_source) < 4


def test_prepare_is_cached(crafter_dm, capsys):
    stamp = (crafter_dm.tokens_dir / "index.json").stat().st_mtime_ns
    crafter_dm.prepare_data()
    out = capsys.readouterr()
    assert "cached" in out.out
    assert "crafter episodes" not in out.err  # no generation progress bar when nothing is generated
    assert (crafter_dm.tokens_dir / "index.json").stat().st_mtime_ns == stamp


def test_mismatched_config_is_a_clear_error(crafter_dm):
    dm = CrafterDataModule(root=str(crafter_dm.root), episodes=3, frames_per_episode=24, workers=1,
                           policy_mix={"explorer": 1.0}, vq_path=crafter_dm.vq_path, h=14, w=24, n_a=1,
                           codebook_size=1024, action_vocab_size=17, clip_frames=4, batch_size=2)
    with pytest.raises(ValueError, match="codebook_size=16 but data.codebook_size=1024"):
        dm.setup()
    dm = CrafterDataModule(root=str(crafter_dm.root), episodes=3, frames_per_episode=24, workers=1,
                           policy_mix={"explorer": 1.0}, vq_path=crafter_dm.vq_path, h=14, w=24, n_a=1,
                           codebook_size=16, action_vocab_size=17, clip_frames=4, batch_size=2, val_episodes=3)
    with pytest.raises(ValueError, match="data.val_episodes=3"):
        dm.setup()


@pytest.mark.parametrize("view", [None, [24, 14]])
def test_crafter_trains_its_own_vq_when_asked(tmp_path, view):
    """Data.vq_train=true: a VQ is trained under root/vq (tiny here), then used to tokenise; with data.view, on
    episodes of that view, under root/view<W>x<H>."""
    tiny = ["generate.episodes=2", "generate.frames=8", "generate.workers=1", "val_episodes=1",
            "val_per_episode=2", "crop=[64,64]", "batch_size=2", "steps=2", "val_every=2", "ckpt_every=2",
            "kmeans_batches=1", "vq.arch.block_out_channels=[8,8,8,8,8]", "vq.arch.norm_num_groups=4",
            "vq.arch.latent_channels=4", "vq.arch.num_vq_embeddings=16", "vq.arch.vq_embed_dim=4"]
    dm = CrafterDataModule(root=str(tmp_path / "crafter"), episodes=2, frames_per_episode=8, workers=1,
                           vq_train=True, vq_train_overrides=tiny, h=14, w=24, n_a=1, codebook_size=16,
                           action_vocab_size=17, clip_frames=4, batch_size=2, val_episodes=1, view=view)
    from mcar.train.vq_training import train_for_data

    dm.vq_trainer = train_for_data  # as a training job (mcar.train.task) lends it
    dm.prepare_data()
    vq_root = tmp_path / "crafter" / ("view24x14" if view else "")
    assert (vq_root / "vq" / "best" / "config.json").exists()
    if view:  # the VQ's own episodes are in the tile view too (vq_train.yaml's generate.seed=1)
        from mcar.crafter.gen import episode_name

        first = read_mp4(vq_root / "vq_episodes" / f"{episode_name(1, 0)}.mp4")[0][0].astype(int)
        mix = {"random": 0.25, "explorer": 0.75}
        tiled, default = (play_episode(1, 0, 1, mix, (224, 384), v)[0][0].astype(int) for v in ((24, 14), None))
        assert np.abs(first - tiled).mean() < 3 < np.abs(first - default).mean()
    dm.setup()
    assert len(dm.train_source) > 0 and dm.tokens_dir.name.startswith("tokens_best_")
    assert dm.vq_ready() and (vq_root / "vq" / "done.json").is_file()  # finished: used from now on


def test_vq_train_outside_a_training_job_trains_nothing(tmp_path):
    """Data.vq_train=true (a checkpoint's data config, say) in a tool that is not a training job: one line saying
    how to train the VQ, and nothing trained or generated."""
    dm = CrafterDataModule(root=str(tmp_path / "crafter"), episodes=2, frames_per_episode=8, workers=1,
                           vq_train=True, h=14, w=24, n_a=1, codebook_size=16, action_vocab_size=17, clip_frames=4,
                           batch_size=2, val_episodes=1)
    with pytest.raises(FileNotFoundError, match="a training job trains it first"):
        dm.prepare_data()
    assert not (tmp_path / "crafter").exists()


def test_fewer_episodes_reuse_the_cache(crafter_dm, capsys):
    dm = CrafterDataModule(root=str(crafter_dm.root), episodes=2, frames_per_episode=24, workers=1,
                           policy_mix={"explorer": 1.0}, vq_path=crafter_dm.vq_path, h=14, w=24, n_a=1,
                           codebook_size=16, action_vocab_size=17, clip_frames=4, batch_size=2, val_episodes=1)
    assert dm.tokens_dir == crafter_dm.tokens_dir and dm.set_dir.name == "seed0_24f_explorer100"
    dm.prepare_data()
    assert "cached" in capsys.readouterr().out
    dm.setup()
    assert len(dm.train_source.episode_names) == 1 and len(dm.val_source.episode_names) == 1  # only the 2 asked for


def _children(pid: int) -> set[int]:
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.add(int(stat.parent.name))
    return kids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the worker processes")
def test_generation_workers_die_with_a_killed_parent(tmp_path):
    """Kill -9 of the generating process used to leave its workers running their queue."""
    import signal
    import subprocess
    import sys
    import time

    code = ("from mcar.crafter.gen import generate; "
            f"generate({str(tmp_path)!r}, episodes=200, frames=400, workers=2, size=(64, 64))")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 60
        while len(workers := _children(parent.pid)) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(workers) >= 2, "the workers did not start"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 15
        while (alive := {w for w in workers if Path(f"/proc/{w}").exists()
                         and Path(f"/proc/{w}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"}) \
                and time.time() < deadline:
            time.sleep(0.2)
        assert not alive, f"workers {alive} outlived their parent"
    finally:
        parent.kill()


@pytest.mark.slow
def test_episodes_are_the_same_in_every_process():
    """Crafter's despawning picked from a set iterated in memory-address order, so episode i of
    seed s differed between processes. Two fresh processes with different heap layouts (junk allocated first)
    must now render identical frames (before the fix episodes 1-3 here differed)."""
    import subprocess
    import sys

    code = ("import sys, hashlib; junk = [bytearray(int(sys.argv[1]) * 37 % 4096 + 1) for _ in "
            "range(int(sys.argv[1]) * 101)]\n"
            "from mcar.crafter.gen import play_episode\n"
            "print([hashlib.md5(play_episode(0, e, 300, {'random': 0.25, 'explorer': 0.75}, (64, 64))[0].tobytes())"
            ".hexdigest() for e in range(4)])")
    runs = {subprocess.run([sys.executable, "-c", code, str(j)], capture_output=True, text=True, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout for j in (0, 13)}
    assert len(runs) == 1, runs


def _tiles_kept_by_moves(view):
    """Over the moves that changed the player's position: the share of 16x16 tiles of the map (not the inventory
    row) that match the tile one step the other way in the frame before (mean difference < 4 of 255: daylight
    shades every pixel a little each step)."""
    frames, records = play_episode(3, 0, 60, {"random": 1.0}, (224, 384), view)
    kept = total = 0
    for t in range(1, len(records) - 1):  # a record's pos is after its action: frame t is at records[t - 1]'s
        (x0, y0), (x1, y1) = records[t - 1]["pos"], records[t]["pos"]
        dx, dy = x1 - x0, y1 - y0
        if (dx, dy) == (0, 0):
            continue
        a, b = frames[t].astype(int), frames[t + 1].astype(int)
        for r in range(1, 12):  # map rows away from the edges (the inventory row is the 14th)
            for c in range(1, 23):
                new = b[16 * r:16 * r + 16, 16 * c:16 * c + 16]
                old = a[16 * (r + dy):16 * (r + dy) + 16, 16 * (c + dx):16 * (c + dx) + 16]
                kept += bool(np.abs(new - old).mean() < 4)
                total += 1
    return kept / max(total, 1), total


def test_tile_view_makes_a_move_a_one_token_shift():
    """Data.view=[24,14] at 384x224: one Crafter tile is one 16x16 token, so a move shifts the map by exactly one
    token (the player's tile, moving creatures and the revealed edge aside); Crafter's default 9x9 view does not."""
    tiles, n = _tiles_kept_by_moves((24, 14))
    assert n > 0 and tiles > 0.9, tiles
    default, _ = _tiles_kept_by_moves(None)
    assert default < 0.5, default


def test_view_gets_its_own_episode_folder_and_vq_folder(tmp_path):
    kw = dict(root=str(tmp_path), episodes=3, frames_per_episode=24, gen_seed=0, workers=1, h=14, w=24, n_a=1,
              codebook_size=16, action_vocab_size=17, clip_frames=4, batch_size=2, seed=0, val_clips=2,
              val_episodes=1)
    default, tiles = CrafterDataModule(**kw), CrafterDataModule(**kw, view=[24, 14], vq_train=True)
    assert default.set_dir.name == "seed0_24f_explorer75_random25"
    # Crafter's own 9x9 view named explicitly is drawn at its own size (data=crafter_tiles_small): its own folder
    assert CrafterDataModule(**kw, view=[9, 9]).set_dir.name == "seed0_24f_explorer75_random25_view9x9"
    assert tiles.set_dir.name == "seed0_24f_explorer75_random25_view24x14"
    assert tiles.resolved_vq_path() == str(tmp_path / "view24x14" / "vq" / "best")
    with pytest.raises(ValueError, match=r"data.view=\[24\]"):
        CrafterDataModule(**kw, view=[24])
    seen = {}
    dm = CrafterDataModule(**kw, view=[24, 14], vq_train=True, vq_train_overrides=["steps=2"])
    dm.vq_trainer = lambda **a: seen.update(a)
    dm.train_vq()
    assert seen == {"root": tmp_path / "view24x14", "overrides": ["generate.view=[24,14]", "steps=2"], "grid": (14, 24)}


def test_a_vq_training_cut_off_is_trained_on_never_used(tmp_path, monkeypatch):
    """A VQ training killed after its first validation leaves best/ without done.json: the data is not "done";
    the next training job goes on from the VQ training's last checkpoint instead of tokenising with it."""
    from mcar.train import vq_training

    dm = CrafterDataModule(root=str(tmp_path / "crafter"), vq_train=True, h=14, w=24, n_a=1, codebook_size=16,
                           action_vocab_size=17, clip_frames=4, batch_size=2)
    vq = dm.vq_root / "vq"
    (vq / "best").mkdir(parents=True)
    (vq / "best" / "config.json").write_text("{}")
    (vq / "lightning").mkdir()
    (vq / "lightning" / "last.ckpt").write_bytes(b"")
    assert not dm.vq_ready()
    seen = []
    monkeypatch.setattr(vq_training, "train", lambda cfg: seen.append(cfg.ckpt_path))
    monkeypatch.setattr(vq_training, "frame_size", lambda *a, **k: (224, 384))
    dm.vq_trainer = vq_training.train_for_data
    dm.train_vq()
    assert seen == ["last"]  # resumed, not started over and not skipped
    (vq / "done.json").write_text('{"steps": 2}')
    assert dm.vq_ready()
