"""The world tests' fresh worlds and players (mcar/crafter/seeds.py, the test players of mcar/crafter/gen.py): a
world test's world can never be a world the checkpoint trained or post-trained in, checked against the seeds the
generator really hands Crafter; each player plays as it says."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.crafter import gen
from mcar.crafter.seeds import check_fresh_worlds, posttrain_worlds, seen_policies, worlds_a_test_plays

from .conftest import REPO


class _Built(Exception):
    """Raised by the stand-in make_env: the world seed is all the test wanted."""


def worlds_played(seed: int, episodes: int, mix: dict, recall=None, placing=None) -> list[int]:
    """The world seed play_episode hands Crafter for each episode (read at make_env; no world is built)."""
    seen = []

    def make_env(world_seed, *args, **kwargs):
        seen.append(world_seed)
        raise _Built

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gen, "make_env", make_env)
        for i in range(episodes):
            with pytest.raises(_Built):
                gen.play_episode(seed, i, 4, mix, (144, 144), (9, 9), 1.0, recall, placing)
    return seen


MIXES = [{"random": 0.25, "explorer": 0.75}, {"wanderer": 0.7, "explorer": 0.2, "random": 0.1},
         {"sweeper": 1.0}, {"hesitant": 0.5, "forager": 0.5}]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), mix=st.sampled_from(MIXES), plans=st.booleans())
def test_every_world_an_episode_is_played_in_is_a_training_world(seed, mix, plans):
    played = worlds_played(seed, 3, mix, {} if plans else None, {} if plans else None)
    assert set(played) <= gen.training_world_seeds(seed, 3)


def test_a_world_test_on_a_training_world_is_refused():
    hp = {"data": {"gen_seed": 7, "episodes": 4, "policy_mix": MIXES[1]}}
    trained = worlds_played(7, 4, MIXES[1], {}, {})
    for world in trained:  # the world itself, and a seed_base whose range ends on it
        for base in (world, world - 20 * 2 - 19):
            with pytest.raises(ValueError, match=rf"seed_base={base}: world {world} is one of the checkpoint's"):
                check_fresh_worlds(base, 2, hp)
    report = check_fresh_worlds(trained[0] + 1, 2, hp) if trained[0] + 1 not in trained else None
    assert report is None or report["training_episodes"] == 4


def test_a_world_test_on_post_training_worlds_is_refused():
    hp = {"max_steps": 10, "data": {}, "posttrain": {"starts": 2, "data": {"seed_base": 5000}}}
    post = posttrain_worlds(hp)
    assert post.start == 5000 and len(post) == 10 * 64 * 4 * 2
    with pytest.raises(ValueError, match="overlap the checkpoint's post-training worlds 5000"):
        check_fresh_worlds(5000 - len(worlds_a_test_plays(0, 3)) + 1, 3, hp)
    assert check_fresh_worlds(5000 - len(worlds_a_test_plays(0, 3)), 3, hp)["posttrain_worlds"] == [5000, post.stop - 1]
    with pytest.raises(ValueError, match="no data.seed_base"):
        posttrain_worlds({"max_steps": 1, "posttrain": {"starts": 1}})


@pytest.mark.skipif(not (REPO / "checkpoints/shipped/crafter_world_recall_grpo/last.ckpt").exists(),
                    reason="the shipped checkpoint is not in this checkout")
def test_the_play_defaults_test_worlds_are_fresh_and_its_players_known():
    from mcar.checkpoint.io import load_checkpoint

    hp = load_checkpoint(REPO / "checkpoints/shipped/crafter_world_recall_grpo/last.ckpt")["hyper_parameters"]
    report = check_fresh_worlds(100000, 96, hp)  # the README's memory command
    assert report["training_episodes"] == 96 and report["posttrain_worlds"][0] == 1000000
    assert seen_policies(hp) == {"explorer", "random", "wanderer"}
    assert not seen_policies(hp) & set(gen.TEST_PLAYERS)


# ------------------------------------------------------------------------------------------------ the test players
@pytest.fixture(scope="module")
def played():
    """Each test player's first 80 actions in a fresh world (the scene the world tests play)."""
    from mcar.crafter.scenes import Recording, Scene

    out = {}
    for name in gen.TEST_PLAYERS:
        scene, rec = Scene(100003, (144, 144), (9, 9), 1.0, policy=name), Recording()
        assert scene.player.name == name
        for _ in range(80):
            scene.step(scene.player(scene.env), rec)
        out[name] = rec
    return out


def runs(actions: list[int]) -> list[tuple[int, int]]:
    """(action, how many times in a row) for each run of one action."""
    out = []
    for a in actions:
        out[-1:] = [(a, out[-1][1] + 1)] if out and out[-1][0] == a else out[-1:] + [(a, 1)]
    return out


def test_the_sweeper_runs_long_straight_lines_and_turns_back(played):
    acts = played["sweeper"].actions
    assert set(acts) <= set(gen.MOVES)  # moves only
    long_runs = [(a, n) for a, n in runs(acts) if n >= 5]
    assert len(long_runs) >= 3  # straight sweeps ...
    assert any(gen.BACK[a] == b for (a, _), (b, _) in zip(long_runs, long_runs[1:]))  # ... back the other way


def test_the_hesitant_player_stands_still_for_several_steps(played):
    acts = played["hesitant"].actions
    assert set(acts) <= {gen.NOOP, *gen.MOVES}
    pauses = [n for a, n in runs(acts) if a == gen.NOOP]
    assert max(pauses) >= 3 and sum(pauses) >= 20  # waits longer than the explorer's single noops


def test_the_forager_goes_for_trees_water_and_cows_and_hits_them(played):
    rec = played["forager"]
    hits = [t for t, a in enumerate(rec.actions) if a == gen.DO]
    assert len(hits) >= 4
    # before a run of hits the player turned toward something foraged (its move refused by it)
    assert any(rec.blocker[t - 1] in gen.FORAGED for t in hits if rec.actions[t - 1] in gen.MOVE_DELTA)
