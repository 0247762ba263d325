"""The committed models, driven through mcar.play from real Crafter starts. checkpoints/shipped/crafter_tiles_diagd
(experiment=crafter_tiles + 150 steps of exact DiagD fine-tuning): press a move key and the world moves the way
Crafter moves it. checkpoints/shipped/crafter_world_recall_grpo, the play default (shipped/crafter_world moved onto the
every-tile VQ by finetune.py retoken=true, fine-tuned on recall plans with far_copy_weight, + 150 GRPO steps): the map
also stays put on a move Crafter refuses, a placed furnace or table included, and what a step out of view hid comes back
on the step back."""

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from mcar.crafter.gen import blocked_moves, make_env
from mcar.tokenizer.vq_model import encode_tokens, load_vq
from tests.conftest import REPO, compose

SHIPPED = REPO / "checkpoints" / "shipped" / "crafter_tiles_diagd"
MOVES = {"move_left": 1, "move_right": 2, "move_up": 3, "move_down": 4}
TILES, VIEW = (224, 384), (24, 14)  # data=crafter_tiles: frames (H, W), Crafter's grid in tiles (W, H)


def crafter_start(seed: int):
    """A tile-view Crafter at noon (data=crafter_tiles' renderer) whose player can walk in all four directions ->
    (start frame, {move: the frame Crafter shows after it})."""
    for s in range(seed, seed + 50):
        env, start = make_env(s, TILES, VIEW, daylight=1.0)
        if blocked_moves(env):
            continue
        after = {name: make_env(s, TILES, VIEW, daylight=1.0)[0].step(action)[0] for name, action in MOVES.items()}
        return start, after
    raise AssertionError("no start with four free neighbours")


@pytest.mark.skipif(not (SHIPPED / "last.ckpt").exists(), reason="the shipped checkpoint is not in this checkout")
def test_the_shipped_model_moves_the_world_like_crafter(tmp_path):
    from mcar.sampling.play_server import open_game

    start, truth = crafter_start(0)
    Image.fromarray(start).save(tmp_path / "start.png")
    session = open_game(compose("play", [f"ckpt={SHIPPED}", "data=crafter_tiles",
                                             f"prompt_image={tmp_path}/start.png", "sampler.temperature=0",
                                             "threads=1"]))
    vq = load_vq(compose("play", ["data=crafter_tiles"]).vq.path)
    tokens = lambda frame: encode_tokens(vq, torch.from_numpy(np.ascontiguousarray(frame))[None])[0]
    t0 = tokens(start)[1:12, 1:23]  # the map's interior
    generated = {}
    for name, frame in truth.items():
        session.reset()
        image, info = session.step(name)
        assert info["action"] == name
        got, want = tokens(image)[1:12, 1:23], tokens(frame)[1:12, 1:23]
        copy = (want == t0).float().mean().item()  # "nothing moves" agrees with Crafter on this much of the map
        agree = (got == want).float().mean().item()
        assert copy < 0.8, (name, copy)  # the move changes the map
        # greedy, 2026-11-23: left 0.95 (copy 0.74), right 0.97 (0.72), up 0.96 (0.73), down 0.99 (0.72)
        assert agree > 0.9 and agree > copy + 0.15, (name, agree, copy)
        generated[name] = got
    # one start frame, four keys, four different worlds
    names = list(generated)
    assert all(not torch.equal(generated[a], generated[b]) for i, a in enumerate(names) for b in names[i + 1:])


def crafter_rollout(seed: int, steps: int, rng):
    """A tile-view Crafter at noon from `seed`, driven by random moves and noops -> (start, actions, frames)."""
    env, start = make_env(seed, TILES, VIEW, daylight=1.0)
    actions = [str(a) for a in rng.choice([*MOVES, "noop"], steps)]
    return start, actions, [env.step(MOVES.get(a, 0))[0] for a in actions]


@pytest.mark.skipif(not (SHIPPED / "last.ckpt").exists(), reason="the shipped checkpoint is not in this checkout")
def test_the_shipped_model_follows_a_rollout_of_random_moves(tmp_path):
    """Eight steps of random moves and noops from two Crafter starts through mcar.play's defaults (its whole 3-frame
    clip on the rolling KV cache, k=2),
    greedy: the generated frames, each made from the model's own previous frame, keep agreeing with Crafter's
    frames (the map's interior), well above 'nothing moves' (the start frame) where the world moved."""
    from mcar.sampling.play_server import open_game

    vq = load_vq(compose("play", ["data=crafter_tiles"]).vq.path)
    tokens = lambda frame: encode_tokens(vq, torch.from_numpy(np.ascontiguousarray(frame))[None])[0][1:12, 1:23]
    rng, agree, still = np.random.default_rng(0), [], []
    for seed in (100, 101):
        start, actions, truth = crafter_rollout(seed, 8, rng)
        Image.fromarray(start).save(tmp_path / "start.png")
        session = open_game(compose("play", [f"ckpt={SHIPPED}", "data=crafter_tiles", "sampler.temperature=0",
                                                 f"prompt_image={tmp_path}/start.png", "threads=1"]))
        assert session.context == 3 and session.k == 2
        t0 = tokens(start)
        for action, frame in zip(actions, truth):
            image, _ = session.step(action)
            want = tokens(frame)
            agree.append((tokens(image) == want).float().mean().item())
            still.append((t0 == want).float().mean().item())
    agree, still = np.array(agree), np.array(still)
    moved = still < 0.99  # steps whose frame differs from the start (not noops, nor moves back to it)
    # greedy, 2026-11-23: agree 1.00 0.99 0.97 0.96 0.95 0.91 0.88 0.82 | 1.00 1.00 0.99 0.99 0.98 0.98 0.98 0.96,
    # still (the start frame) 1.00 0.78 0.99 0.76 0.67 0.76 0.98 0.76 | 0.87 0.87 0.90 0.90 0.86 0.90 0.90 0.87
    # rolling cache at context 3, 2026-11-26: 1.00 1.00 0.95 0.94 0.91 0.77 0.69 0.60 | 1.00 1.00 0.97 0.97 0.94 0.93
    # 0.92 0.88: the first game drifts sooner than with the old re-prefilled 2-frame window (BENCHMARKS.md)
    assert agree.mean() > 0.88 and agree.min() > 0.55, agree.round(3)
    assert agree[moved].mean() > still[moved].mean() + 0.05, (agree.round(3), still.round(3))


WORLD = REPO / "checkpoints" / "shipped" / "crafter_world_recall_grpo"  # the play default (every-tile VQ, post-trained)
WORLD_SIZE, WORLD_VIEW, WORLD_MAP_ROWS = (144, 144), (9, 9), 7  # data=crafter_tiles_world: a 9x7 map, 2 item rows
MOVE_NAMES = {move: name for name, move in MOVES.items()}


def world_env(seed: int):
    from mcar.crafter.gen import make_env

    return make_env(seed, WORLD_SIZE, WORLD_VIEW, daylight=1.0)


def world_scene(seed: int, want):
    """Crafter from `seed`, walked by the explorer policy until `want(free, blocked)` holds -> (the env there, its
    frame, {"free": moves the env carries out, "blocked": moves it refuses}). Branch with copy.deepcopy(env)."""
    from mcar.crafter.gen import ExplorerPolicy

    env, frame = world_env(seed)
    policy = ExplorerPolicy(np.random.default_rng(seed))
    for _ in range(200):
        moves = {"free": neighbours(env, True), "blocked": neighbours(env, False)}
        if want(**moves):
            return env, frame, moves
        frame = env.step(policy(env))[0]
    raise AssertionError("no such start")


def neighbours(env, walkable_wanted: bool) -> list[int]:
    from mcar.crafter.gen import MOVES, blocked_moves

    blocked = blocked_moves(env)
    return blocked if not walkable_wanted else [a for a in MOVES if a not in blocked]


def world_session(tmp_path, start, *overrides):
    from mcar.sampling.play_server import open_game

    Image.fromarray(start).save(tmp_path / "start.png")
    return open_game(compose("play", [f"ckpt={WORLD}", "data=crafter_tiles_all_world",
                                          f"prompt_image={tmp_path}/start.png", "sampler.temperature=0", "threads=1",
                                          *overrides]))


def world_tokens():
    vq = load_vq(compose("play", ["data=crafter_tiles_all_world"]).vq.path)
    return lambda frame: encode_tokens(vq, torch.from_numpy(np.ascontiguousarray(frame))[None])[0][:WORLD_MAP_ROWS]


def off_player(maps: torch.Tensor) -> torch.Tensor:
    """Map tokens without the player's tile (its sprite turns to face the move)."""
    keep = torch.ones(maps.shape[-2:], dtype=torch.bool)
    keep[WORLD_MAP_ROWS // 2, WORLD_VIEW[0] // 2] = False
    return maps[..., keep]


@pytest.mark.skipif(not (WORLD / "last.ckpt").exists(), reason="the shipped checkpoint is not in this checkout")
def test_the_world_model_keeps_the_map_on_refused_moves_and_moves_it_on_free_ones(tmp_path):
    """Greedy, from fresh Crafter starts: a move into an obstacle (the env refuses it) leaves the map where it was; a
    free move shifts it the way Crafter does."""
    tokens, stayed, followed = world_tokens(), [], []
    for seed in (200, 300, 400):
        env, start, moves = world_scene(seed, lambda free, blocked: free and blocked)
        session = world_session(tmp_path, start)
        for kind, scores in (("blocked", stayed), ("free", followed)):
            for move in moves[kind]:
                want = off_player(tokens(copy.deepcopy(env).step(move)[0]))
                session.reset()
                image, _ = session.step(MOVE_NAMES[move])
                scores.append((off_player(tokens(image)) == want).float().mean().item())
    stayed, followed = np.array(stayed), np.array(followed)
    # greedy, 2026-11-26: stayed 0.95 1.00 1.00, followed 0.95-1.00 (mean 0.977)
    assert stayed.mean() > 0.9 and followed.mean() > 0.9, (stayed.round(3), followed.round(3))


HIDDEN_EDGE = {1: (slice(None), -1), 2: (slice(None), 0), 3: (-1, slice(None)), 4: (0, slice(None))}
# a move -> the map tiles it takes out of view (the column or row on the far side), back in view after the move back


@pytest.mark.skipif(not (WORLD / "last.ckpt").exists(), reason="the shipped checkpoint is not in this checkout")
def test_the_world_model_remembers_what_a_loop_hid(tmp_path):
    """One tile out and one back, greedy: the column (row) that left the view comes back as it was at the start when
    the start frame is still in the model's context, and is guessed without it (context=2: the last frame only).
    Loops are picked whose hidden edge is not all one tile (a memoryless model would guess all grass right)."""
    from mcar.crafter.gen import BACK

    tokens, recall = world_tokens(), {None: [], 2: []}

    def varied(move: int, frame) -> bool:
        edge = tokens(frame)[HIDDEN_EDGE[move]]
        return (edge != edge.mode().values).sum() >= 2

    for seed in (500, 600, 700, 800):
        env, start, moves = world_scene(seed, lambda free, blocked: free)
        for _ in range(200):
            loops = [m for m in moves["free"] if varied(m, start)]
            if loops:
                break
            start = env.step(moves["free"][0])[0]
            moves = {"free": neighbours(env, True)}
        move = loops[0]
        want = tokens(start)[HIDDEN_EDGE[move]]
        for context in recall:
            session = world_session(tmp_path, start, *([f"sampler.context={context}"] if context else []))
            session.step(MOVE_NAMES[move])
            image, _ = session.step(MOVE_NAMES[BACK[move]])
            recall[context].append((tokens(image)[HIDDEN_EDGE[move]] == want).float().mean().item())
    recall = {k: np.array(v) for k, v in recall.items()}
    # greedy, 2026-11-26: context 6 (the checkpoint's) 1.00 1.00 0.89 1.00; context 2 0.71 0.57 0.67 0.71
    assert recall[None].mean() > 0.9 and recall[None].mean() > recall[2].mean() + 0.2, recall


def walked_through(before: torch.Tensor, after: torch.Tensor, move: int) -> float:
    """Agreement of `after` with `before` scrolled one tile by `move` (the map as a move that went through would
    leave it), over the tiles both show."""
    from mcar.crafter.gen import MOVE_DELTA

    (dx, dy), (h, w) = MOVE_DELTA[move], before.shape
    r0, r1, c0, c1 = max(0, -dy), h - max(0, dy), max(0, -dx), w - max(0, dx)
    return (after[r0:r1, c0:c1] == before[r0 + dy:r1 + dy, c0 + dx:c1 + dx]).float().mean().item()


@pytest.mark.skipif(not (WORLD / "last.ckpt").exists(), reason="the shipped checkpoint is not in this checkout")
@pytest.mark.parametrize("obstacle", ["furnace", "table"])
def test_the_world_model_stops_at_what_the_player_placed(tmp_path, obstacle):
    """Greedy, from fresh Crafter starts: the player places a furnace (a table) with Crafter's own place action and
    walks into it; Crafter refuses the move and the model keeps the map where it was, not scrolled as a move through
    would. Under vq=tiles a furnace encoded as the path tile, so a model of those tokens walked through it. Starts
    are kept where scrolling would change the map (not a field of grass)."""
    from mcar.crafter.scenes import Scene

    tokens, stayed, through = world_tokens(), [], []
    for seed in range(210, 260):
        scene = Scene(seed, WORLD_SIZE, WORLD_VIEW, 1.0)
        for _ in range(30):  # into the world, away from the start's clearing
            scene.step(scene.player(scene.env))
        rec = None if scene.over else scene.place_and_bump(obstacle)
        if rec is None:
            continue
        placed, bumped, move = tokens(rec.frames[-2]), tokens(rec.frames[-1]), rec.actions[-2]
        if walked_through(placed, bumped, move) > 0.8 or (placed != bumped).float().mean() > 0.1:
            continue  # scrolling would hardly show, or a creature moved a lot
        image, _ = world_session(tmp_path, rec.frames[-2]).step(MOVE_NAMES[move])
        stayed.append((off_player(tokens(image)) == off_player(bumped)).float().mean().item())
        through.append(walked_through(placed, tokens(image), move))
        if len(stayed) == 3:
            break
    assert len(stayed) == 3, f"{len(stayed)} starts with a {obstacle} placed where scrolling shows"
    assert np.mean(stayed) > 0.9 and np.mean(through) < np.mean(stayed) - 0.1, (np.round(stayed, 3),
                                                                                  np.round(through, 3))


@pytest.mark.skipif(not (WORLD / "last.ckpt").exists(), reason="the shipped checkpoint is not in this checkout")
def test_the_world_model_remembers_what_a_wait_hid(tmp_path):
    """Step out, wait 2 noops, step back, on 12 fresh worlds (mcar worldtest, teacher-forced: the real frames before
    the last): with the start frame in its window the play default redraws the hidden column better than with 2
    frames. 12 starts, 20 s; the former default (crafter_world_all_grpo, no far-copy weight) gains +0.023 here."""
    import json

    from mcar.tools.worldtest import main
    from tests.conftest import run_in_process

    run_in_process(main, f"ckpt={WORLD}", "starts=12", "tests=[shapes]", "shapes=[wait_n1_w2]", "teacher_forced=true",
                   "policies=[explorer]", "logger=none", f"hydra.run.dir={tmp_path}")
    res = json.loads((tmp_path / "world_tests.json").read_text())
    rows = res["policies"]["explorer"]["shapes"]["wait_n1_w2"]["rows"]
    gain = [a - b for a, b in zip(rows["model context=6 teacher-forced"]["recall"]["per_start"],
                                  rows["model context=2 teacher-forced"]["recall"]["per_start"])]
    assert np.mean(gain) > 0.06 and min(gain) >= -0.25, np.round(gain, 3)


@pytest.mark.skipif(not (WORLD / "last.ckpt").exists(), reason="the shipped checkpoint is not in this checkout")
def test_plays_default_start_shows_a_collision_and_a_moving_map():
    """`mcar play` as it starts (its default prompt) on the play default: a start with landmarks, where the first
    key shows what the model keeps: → runs into the water beside the player (the map stays), ← moves the map."""
    from mcar.sampling.play_server import open_game

    session = open_game(compose("play", [f"ckpt={WORLD}", "data=crafter_tiles_all_world", "threads=1"]))
    w = WORLD_VIEW[0]
    start = session.history[-1, :WORLD_MAP_ROWS * w].clone()
    assert len(set(start.tolist())) >= 6, "the start is a bare field: a move would show nothing but the facing"
    changed = {}
    for move in ("move_right", "move_left"):
        session.reset()
        session.step(move)
        after = session.history[-1, :WORLD_MAP_ROWS * w]
        changed[move] = int(off_player((after != start).reshape(WORLD_MAP_ROWS, w)).sum())
    # the skeleton and its arrow move on their own (a tile or two); the map itself stays on the refused move
    assert changed["move_right"] <= 2 and changed["move_left"] > 10, changed
