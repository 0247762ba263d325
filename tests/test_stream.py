"""The LitData stream (packed from token shards, split across ranks, resumed mid-epoch and at an
epoch's end exactly, soaked) and the tokeniser over several devices (Lightning Fabric) with its throughput."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.data.index import build_index
from mcar.data.shards import ShardError
from mcar.data.tokenize import balanced_share
from tests.conftest import REPO, run_script

GEOMETRY = dict(h=3, w=4, n_a=2, codebook_size=32, action_vocab_size=8)
LENGTHS = [40, 45, 50, 55, 60, 65]  # frames per episode; the last episode by name is validation


def token_folder(folder: Path, lengths=LENGTHS) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for e, T in enumerate(lengths):
        np.save(folder / f"ep{e:02d}.actions.npy", rng.integers(0, 8, (T, 2), dtype=np.uint16))
        np.save(folder / f"ep{e:02d}.frames.npy", rng.integers(0, 32, (T, 3, 4), dtype=np.uint16))
    meta = {"source": "test", "vq": "none", "codebook_size": 32, "n_a": 2, "action_vocab_size": 8}
    (folder / "meta.json").write_text(json.dumps(meta))
    build_index(folder, meta)
    return folder


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    from mcar.data.stream import pack_stream

    root = tmp_path_factory.mktemp("stream")
    tokens = token_folder(root / "tokens")
    record = pack_stream(tokens, str(root / "stream"), clip_frames=3, stride=2, val_episodes=1, chunk_bytes="8kB",
                         workers=2)
    return tokens, root / "stream", record


def expected_clip(tokens: Path, episode: str, start: int, frames: int = 3) -> torch.Tensor:
    """The docs/diagd.md layout written out by hand: per frame its image ids, then its action ids + codebook."""
    toks = np.load(tokens / f"{episode}.frames.npy")[start:start + frames].reshape(frames, -1).astype(np.int64)
    acts = np.load(tokens / f"{episode}.actions.npy")[start:start + frames].astype(np.int64) + 32
    return torch.from_numpy(np.concatenate([toks, acts], axis=1).reshape(-1))


def datamodule(stream_dir, **kw):
    from mcar.data.stream import StreamDataModule

    dm = StreamDataModule(str(stream_dir), **{"clip_frames": 3, "batch_size": 4, "num_workers": 0, "val_clips": 4,
                                              **GEOMETRY, **kw})
    dm.setup("fit")
    return dm


def test_stream_items_are_the_clips_of_the_token_shards(stream):
    """Every training item is the clip at its (episode, start), starts every `stride` frames of each training
    episode and nothing else; validation clips are the last episode's, not overlapping."""
    from litdata import StreamingDataset

    tokens, stream_dir, record = stream
    items, clips = StreamingDataset(str(stream_dir / "train")), datamodule(stream_dir).train_source
    seen = set()
    for i in range(len(items)):
        episode, start = items[i]["episode"], items[i]["start"]
        seen.add((episode, start))
        assert torch.equal(clips[i], expected_clip(tokens, episode, start))
    want = {(f"ep{e:02d}", t) for e, T in enumerate(LENGTHS[:-1]) for t in range(0, T - 3 + 1, 2)}
    assert seen == want and record["train_clips"] == len(want) and record["train_episodes"] == 5
    val = datamodule(stream_dir).val_source
    assert len(val) == record["val_clips"] == LENGTHS[-1] // 3
    assert torch.equal(val.clip(1), expected_clip(tokens, "ep05", 3))


def lightning_like(loader, steps: int, per_epoch: int, drawn: int = 0) -> list[torch.Tensor]:
    """Batches as Lightning draws them: one iter() per epoch, len(loader) batches each, no extra next(); `drawn`
    batches of the first epoch were drawn before a resume."""
    out = []
    while len(out) < steps:
        it = iter(loader)
        for _ in range(min(per_epoch - drawn, steps - len(out))):
            out.append(next(it)["tokens"])
        drawn = 0
    return out


@pytest.mark.parametrize("stop", [7, 30], ids=["mid_epoch", "epoch_end"])
def test_stream_resumes_exactly(stream, stop):
    """A loader restored from the state after `stop` batches (mid-epoch, or on an epoch's last batch) continues as
    the uninterrupted one does, into the next epoch (LitData 0.2.44 alone fails the mid-epoch case there with an
    IndexError in StreamingDataset._resume: mcar.data.stream_dataset.ClipLoader)."""
    _, stream_dir, _ = stream
    per_epoch = len(datamodule(stream_dir).train_dataloader())
    assert per_epoch == 30  # 121 clips // 4: the epoch_end case stops on its last batch
    reference = lightning_like(datamodule(stream_dir).train_dataloader(), stop + 30, per_epoch)
    killed = datamodule(stream_dir).train_dataloader()
    first = lightning_like(killed, stop, per_epoch)
    resumed_loader = datamodule(stream_dir).train_dataloader()
    resumed_loader.load_state_dict(killed.state_dict())
    resumed = lightning_like(resumed_loader, 30, per_epoch, drawn=stop % per_epoch)
    assert all(torch.equal(a, b) for a, b in zip(first + resumed, reference, strict=True))
    assert not torch.equal(reference[0], reference[per_epoch])  # the next epoch is shuffled anew


def test_stream_ranks_take_disjoint_equal_shares(stream, monkeypatch):
    """LitData splits the clips across ranks (WORLD_SIZE / GLOBAL_RANK, as torch.distributed sets them)."""
    _, stream_dir, record = stream
    shares = []
    for rank in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("GLOBAL_RANK", str(rank))
        dl = datamodule(stream_dir).train_dataloader()
        shares.append({tuple(c.tolist()) for b in dl for c in b["tokens"]})
    assert len(shares[0]) == len(shares[1]) > 0 and not shares[0] & shares[1]
    assert len(shares[0]) + len(shares[1]) >= record["train_clips"] - 2 * 4  # at most a batch dropped per rank


def test_stream_packed_for_other_clips_is_refused(stream):
    _, stream_dir, _ = stream
    with pytest.raises(ValueError, match="clip_frames=3 but data.clip_frames=4"):
        datamodule(stream_dir, clip_frames=4)


def copied_stream(stream, tmp_path) -> Path:
    _, stream_dir, _ = stream
    shutil.copytree(stream_dir, tmp_path / "stream")
    return tmp_path / "stream"


def test_a_stream_declaring_pickled_fields_is_refused_before_any_item_is_read(stream, tmp_path):
    """LitData unpickles a field its index.json calls "pickle": a crafted stream ran its payload."""
    copy = copied_stream(stream, tmp_path)
    index = copy / "train" / "index.json"
    config = json.loads(index.read_text())
    config["config"]["data_format"][2] = "pickle"
    index.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"declares item fields \['numpy', 'numpy', 'pickle', 'int'\].*refused"):
        datamodule(copy)


def test_stream_items_outside_the_vocabularies_are_refused(stream, tmp_path):
    """A stream without pack.json (nothing to hold the config against) still has each item's ids checked."""
    copy = copied_stream(stream, tmp_path)
    (copy / "pack.json").unlink()
    dm = datamodule(copy, codebook_size=8)
    with pytest.raises(ShardError, match=r"holds image id \d+ at frame \d+ of the clip, out of range for "
                                         r"data\.codebook_size=8"):
        next(iter(dm.train_dataloader()))
    dm = datamodule(copy, action_vocab_size=2)
    with pytest.raises(ShardError, match=r"holds action id \d+ at .* data\.action_vocab_size=2"):
        next(iter(dm.train_dataloader()))


class FolderAsBucket:
    """LitData's object-store client, served from a local folder (s3://bucket/x -> root/bucket/x)."""

    def __init__(self, root: Path):
        self.root = root

    def local(self, url: str) -> Path:
        assert url.startswith("s3://"), url
        return self.root / url[len("s3://"):]

    def upload_file(self, local_path: str, remote_path: str) -> None:
        self.local(remote_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(local_path, self.local(remote_path))

    def download_file(self, remote_path: str, local_path: str) -> None:
        shutil.copy(self.local(remote_path), local_path)

    def exists(self, path: str) -> bool:
        return self.local(path).exists()


def test_pack_json_goes_to_and_comes_from_the_object_store_beside_a_url_stream(tmp_path, monkeypatch):
    """A stream at s3://... gets its pack.json there too, and a data module on that URL holds it against its
    config (it used to be skipped: a codebook or action vocabulary mismatch went unnoticed)."""
    from mcar.data import stream as stream_module
    from mcar.data.stream import StreamDataModule, read_pack_record, write_pack_record

    bucket = FolderAsBucket(tmp_path / "store")
    monkeypatch.setattr(stream_module, "object_store", lambda url: bucket)
    record = {"h": 3, "w": 4, "n_a": 2, "clip_frames": 3, "tokens_meta": {"codebook_size": 32, "action_vocab_size": 8}}
    write_pack_record("s3://bucket/vpt_stream/", record)
    assert json.loads((tmp_path / "store" / "bucket" / "vpt_stream" / "pack.json").read_text()) == record
    assert read_pack_record("s3://bucket/vpt_stream") == (record, "s3://bucket/vpt_stream/pack.json")
    assert read_pack_record("s3://bucket/elsewhere")[0] is None
    kw = {"clip_frames": 3, "batch_size": 4, "num_workers": 0, "val_clips": 4, **GEOMETRY}
    StreamDataModule("s3://bucket/vpt_stream", **kw).check_pack()
    with pytest.raises(ValueError, match="s3://bucket/vpt_stream/pack.json: the stream was packed with "
                                         "codebook_size=32 but data.codebook_size=64"):
        StreamDataModule("s3://bucket/vpt_stream", **{**kw, "codebook_size": 64}).check_pack()


def test_a_stale_index_is_rebuilt_before_packing_or_refused(tmp_path):
    """Pack_stream packs what is on disk: shards added since the index was built (a killed tokeniser's) are packed
    too; without a meta.json to rebuild the index with, a stale index is refused, naming the folder."""
    from mcar.data.stream import pack_stream

    tokens = token_folder(tmp_path / "tokens", LENGTHS[:3])
    rng = np.random.default_rng(1)
    np.save(tokens / "ep03.actions.npy", rng.integers(0, 8, (9, 2), dtype=np.uint16))
    np.save(tokens / "ep03.frames.npy", rng.integers(0, 32, (9, 3, 4), dtype=np.uint16))
    record = pack_stream(tokens, str(tmp_path / "stream"), clip_frames=3, val_episodes=1, workers=1)
    assert record["val_episode_names"] == ["ep03"] and record["val_clips"] == 3 and record["train_episodes"] == 3
    assert [e["name"] for e in json.loads((tokens / "index.json").read_text())["episodes"]][-1] == "ep03"
    (tokens / "meta.json").unlink()
    (tokens / "ep00.frames.npy").unlink()
    with pytest.raises(ValueError, match=f"{tokens}/index.json does not describe .*ep00: listed, but its shards"):
        pack_stream(tokens, str(tmp_path / "stream2"), clip_frames=3, val_episodes=1, workers=1)


def test_data_stream_composes_with_the_training_config():
    from tests.conftest import compose

    cfg = compose("train", ["data=stream", "data.stream_dir=s3://bucket/vpt_stream"])
    assert cfg.data._target_ == "mcar.data.stream.StreamDataModule" and cfg.data.clip_frames == 16
    assert cfg.data.vocab_size == cfg.data.codebook_size + 71


@pytest.mark.slow
def test_soak_kills_and_resumes_a_stream_bit_identically(stream, tmp_path):
    """The soak test passes on the stream too (two loader workers; 121 clips of batch 2: the 130 steps
    cross two epoch ends)."""
    _, stream_dir, _ = stream
    geometry = [f"data.{k}={v}" for k, v in GEOMETRY.items()]
    p = run_script("-m mcar.cli soak", f"out={tmp_path}", "kills=3", "every=10", "data=stream",
                   f"data.stream_dir={stream_dir}", *geometry, "data.clip_frames=3", "data.batch_size=2",
                   "data.val_clips=2", "data.num_workers=2", "trainer.max_steps=130", timeout=900)
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["kills"] == 3 and result["steps"] == result["steps_compared"] == 130
    assert result["mismatches"] == 0 and result["final_weights_equal"]


# ------------------------------------------------------------------------------------------- distributed tokenising
@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=40), world=st.integers(1, 6))
def test_balanced_share_partitions_and_balances(tmp_path_factory, sizes, world):
    """Every episode goes to exactly one rank, in name order there; no rank carries more than the least-loaded
    one plus the largest episode (the greedy largest-first bound)."""
    folder = tmp_path_factory.mktemp("sizes")
    found = []
    for i, size in enumerate(sizes):
        (folder / f"e{i:03d}.mp4").write_bytes(b"x" * size)
        found.append((f"e{i:03d}", folder / f"e{i:03d}.mp4", folder / f"e{i:03d}.jsonl"))
    shares = [balanced_share(found, r, world) for r in range(world)]
    names = [e[0] for share in shares for e in share]
    assert sorted(names) == [e[0] for e in found] and len(set(names)) == len(found)
    assert all([e[0] for e in share] == sorted(e[0] for e in share) for share in shares)
    loads = [sum(sizes[int(e[0][1:])] for e in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes)


@pytest.mark.slow
def test_tokenize_over_two_devices_writes_what_one_does_and_a_stream(tmp_path):
    """`mcar tokenize devices=2` (two CPU ranks through Lightning Fabric) writes the shards one rank writes, reports
    frames/s per rank and in all, and packs the stream."""
    from mcar.tokenizer.vq_model import save_vq
    from tests.test_data_vpt import good_records, tiny_vq, write_vpt

    for i, n in enumerate([6, 12, 4, 9, 7]):
        write_vpt(tmp_path / "eps", f"e{i}", good_records(n))
    save_vq(tiny_vq(), tmp_path / "vq")
    common = ["tokenize", f"episodes={tmp_path / 'eps'}", "source=vpt", "size=[224,384]", f"vq.path={tmp_path / 'vq'}",
              "min_frames=2", "accelerator=cpu"]
    one = run_script("-m mcar.cli", *common, f"out={tmp_path / 'one'}")
    two = run_script("-m mcar.cli", *common, f"out={tmp_path / 'two'}", "devices=2", f"stream={tmp_path / 'stream'}",
                     "stream_clip_frames=3", "val_episodes=1")
    assert "tokenised 38 frames on 1 cpu devices" in one.stdout
    assert "rank 0 of 2 on cpu" in two.stdout and "rank 1 of 2 on cpu" in two.stdout
    assert "tokenised 38 frames on 2 cpu devices" in two.stdout and "per device" in two.stdout
    for f in sorted((tmp_path / "one").glob("*.npy")):
        assert np.array_equal(np.load(f), np.load(tmp_path / "two" / f.name)), f.name
    index = json.loads((tmp_path / "two" / "index.json").read_text())
    assert [e["name"] for e in index["episodes"]] == ["e0", "e1", "e2", "e3", "e4"]
    pack = json.loads((tmp_path / "stream" / "pack.json").read_text())
    assert pack["train_episodes"] == 4 and pack["val_episode_names"] == ["e4"] and pack["h"] == 14
    assert (REPO / "conf" / "data" / "stream.yaml").exists()


def test_each_pack_stages_its_chunks_in_its_own_folder_and_removes_it(stream, tmp_path, monkeypatch):
    """LitData empties one machine-wide /tmp/chunks at each optimize's start: two packs at once broke each other.
    Each pack now has its own staging folders, gone afterwards, the caller's settings restored."""
    import litdata

    from mcar.data.stream import pack_stream

    tokens, _, _ = stream
    seen, real = [], litdata.optimize

    def recording(**kw):
        seen.append((os.environ["DATA_OPTIMIZER_CACHE_FOLDER"], os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"]))
        return real(**kw)

    monkeypatch.setattr(litdata, "optimize", recording)
    monkeypatch.setenv("DATA_OPTIMIZER_DATA_CACHE_FOLDER", "/callers/own")
    monkeypatch.delenv("DATA_OPTIMIZER_CACHE_FOLDER", raising=False)
    for out in ("a", "b"):
        pack_stream(tokens, str(tmp_path / out), clip_frames=3, val_episodes=1, chunk_bytes="8kB", workers=1)
    assert len(seen) == 4 and len({chunks for chunks, _ in seen}) == 2  # per pack, shared by its two splits
    for chunks, data in seen:
        assert Path(chunks).parent == Path(data).parent and not Path(chunks).parent.exists()
    assert "DATA_OPTIMIZER_CACHE_FOLDER" not in os.environ
    assert os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] == "/callers/own"


def test_a_pack_cut_off_by_a_full_disk_leaves_the_old_stream_whole(stream, tmp_path, monkeypatch):
    """LitData's traceback, partial chunks in the output: now one line, the old stream as it was."""
    import errno

    import litdata

    from mcar.data.stream import pack_stream

    tokens, _, _ = stream
    copy = copied_stream(stream, tmp_path)
    before = {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()}

    def full_disk(output_dir, **kw):
        Path(output_dir).mkdir(parents=True)
        (Path(output_dir) / "chunk-0-0.bin").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(litdata, "optimize", full_disk)
    with pytest.raises(OSError, match=f"no space left on {tmp_path} while packing stream: the old stream is whole"):
        pack_stream(tokens, str(copy), clip_frames=3, val_episodes=1, workers=1)
    assert {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stream"]  # no partial stream, no lock left


def test_a_pack_that_cannot_fit_its_disk_is_refused_in_one_line_before_litdata_starts(stream, tmp_path,
                                                                                       monkeypatch):
    """A full disk found inside LitData's workers prints their tracebacks: the pack's size is
    checked against the free space first; with room, it packs."""
    import shutil
    from collections import namedtuple

    import litdata

    from mcar.data.stream import pack_stream

    tokens, _, _ = stream
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr(litdata, "optimize", lambda **kw: pytest.fail("LitData started"))
    with pytest.raises(OSError, match=r"no space left on .* for the stream new: it needs ~\d+ MiB, 0 MiB are "
                                      r"free; free some or pack to another disk") as e:
        pack_stream(tokens, str(tmp_path / "deep" / "new"), clip_frames=3, val_episodes=1, workers=1)
    assert "\n" not in str(e.value) and not (tmp_path / "deep").exists()
    monkeypatch.undo()
    assert pack_stream(tokens, str(tmp_path / "new"), clip_frames=3, val_episodes=1, workers=1)["train_clips"] > 0


def test_a_pack_removes_what_a_killed_pack_left_behind(stream, tmp_path):
    """Kill -9 during a pack leaves its staging folder beside the stream and its /tmp/mcar-pack-<pid>-* folder; the
    next pack of that stream removes both (a live pack's cache folder stays)."""
    import subprocess
    import tempfile

    from mcar.data.stream import pack_stream

    tokens, _, _ = stream
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no process has now
    staged = tmp_path / f".out.host.{dead.pid}.packing"
    staged.mkdir()
    (staged / "chunk-0-0.bin").write_bytes(b"partial")
    killed_cache = Path(tempfile.mkdtemp(prefix=f"mcar-pack-{dead.pid}-"))
    live_cache = Path(tempfile.mkdtemp(prefix=f"mcar-pack-{os.getpid()}-"))
    try:
        pack_stream(tokens, str(tmp_path / "out"), clip_frames=3, val_episodes=1, chunk_bytes="8kB", workers=1)
        assert not staged.exists() and not killed_cache.exists() and live_cache.exists()
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["out"]
    finally:
        shutil.rmtree(live_cache, ignore_errors=True)


def test_a_pack_whose_chunks_and_stream_share_one_disk_needs_room_for_both(tmp_path, monkeypatch):
    """LitData writes its chunks in the temp folder and copies them into the staged stream: on one disk the pack
    needs twice its size there (a disk with room for one copy filled up inside LitData's workers, their traceback
    before our line, once hanging)."""
    import shutil
    import tempfile
    from collections import namedtuple

    from mcar.data.stream import PACK_OVERHEAD, check_free_space

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))  # the stream's disk
    usage = namedtuple("usage", "total used free")
    clip_bytes = 2**20
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, int(1.5 * PACK_OVERHEAD * clip_bytes)))
    with pytest.raises(OSError, match=r"no space left on .* for the stream s: it needs ~2 MiB, 2 MiB are free"):
        check_free_space(tmp_path / "s", clip_bytes)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, int(2.1 * PACK_OVERHEAD * clip_bytes)))
    check_free_space(tmp_path / "s", clip_bytes)
