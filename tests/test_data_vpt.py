"""VPT-format fixture (real key names, GUI / null frames, scroll-wheel hotbar, stuck attack) -> exact action
tokens; and every kind of bad input: skipped or trimmed with a warning naming the file, a summary, shards kept."""
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from mcar.data.episodes import read_episode_actions
from mcar.data.index import merged_index
from mcar.data.tokenize import tokenize_dir
from mcar.data.vpt_actions import parse_vpt
from mcar.tokenizer.actions import VPT_OFFSETS
from mcar.tokenizer.video import write_mp4
from mcar.tokenizer.vq_model import build_vq

SIZE = (224, 384)  # the frame size of data=vpt: 14 x 24 tokens, x16
TINY_VQ = dict(block_out_channels=[8, 8, 8, 8, 8], down_block_types=["DownEncoderBlock2D"] * 5,
               up_block_types=["UpDecoderBlock2D"] * 5, layers_per_block=1, latent_channels=4, norm_num_groups=4,
               num_vq_embeddings=16, vq_embed_dim=4)


def tiny_vq():
    torch.manual_seed(0)
    return build_vq(TINY_VQ, l2_codes=False).eval()


def rec(keys=(), buttons=(), new_buttons=(), dx=0, dy=0, gui=False, hotbar=0):
    """A VPT jsonl record with the real field names."""
    return {"mouse": {"x": 640.0, "y": 360.0, "dx": dx, "dy": dy, "scaledX": 0.0, "scaledY": 0.0, "dwheel": 0.0,
                      "buttons": list(buttons), "newButtons": list(new_buttons)},
            "keyboard": {"keys": list(keys), "newKeys": [], "chars": ""},
            "isGuiOpen": gui, "hotbar": hotbar, "yaw": 0.0, "pitch": 0.0, "xpos": 0.0, "ypos": 64.0, "zpos": 0.0,
            "tick": 0, "milli": 0, "inventory": [], "serverTick": 0, "serverTickDurationMs": 0.0, "stats": {}}


K = "key.keyboard."
RECORDS = [
    rec(keys=[K + "w"], buttons=[0], new_buttons=[0]),  # 0 attack stuck from before the recording: removed
    rec(buttons=[0]),  # 1 still stuck -> nothing pressed -> null, dropped
    rec(keys=[K + "w", K + "s"], dx=13, dy=-4),  # 2 both of a pair -> null pair; camera 1.95 deg yaw (float)
    rec(keys=[K + "e"], gui=True, dx=50),  # 3 inventory open: GUI frame, dropped
    rec(hotbar=2),  # 4 scroll wheel 0 -> 2: hotbar.3, not null
    # 5 real attack + sprint; "t" unknown
    rec(keys=[K + "left.control", K + "t"], buttons=[0], new_buttons=[0], hotbar=2),
    rec(hotbar=2),  # 6 null, dropped
    rec(keys=[K + "5", K + "a", K + "d", K + "space", K + "q", K + "left.shift"], buttons=[1], hotbar=4),  # 7
    rec(dy=1200, dx=-3, hotbar=4),  # 8 pitch 180 deg -> clipped to the last bin; yaw -0.45 -> zero bin
]
# expected (kept frame, local ids per slot: bos, pitch, yaw, hotbar, fwd|back, left|right, sprint|sneak,
# use|attack, jump, drop|pickItem, eos)
EXPECTED = [
    (0, [0, 10, 10, 0, 1, 0, 0, 0, 0, 0, 0]),
    (2, [0, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0]),  # dy=-4 -> -0.6 deg -> bin 10; dx=13 -> 1.95 deg -> bin 11
    (4, [0, 10, 10, 3, 0, 0, 0, 0, 0, 0, 0]),
    (5, [0, 10, 10, 0, 0, 0, 1, 2, 0, 0, 0]),
    (7, [0, 10, 10, 5, 0, 0, 2, 1, 1, 1, 0]),
    (8, [0, 20, 10, 0, 0, 0, 0, 0, 0, 0, 0]),
]


def write_vpt(folder: Path, name: str, records, n_frames=None, size=(360, 640), noise=False):
    """<name>.mp4 (640x360 like VPT, frame i a flat colour or noise) + <name>.jsonl (one line per record)."""
    n = len(records) if n_frames is None else n_frames
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (*size, 3), dtype=np.uint8) if noise else
              np.full((*size, 3), (i * 23) % 256, np.uint8) for i in range(n)]
    write_mp4(frames, folder / f"{name}.mp4", fps=20, crf=23, pix_fmt="yuv420p")
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def expected_ids():
    return np.array([[off + v for off, v in zip(VPT_OFFSETS, local)] for _, local in EXPECTED])


def test_parse_vpt_fixture_exact():
    actions, keep, notes = parse_vpt(RECORDS)
    assert [i for i, k in enumerate(keep) if k] == [i for i, _ in EXPECTED]
    assert actions[0]["attack"] == 0 and actions[5]["attack"] == 1  # stuck attack removed until pressed again
    assert actions[2]["camera"] == (-4 * 0.15, 13 * 0.15)  # floats: VPT's int64 array would give (0, 1)
    assert actions[4]["hotbar"] == 3 and actions[7]["hotbar"] == 5
    assert any("key.keyboard.t" in n for n in notes)
    kept_all, keep_all, _ = parse_vpt(RECORDS, drop_null=False, drop_gui=False)
    assert all(keep_all) and kept_all[3]["camera"] == (0.0, 0.0)  # GUI: the mouse moves a cursor, not the camera


def test_vpt_fixture_tokenised_with_mineworld_ids(tmp_path):
    """Data=mineworld: the same records, MineWorld's action ids; its tokens folder says so in its meta."""
    from mcar.tokenizer.actions import VPTActions, action_space

    write_vpt(tmp_path, "fixture", RECORDS)
    ids, keep, _ = read_episode_actions(tmp_path / "fixture.jsonl", "vpt", space="mineworld")
    vpt, mw = VPTActions(), action_space("mineworld")
    np.testing.assert_array_equal(ids[keep], [mw.encode(vpt.decode(row)) for row in expected_ids()])
    with pytest.warns(UserWarning):
        tokenize_dir(tmp_path, tmp_path / "tok", "vpt", tiny_vq(), "tiny", batch=4, min_frames=2, size=SIZE,
                     space="mineworld")
    np.testing.assert_array_equal(np.load(tmp_path / "tok" / "fixture.actions.npy"), ids[keep])
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert meta["actions"] == "mineworld" and meta["action_vocab_size"] == 70
    with pytest.raises(ValueError, match="holds tokens made with"):  # not mixed with our ids in one folder
        tokenize_dir(tmp_path, tmp_path / "tok", "vpt", tiny_vq(), "tiny", batch=4, min_frames=2, size=SIZE)


def test_vpt_fixture_tokenised_exactly(tmp_path):
    write_vpt(tmp_path, "fixture", RECORDS)
    ids, keep, _ = read_episode_actions(tmp_path / "fixture.jsonl", "vpt")
    np.testing.assert_array_equal(ids[keep], expected_ids())
    with pytest.warns(UserWarning, match=r"fixture\.mp4: ignored unknown key names \['key.keyboard.t'\]"):
        index = tokenize_dir(tmp_path, tmp_path / "tok", "vpt", tiny_vq(), "tiny", batch=4, min_frames=2, size=SIZE)
    assert [(e["name"], e["frames"]) for e in index["episodes"]] == [("fixture", len(EXPECTED))]
    frames = np.load(tmp_path / "tok" / "fixture.frames.npy")
    actions = np.load(tmp_path / "tok" / "fixture.actions.npy")
    assert frames.shape == (len(EXPECTED), 14, 24) and frames.dtype == np.uint16 and frames.max() < 16
    np.testing.assert_array_equal(actions, expected_ids())


# ---------------------------------------------------------------------------------------------- bad input
def good_records(n):
    return [rec(keys=[K + "w"], dx=i) for i in range(n)]


def run_tokenize(folder, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        index = tokenize_dir(folder, folder / "tok", "vpt", tiny_vq(), "tiny", batch=8, **kw, size=SIZE)
    return index, [str(w.message) for w in caught]


def test_bad_inputs_skipped_or_trimmed(tmp_path, capsys):
    write_vpt(tmp_path, "a_good", good_records(20))
    (tmp_path / "b_corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    (tmp_path / "b_corrupt.jsonl").write_text("\n".join(json.dumps(r) for r in good_records(20)))
    write_vpt(tmp_path, "c_truncated_mp4", good_records(40), size=(224, 384), noise=True)
    data = (tmp_path / "c_truncated_mp4.mp4").read_bytes()
    (tmp_path / "c_truncated_mp4.mp4").write_bytes(data[: len(data) * 6 // 10])
    recs = good_records(20)
    recs[5] = '{"mouse": {"dx": 1, "dy"'  # malformed line: its frame is dropped, the others stay aligned
    recs[19] = '{"mouse": {"x": 1.0, "y'  # truncated last line
    write_vpt(tmp_path, "d_bad_lines", recs)
    write_vpt(tmp_path, "e_mismatch", good_records(18), n_frames=20)
    write_vpt(tmp_path, "f_short", good_records(5))
    (tmp_path / "g_no_jsonl.mp4").write_bytes((tmp_path / "a_good.mp4").read_bytes())
    write_vpt(tmp_path, "h_unknown_keys", [rec(keys=[K + "w", "key.keyboard.f3"])] * 20)

    index, msgs = run_tokenize(tmp_path, min_frames=16)
    frames = {e["name"]: e["frames"] for e in index["episodes"]}
    assert frames["a_good"] == 20 and frames["d_bad_lines"] == 18 and frames["e_mismatch"] == 18
    assert frames["h_unknown_keys"] == 20
    assert "b_corrupt" not in frames and "f_short" not in frames and "g_no_jsonl" not in frames
    assert 16 <= frames["c_truncated_mp4"] < 40  # decodes up to the cut

    def said(name, text):
        return any(name in m and text in m for m in msgs)

    assert said("b_corrupt.mp4", "unreadable mp4")
    assert said("c_truncated_mp4.mp4", f"{frames['c_truncated_mp4']} frames, 40 records; trimmed")
    assert said("d_bad_lines.mp4", "2 malformed jsonl lines (first: line 6)")
    assert said("e_mismatch.mp4", "frame/record count mismatch: 20 frames, 18 records; trimmed to 18")
    assert said("f_short.mp4", "only 5 usable frames, a clip needs 16")
    assert said("g_no_jsonl.mp4", "missing g_no_jsonl.jsonl")
    assert said("h_unknown_keys.mp4", "key.keyboard.f3")
    skipped = json.loads((tmp_path / "tok" / "skipped.json").read_text())
    assert {"b_corrupt", "f_short", "g_no_jsonl"} <= set(skipped)
    assert "skipped" in capsys.readouterr().out  # the summary line


def test_written_shards_survive_a_later_failure_and_resume(tmp_path, monkeypatch):
    for name in ["e1", "e2", "e3"]:
        write_vpt(tmp_path, name, good_records(16))
    import mcar.data.tokenize as tok

    real = tok.tokenize_episode

    def flaky(mp4, *a, **kw):
        if mp4.stem == "e2":
            raise RuntimeError("disk hiccup")
        return real(mp4, *a, **kw)

    monkeypatch.setattr(tok, "tokenize_episode", flaky)
    index, msgs = run_tokenize(tmp_path, min_frames=2)
    assert [e["name"] for e in index["episodes"]] == ["e1", "e3"]
    assert any("e2.mp4" in m and "disk hiccup" in m for m in msgs)
    first = (tmp_path / "tok" / "e1.frames.npy").stat().st_mtime_ns
    monkeypatch.setattr(tok, "tokenize_episode", real)
    index, _ = run_tokenize(tmp_path, min_frames=2)  # resume: only e2 is done now
    assert [e["name"] for e in index["episodes"]] == ["e1", "e2", "e3"]
    assert (tmp_path / "tok" / "e1.frames.npy").stat().st_mtime_ns == first


def test_nothing_usable_is_a_clear_error(tmp_path):
    write_vpt(tmp_path, "only_gui", [rec(keys=[K + "e"], gui=True)] * 4)
    with pytest.raises(ValueError, match="nothing usable in .*all 1 episodes skipped"):
        run_tokenize(tmp_path, min_frames=2)
    with pytest.raises(ValueError, match="no episodes"):
        tokenize_dir(tmp_path / "tok", tmp_path / "tok2", "vpt", tiny_vq(), "tiny", size=SIZE)


def test_tokens_of_another_vq_are_refused(tmp_path):
    write_vpt(tmp_path, "e1", good_records(4))
    run_tokenize(tmp_path, min_frames=2)
    with pytest.raises(ValueError, match="holds tokens made with"):
        tokenize_dir(tmp_path, tmp_path / "tok", "vpt", tiny_vq(), "another-vq", size=SIZE)


def test_ranks_split_the_episodes(tmp_path):
    for name in ["e1", "e2", "e3"]:
        write_vpt(tmp_path, name, good_records(4))
    vq = tiny_vq()
    tokenize_dir(tmp_path, tmp_path / "tok", "vpt", vq, "tiny", min_frames=2, rank=1, world=2, size=SIZE)
    assert sorted(p.name for p in (tmp_path / "tok").glob("*.frames.npy")) == ["e2.frames.npy"]
    part = tokenize_dir(tmp_path, tmp_path / "tok", "vpt", vq, "tiny", min_frames=2, rank=0, world=2, size=SIZE)
    assert [e["name"] for e in part["episodes"]] == ["e1", "e3"]  # rank 0's part of the index
    index = merged_index(tmp_path / "tok", part["meta"], tmp_path)  # rank 0, once every rank is done
    assert [e["name"] for e in index["episodes"]] == ["e1", "e2", "e3"]  # the index covers every rank's shards


# ---------------------------------------------------------------------------------------------- out-of-range values
def test_out_of_range_hotbar_and_camera_are_dropped_with_their_lines(tmp_path):
    """A hotbar outside VPT's slots 0..8 (a scroll past the end, a negative or huge value, a bool or a string)
    used to become another slot's id (9 -> the forward|back slot) or an id past the vocabulary; an infinite or
    non-numeric mouse delta clipped to +-90 degrees. Now such records are dropped and the notes name their lines."""
    from mcar.tokenizer.actions import VPT_VOCAB

    records = [rec(keys=[K + "w"]), rec(keys=[K + "w"], hotbar=9), rec(keys=[K + "a"], hotbar=-3),
               rec(keys=[K + "a"], hotbar=110), rec(keys=[K + "d"], hotbar=True), rec(keys=[K + "d"], hotbar="3"),
               rec(keys=[K + "w"], dx=float("inf")), rec(keys=[K + "w"], dy="x"), rec(keys=[K + "w"], dx=5)]
    del records[-1]["mouse"]["dy"]
    actions, keep, notes = parse_vpt(records)
    assert keep == [True, False, False, False, False, False, False, False, True]
    assert "5 records with hotbar outside 0..8 dropped (jsonl line: value 2: 9, 3: -3, 4: 110, 5: True, 6: '3')" \
        in notes
    assert "2 records with a non-numeric or infinite mouse dx/dy dropped (jsonl line: (dy, dx) 7: (0, inf), " \
           "8: ('x', 0))" in notes
    assert "1 records without mouse dx/dy read as no camera motion (jsonl lines [9])" in notes
    write_vpt(tmp_path, "bad", records)
    ids, keep2, _ = read_episode_actions(tmp_path / "bad.jsonl", "vpt")
    assert keep2.tolist() == keep and ids.max() < VPT_VOCAB


@pytest.mark.parametrize("space", ["vpt", "mineworld"])
def test_action_encoders_check_their_ranges(space):
    from mcar.tokenizer.actions import action_space

    enc = action_space(space)
    for bad, field in [({"hotbar": 10}, "hotbar=10"), ({"hotbar": -1}, "hotbar=-1"), ({"hotbar": 2.5}, "hotbar=2.5"),
                       ({"camera": (float("inf"), 0.0)}, "camera="), ({"camera": (1.0,)}, "camera="),
                       ({"forward": 2}, "forward=2")]:
        with pytest.raises(ValueError, match=field.replace("(", r"\(")):
            enc.encode(bad)
    assert len(enc.encode({"hotbar": 9, "camera": (90.0, -90.0), "forward": 1})) == 11


def test_a_shard_with_out_of_range_ids_is_named(tmp_path):
    """A shard cached before these checks (or by another tool) with ids past the vocabulary fails at load time,
    naming the file, the id and the config field, not as an IndexError in the embedding at step 0."""
    from mcar.core.layout import Layout
    from mcar.data.token_clips import TokenClips

    lay = Layout(14, 24, 11)
    np.save(tmp_path / "ep.frames.npy", np.zeros((4, 14, 24), np.uint16))
    acts = np.zeros((4, 11), np.uint16)
    acts[2, 3] = 154
    np.save(tmp_path / "ep.actions.npy", acts)
    assert len(TokenClips(tmp_path, ["ep"], lay, 2, 16)) == 3  # without a vocabulary to check actions against
    with pytest.raises(ValueError, match=r"ep\.actions\.npy: action id 154 \(first at frame 2\) is out of range for "
                                         r"data\.action_vocab_size=71"):
        TokenClips(tmp_path, ["ep"], lay, 2, 16, action_vocab_size=71)
    np.save(tmp_path / "ep.frames.npy", np.full((4, 14, 24), 16, np.uint16))
    with pytest.raises(ValueError, match=r"ep\.frames\.npy: image token 16 .* data\.codebook_size=16"):
        TokenClips(tmp_path, ["ep"], lay, 2, 16)


def test_other_resolutions_and_orphan_jsonl_are_reported(tmp_path):
    """A video at another size than VPT's 640x360 is resized with a note, and a jsonl without
    its mp4 is named instead of ignored in silence."""
    write_vpt(tmp_path, "small", good_records(4), size=(180, 320))
    (tmp_path / "lonely.jsonl").write_text(json.dumps(rec(keys=[K + "w"])) + "\n")
    index, warned = run_tokenize(tmp_path, min_frames=2)
    assert [(e["name"], e["frames"]) for e in index["episodes"]] == [("small", 4)]
    assert any("1 jsonl files without an mp4 ignored: ['lonely']" in w for w in warned)
    assert any("video is 320x180, not VPT's 640x360: resized to 384x224" in w for w in warned)


def test_an_mp4_is_written_under_a_temp_name_of_this_host_and_process(tmp_path, monkeypatch):
    """Two machines writing episodes into one shared folder may share a pid: the temp name holds the host too."""
    from mcar import atomic
    from mcar.tokenizer import video

    names = []
    monkeypatch.setattr(video, "_encode", lambda frames, tmp, *a: (names.append(tmp.name), tmp.write_bytes(b"x")))
    monkeypatch.setattr(atomic.socket, "gethostname", lambda: "node7")
    write_mp4(np.zeros((1, 8, 8, 3), np.uint8), tmp_path / "ep.mp4")
    assert names == [f".ep.node7.{os.getpid()}.part.mp4"] and (tmp_path / "ep.mp4").read_bytes() == b"x"
