"""The tokeniser over several ranks reads no shard back. Each rank describes the shards it wrote
(from memory) in its part of the index; rank 0 merges the parts into the index one rank writes, reading no shard;
a killed rank's shards are picked up by the next run; the ranks' skipped episodes count as skipped."""
import json

import pytest

import mcar.data.shards as shards
import mcar.data.tokenize as tok
from mcar.data.index import merged_index, stale_index
from mcar.data.tokenize import tokenize_dir
from tests.test_data_vpt import SIZE, good_records, tiny_vq, write_vpt

LENGTHS = {"e0": 6, "e1": 12, "e2": 4, "e3": 9, "e4": 7, "short": 1}  # short: 1 usable frame, skipped


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eps")
    for name, n in LENGTHS.items():
        write_vpt(folder, name, good_records(n))
    return folder


@pytest.fixture(scope="module")
def one_rank(episodes, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "tok"
    tokenize_dir(episodes, out, "vpt", tiny_vq(), "tiny", batch=8, min_frames=2, size=SIZE)
    return out


def read(path):
    return json.loads(path.read_text())


def tokenize_rank(episodes, out, rank, vq):
    return tokenize_dir(episodes, out, "vpt", vq, "tiny", batch=8, min_frames=2, rank=rank, world=2, size=SIZE)


def no_shard_read(monkeypatch):
    def refuse(folder, name):
        raise AssertionError(f"{folder}/{name}: a shard read in full")

    monkeypatch.setattr(shards, "shard_stats", refuse)


def test_two_ranks_and_the_merge_write_the_one_rank_index_reading_no_shard(episodes, one_rank, tmp_path,
                                                                            monkeypatch):
    out, vq = tmp_path / "tok", tiny_vq()
    no_shard_read(monkeypatch)  # neither a rank (its own shards: from memory) nor the merge reads one back
    parts = [tokenize_rank(episodes, out, rank, vq) for rank in (0, 1)]
    assert not (out / "index.json").exists()  # only rank 0's merge writes it
    assert sorted(e["name"] for p in parts for e in p["episodes"]) == ["e0", "e1", "e2", "e3", "e4"]
    assert {p.name for p in out.glob("*.rank*.json")} == {"index.rank0.json", "index.rank1.json",
                                                          "skipped.rank0.json", "skipped.rank1.json"}
    index = merged_index(out, parts[0]["meta"], episodes)
    assert read(out / "index.json") == index == read(one_rank / "index.json")
    assert not list(out.glob("*.rank*.json"))  # the parts are merged away
    assert read(out / "skipped.json") == read(one_rank / "skipped.json") and "short" in read(out / "skipped.json")
    assert stale_index(out, list(LENGTHS)) is None  # the skipped episode counts as skipped


def test_skipped_episodes_of_unmerged_ranks_count_as_skipped(tmp_path):
    """An index with the ranks' skipped parts beside it (the merge not run yet): their episodes are not missing."""
    out = tmp_path / "tok"
    out.mkdir()
    (out / "index.json").write_text(json.dumps({"meta": {}, "episodes": []}))
    (out / "skipped.rank1.json").write_text(json.dumps({"bad": "unreadable mp4"}))
    assert stale_index(out, ["bad"]) is None
    assert stale_index(out, ["bad", "other"]) == "episodes neither tokenised nor skipped: ['other']"


def test_a_killed_rank_is_finished_by_the_next_run(episodes, one_rank, tmp_path, monkeypatch):
    """Rank 1 is killed after its first episode (shards written, no part); rank 0 finishes. The next run encodes
    only what is missing, rank 1 describes the shard its killed run left, and the merge reads nothing."""
    out, vq = tmp_path / "tok", tiny_vq()
    real, encoded = tok.tokenize_episode, []

    def killed_after_one(mp4, *a, **kw):
        if encoded:
            raise KeyboardInterrupt  # not an Exception: nothing catches it, as a kill
        encoded.append(mp4.stem)
        return real(mp4, *a, **kw)

    monkeypatch.setattr(tok, "tokenize_episode", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        tokenize_rank(episodes, out, 1, vq)
    assert (out / f"{encoded[0]}.frames.npy").exists() and not (out / "index.rank1.json").exists()
    monkeypatch.setattr(tok, "tokenize_episode", real)
    tokenize_rank(episodes, out, 0, vq)
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    done = {name[: -len(".frames.npy")] for name in written if name.endswith(".frames.npy")}
    assert encoded[0] in done and len(done) < 5

    again = []
    monkeypatch.setattr(tok, "tokenize_episode", lambda mp4, *a, **kw: again.append(mp4.stem) or real(mp4, *a, **kw))
    parts = [tokenize_rank(episodes, out, rank, vq) for rank in (0, 1)]
    assert again and not set(again) & done  # only what is missing is encoded, the killed rank's shard not again
    assert all(p.stat().st_mtime_ns == written[p.name] for p in out.glob("*.npy") if p.name in written)
    no_shard_read(monkeypatch)
    assert merged_index(out, parts[0]["meta"], episodes) == read(one_rank / "index.json")
