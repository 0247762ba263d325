"""mcar worldtest (mcar/eval/world_tests.py): the loop and collision scores on synthetic maps whose answers are
known, and the command once on the shipped tile-exact model at the smallest sizes."""
import json
import re

import pytest
import torch

from mcar.data.crafter_gen import MOVE_DELTA
from mcar.eval.world_tests import MapGrid, loop_recall, rerevealed_mask, shifted, stay_or_move

from .conftest import REPO, run_in_process

GRID = MapGrid(map_h=5, w=8)
UNSEEN = -1  # what a memoryless model draws for a tile it has never seen


def world_and_views(moves: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A random 20x20 world of distinct tokens and the (T, 5, 8) views of a player walking `moves` from its middle
    (the view a crop around the player) -> (views, the view's (dx, dy) offset per frame)."""
    world = torch.randperm(400).view(20, 20)
    pos, offs = [6, 7], [(0, 0)]
    for a in moves:
        pos = [pos[0] + MOVE_DELTA[a][0], pos[1] + MOVE_DELTA[a][1]]
        offs.append((pos[0] - 6, pos[1] - 7))
    views = torch.stack([world[7 + dy:7 + dy + GRID.map_h, 6 + dx:6 + dx + GRID.w] for dx, dy in offs])
    return views, torch.tensor(offs)


def memoryless(views: torch.Tensor, moves: list[int]) -> torch.Tensor:
    """A model that shifts its last frame exactly and draws UNSEEN where the new view shows what it no longer holds."""
    out = [views[0]]
    for a in moves:
        s, known = shifted(out[-1], *MOVE_DELTA[a])
        out.append(s.masked_fill(~known, UNSEEN))
    return torch.stack(out)


@pytest.mark.parametrize("move,back", [(2, 1), (1, 2), (3, 4), (4, 3)])
@pytest.mark.parametrize("n", [1, 3])
def test_loop_recall_is_one_for_the_real_frames_and_zero_without_memory(move, back, n):
    moves = [move] * n + [back] * n
    views, offs = world_and_views(moves)
    assert torch.equal(views[-1], views[0])  # a loop
    far = offs[n][None]
    assert loop_recall(views[-1:], views[:1], GRID, far).item() == 1.0  # the real frames: perfect
    forgot = memoryless(views, moves)
    assert loop_recall(forgot[-1:], views[:1], GRID, far).item() == 0.0  # re-revealed = what it forgot
    assert torch.equal(forgot[-1] == UNSEEN, rerevealed_mask(GRID, *far[0].tolist()))  # exactly those tiles
    assert loop_recall(views[:1], views[:1], GRID, far).item() == 1.0  # copy_last ends on the start view
    # the shift is the env's: each memoryless frame agrees with the real one wherever it drew a tile
    assert all(torch.equal(f[f != UNSEEN], v[f != UNSEEN]) for f, v in zip(forgot, views))


def test_stay_or_move_tells_a_refused_move_from_a_made_one():
    views, _ = world_and_views([2])
    prev, moved = views[:1], views[1:]
    stay, move = stay_or_move(prev, prev, torch.tensor([2]), GRID)  # the map stayed put
    assert stay.item() == 1.0 and move.item() < 0.1
    stay, move = stay_or_move(prev, moved, torch.tensor([2]), GRID)  # the map moved one tile
    assert move.item() == 1.0 and stay.item() < 0.1
    sprite = prev.clone()
    sprite[0, GRID.player[0], GRID.player[1]] = UNSEEN  # the player turned: its tile is not counted
    assert stay_or_move(prev, sprite, torch.tensor([2]), GRID)[0].item() == 1.0
    from mcar.core.agreement import frame_agreement
    from mcar.core.layout import Layout

    flat = lambda v: v.reshape(len(v), -1)  # (T, map) frames -> a clip of T frames without actions
    clips = torch.stack([flat(views), flat(views.flip(0))]).flatten(1)
    curve = frame_agreement(clips, torch.stack([flat(views), flat(views)]).flatten(1), Layout(GRID.map_h, GRID.w, 0))
    assert curve[0].tolist() == [1.0, 1.0] and curve[1, 0].item() < 0.1


@pytest.mark.skipif(not (REPO / "checkpoints/shipped/crafter_tiles_diagd/last.ckpt").exists(),
                    reason="the shipped checkpoint is not in this checkout")
def test_worldtest_runs_on_the_shipped_model(tmp_path):
    """One fresh Crafter world, a 1-tile loop, a 1-step rollout: every file written, the real frames' own rows
    (the env is exact) at the top of the scale, the model's in [0, 1]."""
    from mcar.tools.worldtest import main

    run_in_process(main, "ckpt=checkpoints/shipped/crafter_tiles_diagd", "starts=1", "loop_lengths=[1]",
                         "rollout_frames=1", "warmup=1", "max_moves=1", "logger=none", f"hydra.run.dir={tmp_path}")
    files = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert {"world_tests.json", "world_tests.md", "rollout_agreement.csv", "videos/loop_n1.mp4"} <= files
    loop = json.loads((tmp_path / "world_tests.json").read_text())["loops"]["1"]
    assert set(loop) == {"model context=3", "model context=2", "copy_last", "real"}
    assert loop["real"]["loop_acc"]["mean"] == 1.0 and loop["copy_last"]["recall"]["mean"] == 1.0
    assert 0 <= loop["model context=3"]["recall"]["mean"] <= 1
    rollout = json.loads((tmp_path / "world_tests.json").read_text())["rollout"]
    assert set(rollout) == {"model context=3", "model context=2", "copy_last"}
    assert all(0 <= v["tv_mean"]["mean"] <= 1 for v in rollout.values())
    header = (tmp_path / "rollout_agreement.csv").read_text().splitlines()[0]
    assert header == "row,step,agreement,lo,hi,tv"


def test_histogram_distance_reads_the_mix_of_tiles_not_where_they_are():
    from mcar.eval.world_tests import histogram_distance

    frame = torch.tensor([[0, 1], [2, 3]]).view(1, 1, 2, 2)
    assert histogram_distance(frame.flip(-1), frame, 8).item() == 0  # moved tiles: the same mix
    assert histogram_distance(frame + 4, frame, 8).item() == 1  # no code in common
    assert histogram_distance(torch.zeros_like(frame), frame, 8).item() == pytest.approx(0.75)


def test_worldtest_refuses_unknown_tests_and_windows_before_loading_a_model(tmp_path):
    from mcar.tools.worldtest import main

    for bad, said in (("tests=[rollout,memory]", "tests=['rollout', 'memory']: choose some of"),
                      ("windows=[1]", "windows=[1]: each window is >= 2 frames")):
        with pytest.raises(ValueError, match=re.escape(said)):
            run_in_process(main, "ckpt=checkpoints/shipped/crafter_tiles_diagd", bad, "logger=none",
                           f"hydra.run.dir={tmp_path}")


def test_keep_alive_refills_the_players_needs_so_a_long_rollout_is_one_episode():
    from mcar.eval.world_tests import KEPT_UP, Scene

    for keep in (False, True):
        scene = Scene(100000, (144, 144), (9, 9), 1.0, keep_alive=keep)
        scene.env._player.inventory.update(health=1, food=0, drink=0, energy=0)
        scene.env._player._recover = -15  # one step from losing its last health point
        alive = scene.step(0)
        assert alive == keep
        if keep:
            assert all(scene.env._player.inventory[k] >= v - 1 for k, v in KEPT_UP.items())
