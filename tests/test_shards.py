"""A bad token shard is refused at start, naming the file, the field and (for an id) the frame;
it used to train silently (a negative action id became an image token, a float shard was truncated to zeros) or
fail deep inside torch. A shard is read in full once, when the index is built: a start with a current index reads
none."""
import numpy as np
import pytest

from mcar.atomic import write_json
from mcar.core.layout import Layout
from mcar.data import shards as S
from mcar.data.index import build_index
from mcar.data.token_clips import TokenClips

LAYOUT, CODES, ACTIONS = Layout(3, 4, 2), 32, 8


def write(folder, name, frames=None, actions=None, T=6):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, CODES, (T, 3, 4)).astype(np.uint16) if frames is None else frames
    actions = rng.integers(0, ACTIONS, (T, 2)).astype(np.uint16) if actions is None else actions
    np.save(folder / f"{name}.frames.npy", frames, allow_pickle=True)
    np.save(folder / f"{name}.actions.npy", actions, allow_pickle=True)


def load(folder, name="e"):
    return TokenClips(folder, [name], LAYOUT, 3, CODES, action_vocab_size=ACTIONS)


def good(T=6):
    rng = np.random.default_rng(1)
    return rng.integers(0, CODES, (T, 3, 4)).astype(np.uint16), rng.integers(0, ACTIONS, (T, 2)).astype(np.uint16)


def bad_frames(kind):
    f, a = good()
    if kind == "negative image id":
        f = f.astype(np.int16)
        f[4, 1, 2] = -3
    elif kind == "float":
        f = f.astype(np.float32) / 1024
    elif kind == "nan":
        f = f.astype(np.float32)
        f[2, 0, 0] = np.nan
    elif kind == "object":
        f = np.array([object()] * 6)
    elif kind == "image id out of range":
        f[3, 2, 1] = CODES
    elif kind == "grid":
        f = f[:, :2]
    return f, a


@pytest.mark.parametrize("kind, message", [
    ("negative image id", r"e\.frames\.npy: id -3 at frame 4 is negative"),
    ("float", r"e\.frames\.npy: dtype float32, not integer token ids"),
    ("nan", r"e\.frames\.npy: dtype float32, not integer token ids"),
    ("object", r"e\.frames\.npy: not a readable \.npy array"),
    ("image id out of range", r"e\.frames\.npy: image token 32 \(first at frame 3\) is out of range for "
                              r"data\.codebook_size=32"),
    ("grid", r"tokens \(2, 4\) x 2 actions per frame, but data\.h, data\.w, data\.n_a = 3, 4, 2"),
])
def test_bad_image_shards_are_named(tmp_path, kind, message):
    f, a = bad_frames(kind)
    write(tmp_path, "e", f, a)
    with pytest.raises(S.ShardError, match=message):
        load(tmp_path)


@pytest.mark.parametrize("actions, message", [
    (np.array([[1, 2]] * 3 + [[-1, 2]] * 3, np.int64), r"e\.actions\.npy: id -1 at frame 3 is negative"),
    (np.array([[1, 2]] * 4, np.uint16), r"e\.actions\.npy: 4 frames of actions for 6 frames of image tokens"),
    (np.array([[1, 2]] * 5 + [[1, 8]], np.uint16), r"e\.actions\.npy: action id 8 \(first at frame 5\) is out of "
                                                   r"range for data\.action_vocab_size=8"),
])
def test_bad_action_shards_are_named(tmp_path, actions, message):
    write(tmp_path, "e", good()[0], actions)
    with pytest.raises(S.ShardError, match=message):
        load(tmp_path)


@pytest.mark.parametrize("keep", [0, 140])  # empty; cut off after the header
def test_truncated_or_empty_shards_are_named(tmp_path, keep):
    write(tmp_path, "e")
    (tmp_path / "e.frames.npy").write_bytes((tmp_path / "e.frames.npy").read_bytes()[:keep])
    with pytest.raises(S.ShardError, match=r"e\.frames\.npy: not a readable \.npy array"):
        load(tmp_path)


def test_a_start_with_a_current_index_reads_no_shard(tmp_path, monkeypatch):
    for i in range(3):
        write(tmp_path, f"e{i}")
    index = build_index(tmp_path, {"codebook_size": CODES})
    assert index["episodes"][0] | {"bytes": 0} == {"name": "e0", "frames": 6, "grid": [3, 4], "n_a": 2,
                                                 "image_ids": [0, 31], "action_ids": [0, 7], "bytes": 0}
    monkeypatch.setattr(S, "shard_stats", lambda *a: pytest.fail("a shard was read in full"))
    entries = {e["name"]: e for e in index["episodes"]}
    clips = TokenClips(tmp_path, ["e0", "e1", "e2"], LAYOUT, 3, CODES, action_vocab_size=ACTIONS, entries=entries)
    assert len(clips) == 12


def test_a_shard_changed_after_indexing_is_read_again(tmp_path):
    write(tmp_path, "e")
    entries = {e["name"]: e for e in build_index(tmp_path, {})["episodes"]}
    f, a = bad_frames("image id out of range")
    write(tmp_path, "e", np.concatenate([f, f]), np.concatenate([a, a]))  # other bytes: the entry is not current
    with pytest.raises(S.ShardError, match="out of range"):
        TokenClips(tmp_path, ["e"], LAYOUT, 3, CODES, action_vocab_size=ACTIONS, entries=entries)


def test_verify_shards_reads_every_shard_whatever_the_index_says(tmp_path):
    from mcar.data.token_clips import TokenDataModule

    for i in range(3):
        write(tmp_path, f"e{i}")
    write_json(tmp_path / "meta.json", {})
    build_index(tmp_path, {})
    f, a = bad_frames("image id out of range")
    np.save(tmp_path / "e0.frames.npy", f)  # same size: the index still calls it current

    class Folder(TokenDataModule):
        tokens_dir = tmp_path

    kw = dict(h=3, w=4, n_a=2, codebook_size=CODES, action_vocab_size=ACTIONS, clip_frames=3, batch_size=2)
    Folder(**kw).make_sources()  # trusted: the index was current
    with pytest.raises(S.ShardError, match=r"e0\.frames\.npy: image token 32"):
        Folder(**kw, verify_shards=True).make_sources()


def test_a_same_size_shard_swapped_after_indexing_is_caught_at_the_clip_that_reads_it(tmp_path):
    """The index's id ranges are trusted at start; a clip's own ids are not (ids >= codebook_size
    were action ids, trained on silently)."""
    write(tmp_path, "e")
    entries = {e["name"]: e for e in build_index(tmp_path, {})["episodes"]}
    f, a = bad_frames("image id out of range")  # frame 3
    np.save(tmp_path / "e.frames.npy", f)
    clips = TokenClips(tmp_path, ["e"], LAYOUT, 3, CODES, action_vocab_size=ACTIONS, entries=entries)
    clips.clip(0)  # frames 0-2: fine
    with pytest.raises(S.ShardError, match=r"e\.frames\.npy: id 32 at frame 3 is out of range for "
                                           r"data\.codebook_size=32, though index\.json said otherwise"):
        clips.clip(1)


def test_a_stream_item_with_an_id_out_of_range_is_named_by_the_same_check():
    """StreamClips and TokenClips.clip share mcar.data.shards.ids_out_of_range: the array, field and first frame."""
    from mcar.data.stream import StreamClips

    toks, acts = np.zeros((3, 3, 4), np.int64), np.zeros((3, 2), np.int64)
    assert S.ids_out_of_range(toks, acts, CODES, ACTIONS) is None
    acts[2, 1] = ACTIONS + 1
    assert S.ids_out_of_range(toks, acts, CODES, ACTIONS) == (1, "data.action_vocab_size", ACTIONS, ACTIONS + 1, 2)
    assert S.ids_out_of_range(toks, acts, CODES, None) is None  # no action vocabulary: not checked
    to_clip = StreamClips(3, 4, 2, 3, CODES, "s3://b/val", ACTIONS)
    with pytest.raises(S.ShardError, match=r"s3://b/val: item of episode e holds action id 9 at frame 2 of the clip, "
                                           r"out of range for data\.action_vocab_size=8"):
        to_clip({"frames": toks, "actions": acts, "episode": "e"})


def test_an_entry_lying_about_its_frames_does_not_survive_the_rebuild(tmp_path):
    write(tmp_path, "e")
    index = build_index(tmp_path, {})
    index["episodes"][0]["frames"] = 100  # the shard holds 6
    write_json(tmp_path / "index.json", index)
    assert build_index(tmp_path, {})["episodes"][0]["frames"] == 6


@pytest.mark.parametrize("index, problem", [
    ({"episodes": "e"}, 'no "episodes" list'),
    ({"episodes": [{"name": "e", "frames": "6"}]}, "e: field 'frames' is '6', not int"),
    ({"episodes": [7]}, "an entry is int, not an object"),
    ([], 'no "episodes" list'),
])
def test_a_malformed_index_names_its_file_and_field(tmp_path, index, problem):
    from mcar.data.index import read_index

    write_json(tmp_path / "index.json", index)
    with pytest.raises(S.ShardError, match=f"{tmp_path}/index.json is not an index of token shards \\({problem}\\)"):
        read_index(tmp_path)
