"""The data side of recall (mcar/crafter/gen.py): the explorer's and the wanderer's recall plans (walks back to
where they were: longer out-and-backs, waits, L-shapes, revisits in varied order) on a fake all-grass world, so no
Crafter world is generated; today's policies when none is asked. And the wanderer's placed obstacles, on one small
real world (Crafter's own place rule decides)."""
import numpy as np
import pytest

from mcar.crafter.gen import (
    ACTIONS,
    MOVE_DELTA,
    PERPENDICULAR,
    PLACING_DEFAULTS,
    RECALL_DEFAULTS,
    ExplorerPolicy,
    RecallPlans,
    WandererPolicy,
    make_env,
    make_policy,
    path_offsets,
    placing_settings,
    recall_settings,
    shape_actions,
)


class FakePlayer:
    def __init__(self):
        self.pos, self.facing = np.array([10, 10]), (0, 1)


class FakeWorld:
    """Grass everywhere but the `walls` tiles (stone)."""

    area = (20, 20)

    def __init__(self, walls=()):
        self.walls = set(walls)

    def __getitem__(self, xy):
        return ("stone" if tuple(int(v) for v in xy) in self.walls else "grass"), None


class FakeEnv:
    def __init__(self, walls=()):
        self._player, self._world = FakePlayer(), FakeWorld(walls)

    def step(self, action: int) -> None:
        """Moves the player when the tile is grass (as Crafter does), facing the move's way either way."""
        if action in MOVE_DELTA:
            dx, dy = MOVE_DELTA[action]
            self._player.facing = (dx, dy)
            nxt = (int(self._player.pos[0]) + dx, int(self._player.pos[1]) + dy)
            if self._world[nxt][0] == "grass":
                self._player.pos = np.array(nxt)


def test_shape_actions_end_where_they_start():
    assert shape_actions("back", 2, 3) == [2, 2, 2, 1, 1, 1]
    assert shape_actions("wait", 2, 1, 2) == [2, 0, 0, 1]
    assert shape_actions("L", 2, 2, 1, b=4) == [2, 2, 4, 3, 1, 1]
    assert path_offsets(shape_actions("L", 2, 2, 1, b=4))[3] == (2, 1)  # the L's corner
    assert shape_actions("revisit", 0, 1, order=[1, 3, 1]) == [1, 2, 3, 4, 1, 2]
    with pytest.raises(ValueError, match="right angles"):
        shape_actions("L", 2, 1, 1, b=1)
    for kind, kw in (("back", {}), ("wait", {"m": 3}), ("L", {"m": 2, "b": 3}), ("revisit", {"order": [1, 4, 4]})):
        assert path_offsets(shape_actions(kind, 2, 2, **kw))[-1] == (0, 0)


@pytest.mark.parametrize("kind", ["back", "long", "wait", "L", "revisit"])
def test_each_recall_plan_comes_back_along_an_open_way(kind):
    s = recall_settings({"mix": {kind: 1}})
    plans = RecallPlans(np.random.default_rng(0), s)
    walls = {(11, 10), (12, 10), (10, 11)}  # right and down are blocked near the player
    for _ in range(20):
        env = FakeEnv(walls)
        got, acts = plans.draw(env)
        assert got == kind
        offs = path_offsets(acts)
        assert offs[-1] == (0, 0) and all((10 + dx, 10 + dy) not in walls for dx, dy in offs)
        for a in acts:  # the env carries it out: back where it started
            env.step(a)
        assert tuple(env._player.pos) == (10, 10)
        moves = [a for a in acts if a in MOVE_DELTA]
        n = len(moves)
        if kind in ("back", "long"):
            assert n // 2 in (s["lengths"] if kind == "back" else s["long_lengths"])
        if kind == "wait":
            assert acts.count(0) in s["waits"] and acts[0] in MOVE_DELTA and acts[-1] in MOVE_DELTA
        if kind == "L":
            assert acts[len(acts) // 2 - 1] in PERPENDICULAR[acts[0]]  # turns at right angles before coming back
        if kind == "revisit":  # legs out-and-backs along two moves, one of them walked again
            legs = [acts[i] for i in range(0, len(acts), n // s["legs"])]
            assert len(legs) == s["legs"] and len(set(legs)) == 2


def test_max_actions_keeps_every_plan_inside_a_clip():
    s = recall_settings({"max_actions": 4, "mix": {"back": 1, "wait": 1, "L": 1, "long": 0}})
    plans = RecallPlans(np.random.default_rng(1), s)
    lens = {len(plans.draw(FakeEnv())[1]) for _ in range(200)}
    assert max(lens) <= 4 and lens >= {2, 3, 4}
    for bad, said in (({"max_actions": 3, "mix": {"L": 1}}, r"no \['L'\] plan is that short"),
                      ({"mix": {"zigzag": 1}}, "recall.mix="), ({"p_loop": 0.2}, r"unknown \['p_loop'\]"),
                      ({"legs": 1}, "legs=1"), ({"waits": [0]}, "waits=")):
        with pytest.raises(ValueError, match=said):
            recall_settings(bad)


def test_policies_walk_recall_plans_only_when_asked():
    rng = np.random.default_rng(0)
    assert recall_settings(None) is None and recall_settings({}) == RECALL_DEFAULTS
    plain = make_policy("explorer", rng, None)
    assert type(plain) is ExplorerPolicy and plain.plans is None  # today's episodes: no plans, no extra draws
    assert make_policy("wanderer", rng, None).plans is None
    s = recall_settings({"p_explorer": 1.0, "mix": {"wait": 1}})
    explorer, env = make_policy("explorer", rng, s), FakeEnv()
    explorer.hits = 6  # nothing to collect: it plans at once
    acts = [explorer(env) for _ in range(3)]
    assert explorer.current == "wait" and path_offsets(acts + explorer.plan)[-1] == (0, 0)
    wanderer = make_policy("wanderer", rng, recall_settings({"p_wanderer": 1.0, "mix": {"L": 1}}))
    assert isinstance(wanderer, WandererPolicy) and wanderer.p_loop == 1.0
    kinds = set()
    for _ in range(40):
        wanderer(env)
        kinds.add(wanderer.current)
    assert "L" in kinds


def test_recall_data_lives_in_its_own_folder_and_default_data_keeps_its_name(tmp_path):
    from mcar.crafter.data import CrafterDataModule

    def dm(**kw):
        return CrafterDataModule(root=str(tmp_path), episodes=3, frames_per_episode=24, policy_mix={"explorer": 1.0},
                                 h=9, w=9, n_a=1, codebook_size=16, action_vocab_size=17, clip_frames=4,
                                 batch_size=2, seed=0, **kw)

    assert dm().set_dir.name == "seed0_24f_explorer100"  # today's name: no recall, no new folder
    assert dm(recall=None).set_dir == dm().set_dir
    mixed = dm(recall={}).set_dir.name
    assert mixed.startswith("seed0_24f_explorer100_recall") and dm(recall=dict(RECALL_DEFAULTS)).set_dir.name == mixed
    assert dm(recall={"max_actions": 7}).set_dir.name != mixed  # other plans, other episodes
    with pytest.raises(ValueError, match="recall: unknown"):
        dm(recall={"p_lop": 0.1})
    placing = dm(placing={}).set_dir.name  # placed obstacles: a folder of their own too
    assert placing.startswith("seed0_24f_explorer100_placing") and placing != mixed
    assert dm(recall={}, placing={}).set_dir.name.startswith(mixed + "_placing")


def test_the_wanderer_places_obstacles_and_walks_into_them_only_when_asked():
    rng = np.random.default_rng(0)
    assert placing_settings(None) is None and placing_settings({}) == PLACING_DEFAULTS
    assert make_policy("wanderer", rng).placing is None  # today's episodes: no placing, no extra draws
    for bad, said in (({"q": 0.1}, r"unknown \['q'\]"), ({"kinds": ["anvil"]}, "placing.kinds="), ({"p": 2}, "p=2")):
        with pytest.raises(ValueError, match=said):
            placing_settings(bad)
    env, _ = make_env(3, (72, 72), (9, 9), 1.0)
    wanderer = make_policy("wanderer", rng, None, placing_settings({"p": 1.0, "kinds": ["furnace"]}))
    placed = bumped = 0
    for _ in range(30):
        player = env._player
        pos, stone = tuple(int(v) for v in player.pos), player.inventory["stone"]
        action = wanderer(env)
        delta = tuple(int(v) for v in player.facing) if action == ACTIONS.index("place_furnace") \
            else MOVE_DELTA.get(action)
        target = None if delta is None else (pos[0] + delta[0], pos[1] + delta[1])
        into_furnace = action in MOVE_DELTA and env._world[target][0] == "furnace"
        env.step(action)
        if action == ACTIONS.index("place_furnace"):
            assert wanderer.current == "place_furnace" and env._world[target][0] == "furnace"
            assert player.inventory["stone"] == stone  # given what it used: the frames show the same inventory
            placed += 1
        elif into_furnace:
            assert tuple(int(v) for v in player.pos) == pos  # Crafter refused the move
            bumped += 1
    assert placed >= 1 and bumped >= 1
