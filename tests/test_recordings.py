"""Any game's recordings (data=recordings, mcar.data.recordings) and `mcar record` (mcar.data.gym_env): a folder of
mp4 + jsonl + actions.yaml trains with no other key, bad records are counted and named once, and a Gymnasium game
(ALE's Pong) records into such a folder."""
import json
import warnings

import numpy as np
import pytest
import torch
import yaml

from .conftest import job_overrides, run_in_process

SCHEMA = {"actions": [{"name": "move", "type": "choice", "choices": ["noop", "left", "right"]},
                      {"name": "keys", "type": "keys", "keys": ["fire", "jump"]},
                      {"name": "mouse", "type": "axis", "range": [-5, 5], "bins": 5, "scale": "mu_law"}],
          "fps": 10}
STEP = {"noop": 0, "left": -16, "right": 16}


def write_recordings(folder, episodes: int = 3, frames: int = 10, seed: int = 0):
    """A 48 x 64 game: a white 16 x 16 block that moves by `move` on a coloured field; one record in episode 0 is
    no choice (dropped), one mouse value is out of range (clamped)."""
    from mcar.tokenizer.video import write_mp4

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "actions.yaml").write_text(yaml.safe_dump(SCHEMA))
    rng = np.random.default_rng(seed)
    for e in range(episodes):
        x, shown, records = 16, [], []
        for t in range(frames):
            img = np.zeros((48, 64, 3), np.uint8)
            img[:, :, e % 3] = 60
            img[16:32, x:x + 16] = 255
            shown.append(img)
            move = str(rng.choice(list(STEP)))
            records.append({"move": move, "keys": ["fire"] if t % 3 == 0 else [], "mouse": float(rng.normal())})
            x = int(np.clip(x + STEP[move], 0, 48))
        if e == 0:
            records[4] = {"move": "fly"}
            records[5]["mouse"] = 99.0
        (folder / f"ep{e}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        write_mp4(shown, folder / f"ep{e}.mp4", 10, codec="libx264rgb", pix_fmt="rgb24", crf=0)
    return folder


def test_a_bad_record_is_dropped_counted_and_named_once_and_clamps_counted(tmp_path):
    from mcar.data.episodes import read_episode_actions, read_schema

    folder = write_recordings(tmp_path / "rec", episodes=1)
    ids, keep, notes = read_episode_actions(folder / "ep0.jsonl", "recordings", space=read_schema(folder))
    assert keep.sum() == 9 and not keep[4] and ids.shape == (10, 4)
    assert notes == ["1 records the action schema cannot encode, their frames dropped (first: record 5: "
                     "move='fly' is not a choice; the choices: noop, left, right)",
                     "1 values of mouse outside its range, clamped"]
    assert ids[5, 3] == 3 + 2 + 2 + 4  # the mouse slot's last bin: the range's top


@pytest.mark.parametrize("text, field", [
    (None, "no action schema: write actions.yaml"),
    ("actions: [", "not YAML/JSON"),
    ("actions: [{name: m, type: axis, range: [0]}]", "actions.yaml: actions.m.range"),
])
def test_a_folders_schema_error_is_one_line_naming_file_and_field(tmp_path, text, field):
    from mcar.data.episodes import read_schema

    if text is not None:
        (tmp_path / "actions.yaml").write_text(text)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        read_schema(tmp_path)
    assert field in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def recordings_run(tmp_path_factory):
    """A 2-step train.py run on a fresh recordings folder with no data key but its root -> (tmp, folder, the
    warnings it gave)."""
    from mcar.tools.train import main as train

    tmp_path = tmp_path_factory.mktemp("recordings_run")
    folder = write_recordings(tmp_path / "rec")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_in_process(train, "data=recordings", f"data.root={folder}", f"paths.data_dir={tmp_path}/data",
                       *job_overrides(tmp_path), "logger=none", "trainer.max_steps=2", "val_dashboard.n_clips=0",
                       "data.clip_frames=3", "data.batch_size=2", "data.val_clips=1")
    return tmp_path, folder, [str(w.message) for w in seen]


def test_train_on_a_fresh_recordings_folder_with_no_other_key_then_sample_it(recordings_run):
    """train.py data=recordings data.root=DIR: the grid is read off the frames (48 x 64 px -> 3 x 4 tokens), the
    actions off actions.yaml, a patch VQ is fitted and cached; the checkpoint carries the schema, so the plain
    Python API samples it given only where the recordings are (a checkpoint never says where data is read)."""
    from mcar import WorldModel

    tmp_path, folder, said = recordings_run
    named = [m for m in said if "cannot encode" in m]
    assert len(named) == 1 and "ep0.mp4" in named[0]  # the bad record: once, with its episode
    ckpt = tmp_path / "ckpt" / "train-tiny-recordings-causal" / "last.ckpt"
    hp = torch.load(ckpt, weights_only=False)["hyper_parameters"]
    assert hp["data"]["actions"]["actions"] == SCHEMA["actions"] and (hp["data"]["h"], hp["data"]["w"]) == (3, 4)
    assert hp["data"]["n_a"] == 4 and hp["data"]["action_vocab_size"] == 3 + 2 + 2 + 5
    vq = sorted((tmp_path / "data" / "recordings").glob("*/vq_patch/config.json"))
    assert len(vq) == 1 and json.loads(vq[0].read_text())["_class_name"] == "PatchVQ"

    with pytest.raises(ValueError, match="data.root is required"):
        WorldModel.load(ckpt).held_out_clips(frames=3)
    wm = WorldModel.load(ckpt, **{"data.root": str(folder)})
    assert (wm.layout.h, wm.layout.w, wm.layout.n_a) == (3, 4, 4)
    tokens, _ = wm.generate(wm.held_out_clips(frames=3), wm.sampler(frames=3))
    assert tokens.shape == (1, wm.layout.n_slots(3))
    assert wm.save_gif(tokens[0], tmp_path / "clip.gif").stat().st_size > 0


def test_record_train_then_gametest_each_policy_on_fresh_games(tmp_path):
    """Pong recorded by `mcar record`, one training step on it (data.record: recorded on first use), then mcar
    gametest: every policy named, each row scored with intervals over fresh games, the model's margin over
    copy_last paired game by game; a model of another game's actions is refused; then one post-training step on
    fresh games of Pong (simulator=gym), rewarded against the game's real next frames."""
    pytest.importorskip("ale_py", reason="pip install gymnasium ale-py")
    from mcar.tools.gametest import main as gametest
    from mcar.tools.train import main as train

    folder = tmp_path / "pong"
    run_in_process(train, "data=recordings", f"data.root={folder}", f"paths.data_dir={tmp_path}/data",
                   "data.record={env: ALE/Pong-v5, episodes: 3, frames: 8}", "data.max_frame_tokens=20",
                   *job_overrides(tmp_path), "logger=none", "trainer.max_steps=1", "val_dashboard.n_clips=0",
                   "data.clip_frames=3", "data.batch_size=2", "data.val_clips=1", "data.fit.frames=12")
    ckpt = tmp_path / "ckpt" / "train-tiny-recordings-causal"
    run_in_process(gametest, "env=ALE/Pong-v5", f"ckpt={ckpt}", f"data.root={folder}", "starts=3",
                   "rollout_frames=3", f"hydra.run.dir={tmp_path / 'gt'}")
    res = json.loads((tmp_path / "gt" / "game_tests.json").read_text())
    assert [p["policy"] for p in res["policies"]] == ["sticky", "random"] and res["seed_base"] == 2_000_000
    for p in res["policies"]:
        assert set(p["rows"]) == {"model context=3", "model context=2", "copy_last"}
        assert all(v["mean"]["n"] == 3 for v in p["rows"].values())
        assert {(m["row"], m["baseline"]) for m in p["margins"]} == {("model context=3", "copy_last"),
                                                                    ("model context=2", "copy_last")}
    assert "| sticky | copy_last |" in (tmp_path / "gt" / "game_tests.md").read_text()
    with pytest.raises(ValueError, match="not the one ckpt="):
        run_in_process(gametest, "env=ALE/Breakout-v5", f"ckpt={ckpt}", f"data.root={folder}", "starts=1",
                       f"hydra.run.dir={tmp_path / 'gt2'}")

    from mcar.tools.posttrain import main as posttrain  # GRPO on the game itself: no Crafter code

    run_in_process(posttrain, "simulator=gym", f"init_from={ckpt}/last.ckpt", f"data.root={folder}", "steps=1",
                   "posttrain.group=2", "posttrain.starts=1", "posttrain.rollout_frames=3", "starts.warmup=2",
                   "starts.clips_per_world=1", "logger=none", "posttrain.video_every_n_steps=0",
                   *job_overrides(tmp_path, "post"))
    state = torch.load(tmp_path / "ckpt" / "posttrain-tiny-recordings-diagd" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 1 and state["hyper_parameters"]["data"]["record"]["env"] == "ALE/Pong-v5"


def test_a_game_test_seed_is_never_a_seed_of_the_training_recordings():
    from omegaconf import OmegaConf

    from mcar.eval.game_tests import check_seeds

    trained = {"record": {"env": "ALE/Pong-v5", "episodes": 32, "seed": 100}}
    cfg = lambda base, starts=4: OmegaConf.create({"seed_base": base, "starts": starts, "data": trained})
    assert check_seeds(cfg(132)) == range(132, 132 + 100)  # the first seed past the recordings'
    for base in (1, 50, 131, 100, 120):  # any overlap, however small, is refused naming the seeds
        with pytest.raises(ValueError, match="seeds of the checkpoint's recordings"):
            check_seeds(cfg(base))
    assert len(check_seeds(OmegaConf.create({"seed_base": 0, "starts": 4, "data": {"record": None}}))) == 100


def test_fps_keeps_every_kth_frame_with_its_action(tmp_path):
    from mcar.data.tokenize import tokenize_episode
    from mcar.tokenizer.patch_vq import fit_patch_vq

    folder = write_recordings(tmp_path / "rec", episodes=1)
    vq, _ = fit_patch_vq(torch.zeros(2, 48, 64, 3, dtype=torch.uint8), 16, 4, 2)
    every_frame = tokenize_episode(folder / "ep0.mp4", folder / "ep0.jsonl", "recordings", vq, space=SCHEMA)
    halved = tokenize_episode(folder / "ep0.mp4", folder / "ep0.jsonl", "recordings", vq, space=SCHEMA, every=2)
    assert len(every_frame[1]) == 9 and len(halved[1]) == 4  # frames 0, 2, 6, 8: frame 4's record is bad
    assert np.array_equal(halved[1], every_frame[1][[0, 2, 5, 7]])  # each kept frame with its own action
    assert np.array_equal(halved[0], every_frame[0][[0, 2, 5, 7]])


def test_record_plays_an_atari_game_into_a_recordings_folder_and_resumes(tmp_path):
    pytest.importorskip("ale_py", reason="pip install gymnasium ale-py")
    from mcar import cli
    from mcar.data.episodes import read_episode_actions, read_schema

    out = tmp_path / "pong"
    args = ["record", "env=ALE/Pong-v5", "episodes=2", "frames=6", f"out={out}", "policy=sticky"]
    assert cli.main(args) is None  # the `mcar` script then exits 0
    schema = read_schema(out)
    assert schema["actions"][0]["choices"] == ["NOOP", "FIRE", "RIGHT", "LEFT", "RIGHTFIRE", "LEFTFIRE"]
    assert schema["moves"] == ["LEFT", "RIGHT"] and ["ArrowLeft", "LEFT"] in schema["play_keys"]
    mp4s = sorted(out.glob("*.mp4"))
    assert [p.stem for p in mp4s] == ["ALE_Pong-v5_s00000", "ALE_Pong-v5_s00001"]
    ids, keep, notes = read_episode_actions(mp4s[0].with_suffix(".jsonl"), "recordings", space=schema)
    assert keep.all() and len(ids) == 6 and not notes
    before = mp4s[0].stat().st_mtime_ns
    cli.main(["record", "env=ALE/Pong-v5", "episodes=3", "frames=6", f"out={out}"])
    assert mp4s[0].stat().st_mtime_ns == before and len(list(out.glob("*.mp4"))) == 3  # kept, one more


def test_gymnasium_spaces_become_schemas_whose_records_encode():
    gym = pytest.importorskip("gymnasium")
    from mcar.data.gym_env import action_record, space_parts
    from mcar.tokenizer.action_schema import SchemaActions

    space = gym.spaces.Dict({"move": gym.spaces.Discrete(3), "buttons": gym.spaces.MultiBinary(2),
                             "stick": gym.spaces.Box(-1.0, 1.0, (2,)), "gear": gym.spaces.MultiDiscrete([2, 4])})
    schema = SchemaActions({"actions": space_parts(space, "")})
    space.seed(0)
    for _ in range(20):
        record = action_record(space, space.sample())
        encoded = schema.encode_counted(record)
        assert not encoded.clamped and len(encoded.ids) == schema.n_a == 1 + 2 + 2 + 2
    with pytest.raises(ValueError, match="unbounded Box"):
        space_parts(gym.spaces.Box(-np.inf, np.inf, (1,)), "")


def test_gym_starts_give_a_games_true_clips_for_post_training(tmp_path):
    """Post-training's source for a Gymnasium game: the same seed gives the same clips, each in the data layout
    with the frame's real tokens and the action ids taken; zero positions."""
    pytest.importorskip("ale_py", reason="pip install gymnasium ale-py")
    from mcar.core.layout import Layout
    from mcar.data.gym_env import GymStarts
    from mcar.tokenizer.patch_vq import fit_patch_vq

    vq, _ = fit_patch_vq(torch.randint(0, 255, (2, 208, 160, 3), dtype=torch.uint8), 16, 8, 2)
    vq.save_pretrained(tmp_path / "vq")
    layout = Layout(13, 10, 1)
    starts = GymStarts("ALE/Pong-v5", layout, 8, frames=3, vq_path=str(tmp_path / "vq"), warmup=4,
                       clips_per_world=2)
    clips = starts(7)
    assert len(clips) == 2 and all(c.shape == (layout.n_slots(3),) and p.shape == (3, 2) for c, p in clips)
    again = starts(7)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(clips, again))
    actions = clips[0][0].view(3, layout.frame_len)[:, -1] - 8  # the action slot after the image codes
    assert ((actions >= 0) & (actions < 6)).all() and (clips[0][0].view(3, -1)[:, :-1] < 8).all()


def test_a_finetune_of_the_same_data_option_keeps_its_own_root_never_the_checkpoints(tmp_path):
    """Adopting a recordings checkpoint's data: where data is read is this run's own (an experiment's data.root
    when it names the same data option), never the checkpoint's; with another option composed, the install's."""
    from omegaconf import OmegaConf

    from mcar.checkpoint.config import adopt_checkpoint_config

    from .conftest import compose

    packaged = OmegaConf.to_container(compose("train", ["data=recordings"]).data, resolve=False)
    theirs = {k: v for k, v in packaged.items() if not (isinstance(v, str) and "${" in v)} | \
        {"root": "/their/machine", "h": 3, "w": 4}
    mine = compose("finetune", ["data=recordings", f"data.root={tmp_path}"])
    adopt_checkpoint_config(mine, {"data": theirs}, "ckpt", ("data",), overrides=[])
    assert mine.data.root == str(tmp_path)
    other = compose("finetune", [])
    adopt_checkpoint_config(other, {"data": theirs}, "ckpt", ("data",), overrides=[])
    assert other.data.root is None and other.data.name == "recordings"
