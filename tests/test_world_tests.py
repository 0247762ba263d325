"""mcar worldtest (mcar/crafter/world_tests.py; its scenes, map geometry and report beside it): the loop, shape,
collision, inventory and invented-tile scores on synthetic maps whose answers are known, and the command once on
the shipped tile-exact model at the smallest sizes."""
import json
import re

import pytest
import torch

from mcar.crafter.gen import MOVE_DELTA, PERPENDICULAR, path_offsets
from mcar.crafter.map_tokens import (
    MapGrid,
    creature_events,
    far_mask,
    hidden_mask,
    loop_recall,
    masked_recall,
    rerevealed_mask,
    scroll_start,
    shifted,
    stay_or_move,
)
from mcar.crafter.scenes import fitting_shapes, parse_shape
from mcar.crafter.world_report import policy_markdown
from mcar.eval.world_tests import invented_share

from .conftest import REPO, run_in_process

GRID = MapGrid(map_h=5, w=8)
UNSEEN = -1  # what a memoryless model draws for a tile it has never seen


def world_and_views(moves: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A random 20x20 world of distinct tokens and the (T, 5, 8) views of a player walking `moves` from its middle
    (the view a crop around the player) -> (views, the view's (dx, dy) offset per frame)."""
    world = torch.randperm(400).view(20, 20)
    pos, offs = [6, 7], [(0, 0)]
    for a in moves:
        dx, dy = MOVE_DELTA.get(a, (0, 0))  # a noop stays
        pos = [pos[0] + dx, pos[1] + dy]
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


def test_scroll_start_shows_the_start_frame_moved_with_the_player():
    """The greedy floor: after a real walk, every map tile that was in the start view is where the walk put it, the
    tiles that came into view and the player's tile are the start frame's, the inventory row too; actions kept."""
    from mcar.core.layout import Layout

    moves = [2, 2, 4, 1]
    views, offs = world_and_views(moves)
    layout = Layout(GRID.map_h + 1, GRID.w, 1)  # one inventory row below the map
    inventory = torch.arange(GRID.w) + 1000
    frames = [torch.cat([torch.cat([v, inventory[None] + t]).flatten(), torch.tensor([2000 + t])])
              for t, v in enumerate(views)]
    clips = torch.cat(frames)[None]
    out = scroll_start(clips, [offs.tolist()], GRID, layout, 1).view(len(views), layout.frame_len)
    start = clips.view(len(views), -1)[0, :layout.frame_tokens].view(layout.h, layout.w)
    pr, pc = GRID.player
    for t in range(1, len(views)):
        image = out[t, :layout.frame_tokens].view(layout.h, layout.w)
        _, known = shifted(views[0], *offs[t].tolist())
        known[pr, pc] = False
        assert torch.equal(image[:GRID.map_h][known], views[t][known])  # scrolled exactly
        assert torch.equal(image[:GRID.map_h][~known], start[:GRID.map_h][~known])  # new tiles: the start's
        assert torch.equal(image[GRID.map_h:], start[GRID.map_h:]) and out[t, -1] == 2000 + t
    assert torch.equal(out[0], clips.view(len(views), -1)[0])
    # a walk a whole view away: nothing of the start view is left to scroll, the frame stays the start's
    far = scroll_start(clips[:, :2 * layout.frame_len], [[(0, 0), (0, -GRID.map_h - 1)]], GRID, layout, 1)
    assert torch.equal(far.view(2, -1)[1, :layout.frame_tokens], start.flatten())


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

    # an L (5 frames) is past this 3-frame model's window: run as a control (shapes_beyond_context=true)
    run_in_process(main, "ckpt=checkpoints/shipped/crafter_tiles_diagd", "starts=1", "loop_lengths=[1]",
                   "rollout_frames=1", "warmup=1", "max_moves=1", "shapes=[L_n1_m1]", "shapes_beyond_context=true",
                   "teacher_forced=true", "policies=[explorer,hesitant]", "logger=none", f"hydra.run.dir={tmp_path}")
    files = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert {"world_tests.json", "world_tests.md", "rollout_agreement.csv", "videos/explorer/loop_n1.mp4",
            "videos/explorer/shape_L_n1_m1.mp4", "videos/hesitant/loop_n1.mp4"} <= files
    every = json.loads((tmp_path / "world_tests.json").read_text())
    # each policy apart, named, and whether the checkpoint's data played it (its data: random and explorer)
    assert {k: v["seen"] for k, v in every["policies"].items()} == {"explorer": True, "hesitant": False}
    assert every["seeds"]["worlds"] == [100000, 100039] and every["seeds"]["training_worlds"] > 0
    md_all = (tmp_path / "world_tests.md").read_text()
    assert "## explorer (seen in training)" in md_all and "## hesitant (unseen)" in md_all
    summary = [line for line in md_all.split("## explorer")[0].splitlines() if line.startswith("| ")]
    assert summary[0].startswith("| policy | rollout minus nothing moves | refused moves kept | loop n=1")
    assert [line.split(" | ")[0] for line in summary[1:]] == ["| explorer", "| hesitant (unseen)"]
    assert len({line.count("|") for line in summary}) == 1  # every row as many cells as the header
    assert {row.split(" ", 1)[0] for row in every["curves"]} == {"explorer", "hesitant"}
    res = every["policies"]["explorer"]
    rows = {"model context=3", "model context=2", "model context=3 teacher-forced", "model context=2 teacher-forced",
            "copy_last", "real"}
    loop, shape = res["loops"]["1"], res["shapes"]["L_n1_m1"]
    assert set(loop) == rows and set(shape["rows"]) == rows
    assert shape["frames"] == 5 and shape["made"] == shape["starts"] == 1 and shape["beyond_context"]
    for memory in (loop, shape["rows"]):
        assert memory["real"]["loop_acc"]["mean"] == 1.0 and memory["copy_last"]["recall"]["mean"] == 1.0
        assert 0 <= memory["model context=3"]["recall"]["mean"] <= 1
        # the real frames invent nothing and agree on the inventory; nothing moves invents nothing either
        assert memory["real"]["invented"]["mean"] == memory["copy_last"]["invented"]["mean"] == 0
        assert memory["real"]["inventory"]["mean"] == 1.0
        assert 0 <= memory["model context=2"]["invented"]["mean"] <= 1
    far = shape["rows"]  # an L's first-leg tiles: out of view in both frames before the last
    assert far["real"]["recall_far"]["mean"] == far["copy_last"]["recall_far"]["mean"] == 1.0
    assert 0 <= far["model context=2"]["recall_far"]["mean"] <= 1 and "recall_far" not in loop["real"]
    forced = loop["model context=3 teacher-forced"]  # real frames but the last: a 1-tile loop scores >= 1/2
    assert forced["loop_acc"]["mean"] >= 1 - 1 / 2 - 1e-9 and 0 <= forced["recall"]["mean"] <= 1
    rollout = res["rollout"]
    assert set(rollout) == {"model context=3", "model context=2", "copy_last", "scroll_start"}
    assert all(0 <= v[k]["mean"] <= 1 for v in rollout.values()
               for k in ("tv_mean", "map_mean", "inventory_mean", "invented_mean"))
    assert rollout["copy_last"]["invented_mean"]["mean"] == 0
    assert rollout["scroll_start"]["inventory_mean"] == rollout["copy_last"]["inventory_mean"]  # the start's rows
    creatures = res["creatures"]["rows"]  # nothing moves: no creature comes, goes or pops
    assert set(creatures) == set(rollout) | {"real"} and res["creatures"]["codes"]
    assert all(creatures["copy_last"][k]["mean"] == 0 for k in ("entered", "left", "popped"))
    assert "creatures_minus_real" in creatures["copy_last"] and "creatures_minus_real" not in creatures["real"]
    by_type = res["blocked"]["blocked"]["by_type"]  # the refused moves by what refused them, placed ones apart
    assert sum(v["n"] for v in by_type.values() if not v["placed"]) == res["blocked"]["blocked"]["n"]
    assert {k: v["tried"] for k, v in by_type.items() if v["placed"]} == {"table (placed)": 1, "furnace (placed)": 1}
    header = (tmp_path / "rollout_agreement.csv").read_text().splitlines()[0]
    assert header == "row,step,agreement,lo,hi,tv,map,inventory,invented"
    md = md_all.split("## hesitant")[0]
    assert "| L_n1_m1 | 5 | 1 / 1 (beyond context: a control) | real | 1.000" in md
    margin = rollout["model context=3"]["mean"]["mean"] - rollout["scroll_start"]["mean"]["mean"]
    assert f"| model context=3 - scroll_start | {margin:+.3f} [" in md
    assert "| copy_last | " in md.split("Creatures in the rollouts")[1]


def test_histogram_distance_reads_the_mix_of_tiles_not_where_they_are():
    from mcar.core.agreement import histogram_distance

    frame = torch.tensor([[0, 1], [2, 3]]).view(1, 1, 2, 2)
    assert histogram_distance(frame.flip(-1), frame, 8).item() == 0  # moved tiles: the same mix
    assert histogram_distance(frame + 4, frame, 8).item() == 1  # no code in common
    assert histogram_distance(torch.zeros_like(frame), frame, 8).item() == pytest.approx(0.75)


def test_worldtest_refuses_unknown_tests_and_windows_before_loading_a_model(tmp_path):
    from mcar.tools.worldtest import main

    for bad, said in (("tests=[rollout,memory]", "tests=['rollout', 'memory']: choose some of"),
                      ("shapes=[wait_n1]", "shapes: 'wait_n1' is not a shape: back_n<n>, wait_n<n>_w<w> or"),
                      ("placed=[chest]", "placed=['chest']: Crafter places ['furnace', 'plant', 'stone', 'table']")):
        with pytest.raises(ValueError, match=re.escape(said)):
            run_in_process(main, "ckpt=checkpoints/shipped/crafter_tiles_diagd", bad, "logger=none",
                           f"hydra.run.dir={tmp_path}")


def test_keep_alive_refills_the_players_needs_so_a_long_rollout_is_one_episode():
    from mcar.crafter.scenes import KEPT_UP, Scene

    for keep in (False, True):
        scene = Scene(100000, (144, 144), (9, 9), 1.0, keep_alive=keep)
        scene.env._player.inventory.update(health=1, food=0, drink=0, energy=0)
        scene.env._player._recover = -15  # one step from losing its last health point
        alive = scene.step(0)
        assert alive == keep
        if keep:
            assert all(scene.env._player.inventory[k] >= v - 1 for k, v in KEPT_UP.items())


@pytest.mark.parametrize("spec,frames", [("back_n3", 7), ("wait_n1_w2", 5), ("L_n2_m1", 7), ("L_n1_m1", 5)])
def test_shapes_walk_back_to_the_start_along_their_path(spec, frames):
    shape = parse_shape(spec)
    assert shape.name == spec and shape.frames == frames
    for a in MOVE_DELTA:
        for b in PERPENDICULAR[a]:
            acts = shape.actions(a, b)
            offs = path_offsets(acts)
            assert len(offs) == frames and offs[0] == offs[-1] == (0, 0)  # net zero
            far = tuple(shape.n * d for d in MOVE_DELTA[a])
            assert offs[shape.n] == far  # n tiles out along a
            if shape.kind == "wait":  # it stands still at the far end, then comes back
                assert offs[shape.n:shape.n + shape.m + 1] == [far] * (shape.m + 1) and acts.count(0) == shape.m
            if shape.kind == "L":  # then m at right angles: the corner, and the same way back
                corner = (far[0] + shape.m * MOVE_DELTA[b][0], far[1] + shape.m * MOVE_DELTA[b][1])
                assert offs[shape.n + shape.m] == corner and offs == offs[::-1]
    for bad in ("L_n0_m1", "loop_n1", "wait_n1", "back_n1_w2"):
        with pytest.raises(ValueError, match="is not a shape"):
            parse_shape(bad)
    run, skipped = fitting_shapes([shape, parse_shape("back_n1")], context=6)
    assert [s.name for s in run] == ([spec] if frames <= 6 else []) + ["back_n1"]
    assert skipped == ({} if frames <= 6 else {spec: {"frames": frames, "skipped": f"{frames} frames > context 6"}})
    assert len(fitting_shapes([shape], context=2, beyond=True)[0]) == 1


def test_shape_recall_counts_every_tile_the_walk_hid():
    """An L path: the real frames recall every hidden tile, a memoryless model none; the hidden tiles are the union
    over the walk: the corner's view hides them all, more than the first leg's end alone."""
    shape = parse_shape("L_n2_m1")
    acts = shape.actions(2, 4)
    views, offs = world_and_views(acts)
    assert torch.equal(views[-1], views[0])
    mask = hidden_mask(GRID, offs.tolist())
    assert mask.equal(rerevealed_mask(GRID, *offs[shape.n + shape.m].tolist()))
    assert mask.sum() > rerevealed_mask(GRID, *offs[shape.n].tolist()).sum()
    assert masked_recall(views[-1:], views[:1], mask[None]).item() == 1.0
    forgot = memoryless(views, acts)
    assert torch.equal(forgot[-1] == UNSEEN, mask)  # exactly the hidden tiles are lost
    assert masked_recall(forgot[-1:], views[:1], mask[None]).item() == 0.0
    # a straight loop: its union is the far end's re-revealed tiles (loop_recall's)
    loop = [1, 1, 2, 2]
    views, offs = world_and_views(loop)
    assert torch.equal(hidden_mask(GRID, offs.tolist()), rerevealed_mask(GRID, *offs[2].tolist()))
    assert loop_recall(views[-1:], views[:1], GRID, offs[2][None]).item() == 1.0


def two_frames_back(moves: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A walk's real views, its offsets, and the last frame of a model that remembers only the two frames before
    it (the out-and-back loop's copy), worked out on world coordinates: a tile it saw in neither is UNSEEN."""
    views, offs = world_and_views(moves)
    world = torch.full((20, 20), UNSEEN)
    for (dx, dy), view in zip(offs[-3:-1].tolist(), views[-3:-1]):
        world[7 + dy:7 + dy + GRID.map_h, 6 + dx:6 + dx + GRID.w] = view
    dx, dy = offs[-1].tolist()
    return views, offs, world[7 + dy:7 + dy + GRID.map_h, 6 + dx:6 + dx + GRID.w]


@pytest.mark.parametrize("spec", ["L_n1_m1", "L_n2_m1", "wait_n1_w2", "back_n3"])
def test_far_recall_counts_only_what_a_copy_from_two_frames_back_cannot_restore(spec):
    """An L's second leg comes back into view one frame before the end, so a model that copies from two frames back
    restores it: `recall` credits that model, `recall_far` does not; the real frames score 1 on both. A wait's
    hidden tiles are all far."""
    shape = parse_shape(spec)
    views, offs, end = two_frames_back(shape.actions(2, 4))
    assert torch.equal(views[-1], views[0])
    hidden, far = hidden_mask(GRID, offs.tolist()), far_mask(GRID, offs.tolist())
    assert far.any() and bool((far <= hidden).all())
    assert masked_recall(views[-1:], views[:1], far[None]).item() == 1.0
    assert masked_recall(end[None], views[:1], far[None]).item() == 0.0  # the far tiles: exactly the unseen ones
    assert torch.equal(end == UNSEEN, far)
    if spec.startswith("wait"):  # the view held still: every hidden tile is far
        assert torch.equal(far, hidden)
    else:  # an L's second leg, a long loop's inner columns: back in view before the end
        assert far.sum() < hidden.sum() and masked_recall(end[None], views[:1], hidden[None]).item() > 0
    assert not far_mask(GRID, world_and_views([2, 1])[1].tolist()).any()  # out and straight back: nothing far


def test_teacher_forced_rows_guess_the_last_frame_from_the_real_ones_in_the_window():
    """worldtest teacher_forced=true (rows every world test shares, mcar/eval/world_tests.py): one causal pass over
    the window's real frames; a model that reads the next slot off its input returns the clip unchanged (the slots
    line up), and it sees exactly `context` frames."""
    from types import SimpleNamespace

    from mcar.core.layout import Layout
    from mcar.eval.world_tests import ModelRows

    layout, cb = Layout(3, 4, 1), 10

    class NextSlot(torch.nn.Module):  # logits at slot s: the token at s + 1 (a perfect next-token predictor)
        seen: list = []

        def forward(self, tokens, coords):
            self.seen.append((tokens.shape[1], coords.shape[0]))
            nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1)
            return torch.nn.functional.one_hot(nxt, cb + 5).float() - (torch.arange(cb + 5) >= cb).float()

    tests = ModelRows.__new__(ModelRows)
    tests.layout, tests.cb, tests.batch_size = layout, cb, 2
    tests.wm = SimpleNamespace(model=NextSlot(), device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    clips = torch.randint(0, cb, (3, 5 * layout.frame_len), generator=g)
    clips.view(3, 5, -1)[..., -1] = cb + 2  # the action slots
    for context in (2, 6):
        tests.wm.model.seen.clear()
        assert torch.equal(tests.teacher_forced(clips, context), clips)
        window = min(context, 5) * layout.frame_len
        assert tests.wm.model.seen == [(window, window)] * 2  # batches of 2 and 1
    tests.wm.model = lambda tokens, coords: torch.nn.functional.one_hot(torch.full_like(tokens, 7), cb + 5).float()
    guessed = tests.teacher_forced(clips, 6).view(3, 5, -1)  # every guess is code 7: only the last frame's image
    assert bool((guessed[:, -1, :layout.frame_tokens] == 7).all())
    assert torch.equal(guessed[:, :-1], clips.view(3, 5, -1)[:, :-1]) and bool((guessed[:, -1, -1] == cb + 2).all())


def test_invented_tiles_are_codes_in_neither_the_real_frame_nor_the_prompt():
    real = torch.tensor([[0, 1], [2, 3]]).view(1, 1, 2, 2)
    prompt = torch.tensor([[4, 4], [5, 5]]).view(1, 1, 2, 2)
    assert invented_share(real.clone(), real, prompt).item() == 0  # a copy of the real frame
    assert invented_share(prompt.clone(), real, prompt).item() == 0  # a copy of the prompt
    assert invented_share(real.flip(-1), real, prompt).item() == 0  # misplaced tiles are not invented
    made_up = real.clone()
    made_up[..., 0, 0] = 9  # a code in neither
    assert invented_share(made_up, real, prompt).item() == 0.25
    # per frame against that frame's real codes: a frame-0 code drawn in frame 1 counts there
    two = torch.stack([real[:, 0], real[:, 0] + 10], 1)  # (1, 2, 2, 2)
    drawn = torch.stack([real[:, 0], real[:, 0]], 1)
    assert invented_share(drawn, two, prompt).tolist() == [[0.0, 1.0]]
    assert invented_share(drawn, two, real).tolist() == [[0.0, 0.0]]  # ... unless the prompt showed it


COW, GROUND = 9, 0


def walk_past(world: torch.Tensor, start: tuple[int, int], moves: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (T, 5, 8) views of a player walking `moves` over `world` from `start` (the view's top-left corner) and the
    (T-1, 2) moves."""
    (x, y), views, steps = start, [], []
    for a in [None, *moves]:
        if a is not None:
            x, y = x + MOVE_DELTA[a][0], y + MOVE_DELTA[a][1]
            steps.append(MOVE_DELTA[a])
        views.append(world[y:y + GRID.map_h, x:x + GRID.w])
    return torch.stack(views), torch.tensor(steps)


def test_creature_events_count_what_comes_into_view_goes_and_pops():
    """A cow standing still while the player walks past it enters at one edge and leaves at the other, whatever the
    scroll; a model that does not scroll the view has it go nowhere; one that redraws the cow elsewhere pops it."""
    world = torch.full((9, 30), GROUND)
    world[4, 15] = COW
    right = next(a for a, d in MOVE_DELTA.items() if d == (1, 0))
    views, moves = walk_past(world, (6, 2), [right] * 12)  # the cow comes in on the right, leaves on the left
    per_frame = lambda ev: {k: round(float(v[0]) * 12) for k, v in ev.items()}
    real = per_frame(creature_events(views[None], torch.tensor([COW]), moves[None]))
    assert real == {"creatures": 8, "entered": 1, "left": 1, "popped": 0}
    still = views[6:7].expand(13, -1, -1)  # nothing moves (the cow in view) while the player walks: no event
    assert per_frame(creature_events(still[None], torch.tensor([COW]), moves[None])) == {
        "creatures": 12, "entered": 0, "left": 0, "popped": 0}
    mid = views[6].clone()  # the cow inside the view
    jumpy = torch.stack([mid, mid, mid.roll(3, -1), mid.roll(3, -1)])  # it jumps 3 tiles: vanished + appeared
    none = torch.zeros(3, 2, dtype=torch.long)
    assert per_frame(creature_events(jumpy[None], torch.tensor([COW]), none[None])) == {
        "creatures": 12, "entered": 0, "left": 0, "popped": 8}  # 2 events in 3 steps, x12
    stepping = torch.stack([mid, mid.roll(1, -1), mid.roll(1, -2)])  # one tile a turn (a diagonal pair too): no event
    assert per_frame(creature_events(stepping[None], torch.tensor([COW]), none[:2][None]))["popped"] == 0


def test_inventory_rows_are_scored_apart_from_the_map():
    grid = MapGrid(map_h=3, w=4)
    frame = torch.arange(20).view(1, 5, 4)
    assert grid.maps(frame).shape == (1, 3, 4) and grid.inventory(frame).shape == (1, 2, 4)
    assert torch.equal(torch.cat([grid.maps(frame), grid.inventory(frame)], -2), frame)
    other = frame.clone()
    other[0, 4, 0] = -1  # one inventory tile differs
    assert torch.equal(grid.maps(other), grid.maps(frame))
    assert (grid.inventory(other) == grid.inventory(frame)).double().mean().item() == 7 / 8


def test_markdown_says_which_shapes_were_skipped_and_which_ran():
    ci = {"mean": 0.5, "lo": 0.4, "hi": 0.6, "n": 2}
    rows = {"real": {"recall": ci, "loop_acc": ci, "inventory": ci, "invented": ci}}
    res = {"starts": 2, "context": 6, "sampler": "diagd", "loops": {}, "blocked": {}, "rollout": {},
           "shapes": {"wait_n1_w2": {"frames": 5, "made": 2, "starts": 2, "beyond_context": False, "rows": rows},
                      "L_n1_m1": {"frames": 5, "made": 0, "starts": 2, "beyond_context": False},
                      "back_n3": {"frames": 7, "skipped": "7 frames > context 6"}}}
    md = policy_markdown(res)
    assert "| wait_n1_w2 | 5 | 2 / 2 | real | 0.500 [0.400, 0.600] |" in md
    assert "| L_n1_m1 | 5 | 0 / 2 |" in md
    assert "| back_n3 | 7 | skipped: 7 frames > context 6 (shapes_beyond_context=true runs it) |" in md


def test_memory_gains_are_paired_against_the_2_frame_window():
    """Each loop's and shape's recall, longer window minus the 2-frame window's, start by start; in the markdown."""
    from mcar.eval.stats import interval
    from mcar.eval.world_tests import window_gains

    g = torch.Generator().manual_seed(0)
    short = torch.rand(32, generator=g, dtype=torch.float64) * 0.5
    ci = {"mean": 0.5, "lo": 0.4, "hi": 0.6, "n": 2}
    row = lambda recall, far=None: {"recall": interval(recall, 0), "loop_acc": ci, "inventory": ci,  # noqa: E731
                                    "invented": ci, **({"recall_far": interval(far, 0)} if far is not None else {})}
    rows = lambda gain, far=None: {  # noqa: E731
        "model context=6": row(short + gain, None if far is None else short + far),
        "model context=2": row(short, None if far is None else short), "copy_last": row(short)}
    res = {"starts": 32, "context": 6, "sampler": "diagd", "seed": 0, "blocked": {}, "rollout": {},
           "loops": {"1": rows(0.3)},
           "shapes": {"wait_n1_w2": {"frames": 5, "made": 32, "starts": 32, "rows": rows(0.0, far=0.0)},
                      "L_n1_m1": {"frames": 5, "made": 32, "starts": 32, "rows": {
                          **rows(0.2, far=0.1), "model context=6 teacher-forced": row(short + 0.05),
                          "model context=2 teacher-forced": row(short + 0.02)}},
                      "back_n3": {"frames": 7, "skipped": "beyond context"}}}
    gains = {g["walk"]: g for g in window_gains(res, 0)}
    # a wait's far tiles are all it hid: one row, not the same numbers twice
    assert set(gains) == {"loop n=1", "shape wait_n1_w2", "shape L_n1_m1", "shape L_n1_m1 (far tiles)"}
    assert gains["loop n=1"]["row"] == "model context=6"
    assert gains["loop n=1"]["mean"] == pytest.approx(0.3) and gains["loop n=1"]["lo"] == pytest.approx(0.3)
    assert gains["shape wait_n1_w2"]["lo"] == gains["shape wait_n1_w2"]["hi"] == 0
    assert gains["shape L_n1_m1 (far tiles)"]["mean"] == pytest.approx(0.1)
    forced = [g for g in window_gains(res, 0) if g["row"].endswith("teacher-forced")]  # against its own 2 frames
    assert [(g["walk"], g["row"]) for g in forced] == [("shape L_n1_m1", "model context=6 teacher-forced")]
    assert forced[0]["mean"] == pytest.approx(0.03)
    md = policy_markdown(res)
    assert "| loop n=1 | model context=6 | +0.300 [+0.300, +0.300] |" in md
    assert "| shape L_n1_m1 (far tiles) | model context=6 | +0.100 [+0.100, +0.100] |" in md


def test_versus_compares_two_runs_start_by_start():
    """worldtest versus=<other run>: each model row minus the other run's, paired by start, with an interval."""
    from mcar.eval.stats import interval
    from mcar.eval.world_tests import paired_versus, versus_markdown

    g = torch.Generator().manual_seed(0)
    base = torch.rand(32, generator=g, dtype=torch.float64)
    run = lambda shift: {"rollout": {"model context=6": {"mean": interval(base + shift, 0)}},
                         "loops": {"1": {"model context=6": {"recall": interval(base, 0)}}}}
    rows = {r["what"]: r for r in paired_versus(run(0.05), json.loads(json.dumps(run(0.0))), 0)}
    better = rows["rollout model context=6: mean"]
    assert better["difference"] == pytest.approx(0.05) and better["lo"] == pytest.approx(0.05)  # every start +0.05
    same = rows["loop 1 model context=6: recall"]
    assert same["difference"] == 0 and same["lo"] == same["hi"] == 0
    assert "| rollout model context=6: mean |" in versus_markdown(list(rows.values()), "x.json")


def test_versus_pairs_each_runs_memory_gain_start_by_start():
    """A shape's gain (a model row minus its own 2-frame window's) of one run minus the other's, start by start: a
    run that gains 0.06 more at every start, wherever its 2-frame window sits, differs by exactly 0.06; a wait's
    far tiles (all of its recall) get no second row."""
    from mcar.eval.stats import interval
    from mcar.eval.world_tests import paired_versus

    g = torch.Generator().manual_seed(1)
    short, far = (torch.rand(40, generator=g, dtype=torch.float64) * 0.5 for _ in range(2))
    forced = " teacher-forced"

    def run(gain: float, window: torch.Tensor) -> dict:
        rows = {f"model context={n}{forced}": {"recall": interval(window + g, 0), "recall_far": interval(far + g, 0)}
                for n, g in ((8, gain), (2, 0.0))}
        wait = {f"model context=8{forced}": {k: interval(window + gain, 0) for k in ("recall", "recall_far")},
                f"model context=2{forced}": {k: interval(window, 0) for k in ("recall", "recall_far")}}
        return {"shapes": {"L_n1_m1": {"rows": rows}, "wait_n1_w2": {"rows": wait}}}

    mine, theirs = run(0.10, short), json.loads(json.dumps(run(0.04, short.flip(0))))
    rows = {r["what"]: r for r in paired_versus(mine, theirs, 0)}
    for what in (f"shape L_n1_m1 model context=8{forced}: recall_far minus the 2-frame window's",
                 f"shape wait_n1_w2 model context=8{forced}: recall minus the 2-frame window's"):
        assert rows[what]["difference"] == pytest.approx(0.06) and rows[what]["lo"] == pytest.approx(0.06), what
    assert f"shape wait_n1_w2 model context=8{forced}: recall_far minus the 2-frame window's" not in rows
    assert not any("context=2" in w and "minus the 2-frame" in w for w in rows)


# ------------------------------------------------------------------------------------------------ refused moves by type
VIEW, SIZE, TILE = (9, 9), (144, 144), 16  # Crafter's 9x9 view at 16 pixels a tile


class TileCodes:
    """A stand-in for the data's patch VQ: every distinct 16x16 tile of pixels its own code (exact at a fixed
    daylight), for the blocked test's scoring without a model."""

    cb = 4096

    def __init__(self):
        self.codes: dict[bytes, int] = {}

    def images(self, frames) -> torch.Tensor:
        return torch.tensor([[[self.codes.setdefault(f[r * TILE:(r + 1) * TILE, c * TILE:(c + 1) * TILE].tobytes(),
                                                     len(self.codes)) for c in range(VIEW[0])] for r in range(VIEW[1])]
                              for f in frames])

    def clip(self, rec) -> torch.Tensor:
        from mcar.tokenizer.clips import join_clip

        return join_clip(self.images(rec.frames), torch.tensor(rec.actions)[:, None], self.cb)


def stand_in_tests():
    """WorldTests without a model: tile codes for the VQ, and a perfect model (the real frames come back)."""
    from omegaconf import OmegaConf

    from mcar.core.layout import Layout
    from mcar.crafter.gen import map_rows
    from mcar.crafter.world_tests import WorldTests

    wt = object.__new__(WorldTests)
    wt.cfg = OmegaConf.create({"seed": 0, "max_moves": 256})
    wt.layout, wt.grid, wt.tokens = Layout(VIEW[1], VIEW[0], 1), MapGrid(map_rows(VIEW), VIEW[0]), TileCodes()
    wt.generate = lambda clips, context=None, prompt_frames=None: clips
    return wt


@pytest.fixture(scope="module")
def placed_world():
    """One fresh world (the test's first seed): a wander that bumps often, then a table and a furnace placed and
    walked into."""
    from mcar.crafter.scenes import Scene

    scene = Scene(100000, SIZE, VIEW, 1.0)
    wander = scene.wander(48, p_bump=0.6)
    placed = {name: scene.place_and_bump(name) for name in ("table", "furnace")}
    return scene, wander, placed


def test_placed_obstacles_are_in_the_world_drawn_and_refuse_the_move(placed_world):
    from mcar.crafter.gen import tile_kind

    scene, _, placed = placed_world
    grid, codes = MapGrid(5, VIEW[0]), TileCodes()
    pr, pc = grid.map_h // 2 + 1, grid.w // 2  # the player's tile in Crafter's 9x7 map view
    for name, rec in placed.items():
        assert rec is not None, f"{name}: could not be placed in this world"
        move, place = rec.actions[0], rec.actions[1]
        assert rec.actions == [move, place, move, 0] and place == 8 + (name == "furnace")  # place_table, _furnace
        (x, y), (dx, dy) = rec.pos[1], MOVE_DELTA[move]
        assert rec.pos[0] == (x - dx, y - dy) and rec.pos[1] == rec.pos[2] == rec.pos[3]  # one step, then refused
        assert scene.env._world[(x + dx, y + dy)][0] == name and tile_kind(scene.env, x + dx, y + dy) == name
        assert rec.blocker[2] == name
        before, after, bumped = codes.images(rec.frames[1:4])
        assert before[pr + dy, pc + dx] != after[pr + dy, pc + dx]  # drawn where it was placed ...
        assert after[pr + dy, pc + dx] == bumped[pr + dy, pc + dx]  # ... and still there after the refused move


def test_refused_moves_split_by_type_sum_up_and_a_perfect_model_keeps_every_type(placed_world):
    from mcar.crafter.world_report import policy_markdown

    _, wander, placed = placed_world
    assert wander is not None
    out = stand_in_tests().blocked_test([wander], {name: [rec] for name, rec in placed.items()})
    blocked, by_type = out["blocked"], out["blocked"]["by_type"]
    wandered = {k: v for k, v in by_type.items() if not v["placed"]}
    assert len(wandered) >= 2 and sum(v["n"] for v in wandered.values()) == blocked["n"] > 0
    assert {k for k, v in by_type.items() if v["placed"]} == {"table (placed)", "furnace (placed)"}
    for name, v in by_type.items():  # the real frames: every refused move keeps the map, whatever refused it
        assert v["stayed"]["mean"] == v["real_stayed"]["mean"] == v["map_acc"]["mean"] == 1.0, name
    assert by_type["furnace (placed)"] | {"stayed": None} == {
        "type": "furnace", "placed": True, "tried": 1, "n": 1, "starts": 1, "stayed": None,
        "real_stayed": by_type["furnace (placed)"]["real_stayed"], "map_acc": by_type["furnace (placed)"]["map_acc"]}
    assert blocked["stayed"]["mean"] == 1.0 and out["free"]["moved"]["mean"] == 1.0
    md = policy_markdown({"starts": 1, "context": 2, "sampler": "x", "loops": {}, "shapes": {}, "rollout": {},
                   "blocked": out})
    rows = [line for line in md.splitlines() if line.startswith("| ") and " | 1.000 (one start) |" in line]
    ns = [int(r.split(" | ")[1]) for r in rows]
    assert len(rows) == len(by_type) and ns[:len(wandered)] == sorted(ns[:len(wandered)], reverse=True)
    assert rows[-2:] == [f"| {name} (placed) | 1 | 1 of 1 worlds | 1.000 (one start) | 1.000 (one start) | "
                         f"1.000 (one start) |" for name in ("furnace", "table")]  # after the wander's, by name


def test_each_shape_is_walked_from_where_the_wander_ended_whatever_the_others():
    """A shape's walk (and a placed obstacle's) does not depend on which shapes come before it in the list: each
    starts from the scene as the wander left it."""
    from mcar.crafter.scenes import record_start

    wait, L = parse_shape("wait_n1_w2"), parse_shape("L_n1_m1")
    common = dict(loop_lengths=[1], wander_steps=8, p_bump=0.3, warmup=4, size=SIZE, view=VIEW, daylight=1.0,
                  policy="hesitant")
    both = record_start(100001, **common, shapes=[wait, L], placed=["table"])
    alone = record_start(100001, **common, shapes=[L])
    assert both is not None and alone is not None and "L_n1_m1" in both.shapes
    assert both.shapes["L_n1_m1"].actions == alone.shapes["L_n1_m1"].actions
    assert both.shapes["L_n1_m1"].pos == alone.shapes["L_n1_m1"].pos
    assert all((a == b).all() for a, b in zip(both.shapes["L_n1_m1"].frames, alone.shapes["L_n1_m1"].frames))
    assert both.shapes["L_n1_m1"].pos[0] == both.shapes["wait_n1_w2"].pos[0] == both.wander.pos[-1]


def test_the_summary_table_has_a_column_per_header_cell_whatever_tests_ran():
    """A rollout-only run has no recall columns: each summary row still has as many cells as the header."""
    from mcar.crafter.world_report import summary_lines

    res = {"context": 2, "seed": 0,
           "policies": {"sweeper": {"seen": False, "loops": {}, "shapes": {}, "rollout": {}, "blocked": {}}}}
    header, rule, row = summary_lines(res)
    assert header.count("|") == rule.count("|") == row.count("|") == 5
    assert row.startswith("| sweeper (unseen) |")
