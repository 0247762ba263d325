"""Crafter scenes for the world tests (mcar/crafter/world_tests.py): one fresh world each, played by a policy
(any of mcar.crafter.gen.POLICIES) between scripted walks, every frame recorded: loops out and back, the shapes
(back_n, wait_n_w, L_n_m), the policy's wander, which also bumps into obstacles, and obstacles placed with Crafter's
own place action and walked into. The world is read only through the simulator (mcar.crafter.gen, mcar.crafter.env).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

import numpy as np

from mcar.crafter.env import CrafterEnv
from mcar.crafter.gen import (
    ACTIONS,
    BACK,
    MOVE_DELTA,
    MOVES,
    PERPENDICULAR,
    blocked_moves,
    make_policy,
    material,
    path_offsets,
    path_open,
    place_rules,
    shape_actions,
    stock_up,
    tile_kind,
    walkable,
)


@dataclass(frozen=True)
class Shape:
    """A walk back to the start view (`shapes`): back_n<n> (n out, n back), wait_n<n>_w<w> (n out, w noops, n back),
    L_n<n>_m<m> (n one way, m at right angles, m back, n back)."""

    kind: str
    n: int
    m: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}_n{self.n}" + {"back": "", "wait": f"_w{self.m}", "L": f"_m{self.m}"}[self.kind]

    def actions(self, a: int, b: int | None = None) -> list[int]:
        """The walk's actions, first move `a` (and `b`, at right angles to it, for an L)."""
        return shape_actions(self.kind, a, self.n, self.m, b)

    @property
    def frames(self) -> int:
        """Frames of its clip: the start, one after each action."""
        return len(self.actions(MOVES[0], PERPENDICULAR[MOVES[0]][0])) + 1


SHAPE_NAME = re.compile(r"^(?:back_n(\d+)|wait_n(\d+)_w(\d+)|L_n(\d+)_m(\d+))$")


def parse_shape(spec: str) -> Shape:
    """'back_n3' | 'wait_n1_w2' | 'L_n1_m1' -> its Shape (each length >= 1)."""
    match = SHAPE_NAME.match(str(spec))
    if match is None or any(g is not None and int(g) < 1 for g in match.groups()):
        raise ValueError(f"shapes: {spec!r} is not a shape: back_n<n>, wait_n<n>_w<w> or L_n<n>_m<m>, each "
                         f"length >= 1 (e.g. [wait_n1_w2, L_n1_m1, back_n3]; conf/worldtest.yaml)")
    g = match.groups()
    if g[0] is not None:
        return Shape("back", int(g[0]))
    if g[1] is not None:
        return Shape("wait", int(g[1]), int(g[2]))
    return Shape("L", int(g[3]), int(g[4]))


def fitting_shapes(shapes: list[Shape], context: int, beyond: bool = False) -> tuple[list[Shape], dict]:
    """-> (the shapes to walk: those whose clip fits a window of `context` frames, every one when `beyond`, {name:
    why} of the others)."""
    run = [s for s in shapes if beyond or s.frames <= context]
    return run, {s.name: {"frames": s.frames, "skipped": f"{s.frames} frames > context {context}"}
                 for s in shapes if s not in run}


# ------------------------------------------------------------------------------------------------ Crafter scenes
@dataclass
class Recording:
    """What the env showed: frame t (H, W, 3) uint8 seen before action t, and the player's position then."""

    frames: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    pos: list = field(default_factory=list)
    blocker: list = field(default_factory=list)  # per move action, what its target tile held then (tile_kind)


KEPT_UP = {"health": 9, "food": 9, "drink": 9, "energy": 9}  # Crafter's maxima, refilled before each step (keep_alive)


class Scene:
    """One fresh Crafter world, stepped by the tests, each step recorded into the open recording."""

    def __init__(self, env_seed: int, size, view, daylight, keep_alive: bool = False, policy: str = "explorer"):
        self.sim = CrafterEnv(size, view, daylight)
        self.obs = self.sim.reset(env_seed)
        self.rng = np.random.default_rng(env_seed)
        self.player = make_policy(policy, self.rng)  # walks between the scripted walks (mcar.crafter.gen.POLICIES)
        self.keep_alive, self.over = keep_alive, False

    @property
    def env(self):
        """The crafter.Env being played (for the simulator's own policies and tile reads, mcar.crafter.gen)."""
        return self.sim.env

    @property
    def pos(self) -> tuple[int, int]:
        return self.sim.pos

    def step(self, action: int, rec: Recording | None = None) -> bool:
        """-> whether the episode goes on."""
        if rec is not None:
            rec.frames.append(self.obs)
            rec.actions.append(int(action))
            rec.pos.append(self.pos)
            rec.blocker.append(self.target_kind(int(action)))
        if self.keep_alive:  # a long rollout is one episode: hunger, thirst, fatigue and zombies never end it
            stock_up(self.env, KEPT_UP)
        self.obs, info = self.sim.step(int(action))
        self.over = info["done"]
        return not self.over

    def close(self, rec: Recording) -> Recording:
        """Add the frame after the last action (its own action a noop, never used)."""
        rec.frames.append(self.obs)
        rec.actions.append(0)
        rec.pos.append(self.pos)
        return rec

    def snapshot(self):
        """What the scene is now (the world, its random state, the player policy's state): restore() goes back."""
        return self.sim.save_state(), copy.deepcopy((self.rng, self.player)), self.obs, self.over

    def restore(self, snapshot) -> None:
        state, (rng, player), self.obs, self.over = snapshot
        self.sim.restore_state(state)
        self.rng, self.player = copy.deepcopy((rng, player))  # one copy: the policy keeps drawing from this rng

    def free(self, x: int, y: int) -> bool:
        return walkable(self.env, x, y)

    def target_kind(self, action: int) -> str | None:
        """What the tile a move action goes to holds now (tile_kind), None for other actions."""
        if action not in MOVE_DELTA:
            return None
        (x, y), (dx, dy) = self.pos, MOVE_DELTA[action]
        return tile_kind(self.env, x + dx, y + dy)

    def place_and_bump(self, name: str, tries: int = 20) -> Recording | None:
        """The obstacle `name` placed with Crafter's own place action and walked into, the frames recorded: the
        player is given what placing uses, steps onto a free tile in a direction whose next tile is free and one
        the rule allows (the player's steps first while there is none, up to `tries`), places it there (facing it) and
        moves into it. -> a recording whose last action is that refused move, None when no open way was found, a
        creature stepped in, the obstacle is not there after placing, the env let the player through, or the
        episode ended."""
        rule = place_rules()[name]
        place = ACTIONS.index(f"place_{name}")

        def find() -> int | None:
            x, y = self.pos
            for a in (int(v) for v in self.rng.permutation(MOVES)):
                dx, dy = MOVE_DELTA[a]
                if (self.free(x + dx, y + dy) and self.free(x + 2 * dx, y + 2 * dy)
                        and material(self.env, x + 2 * dx, y + 2 * dy) in rule["where"]):
                    return a
            return None

        for _ in range(tries):
            if self.over:
                return None
            a = find()
            if a is not None:
                break
            if not self.step(self.player(self.env)):
                return None
        else:
            return None
        stock_up(self.env, rule["uses"])
        rec, (x, y), (dx, dy) = Recording(), self.pos, MOVE_DELTA[a]
        target = (x + 2 * dx, y + 2 * dy)
        if not self.step(a, rec) or self.pos != (x + dx, y + dy) or not self.free(*target):
            return None
        if not self.step(place, rec) or tile_kind(self.env, *target) != name:
            return None
        if not self.step(a, rec) or self.pos != (x + dx, y + dy):
            return None
        return self.close(rec)

    def open_direction(self, n: int) -> int | None:
        """A move whose next n tiles are walkable and empty now, None when there is none."""
        x, y = self.pos
        for a in self.rng.permutation(list(MOVE_DELTA)):
            dx, dy = MOVE_DELTA[int(a)]
            if all(self.free(x + k * dx, y + k * dy) for k in range(1, n + 1)):
                return int(a)
        return None

    def loop(self, n: int, tries: int = 20) -> Recording | None:
        """n moves one way and n back, the frames recorded; None when no open direction was found or the env did not
        move the player exactly there and back."""
        def out_and_back():
            a = self.open_direction(n)
            return None if a is None else [a] * n + [BACK[a]] * n

        return self.walk(out_and_back, tries)

    def open_shape(self, shape: Shape) -> list[int] | None:
        """The shape's actions along a way whose every tile is walkable and empty now, None when there is none."""
        for a in (int(v) for v in self.rng.permutation(MOVES)):
            for b in [int(v) for v in self.rng.permutation(PERPENDICULAR[a])] if shape.kind == "L" else [None]:
                acts = shape.actions(a, b)
                if path_open(self.env, acts):
                    return acts
        return None

    def shape(self, shape: Shape, tries: int = 20) -> Recording | None:
        """The shape walked from where the player is (the player's steps first until a way is open), the frames
        recorded; None when no open way was found, the episode ended, or the env did not move the player exactly
        along it."""
        return self.walk(lambda: self.open_shape(shape), tries)

    def walk(self, find, tries: int) -> Recording | None:
        """The actions `find()` gives (the player's steps first while it finds none, up to `tries`), the frames
        recorded; None when it found none, the episode ended, or the env did not move the player exactly along
        them."""
        for _ in range(tries):
            acts = find()
            if acts is not None:
                break
            if not self.step(self.player(self.env)):
                return None
        else:
            return None
        rec = Recording()
        for act in acts:
            if not self.step(act, rec):
                return None
        rec = self.close(rec)
        x0, y0 = rec.pos[0]
        return rec if rec.pos == [(x0 + dx, y0 + dy) for dx, dy in path_offsets(acts)] else None

    def wander(self, steps: int, p_bump: float) -> Recording | None:
        """`steps` actions of the player (the scene's policy), moving into a blocked neighbour tile with probability
        p_bump when there is one (collisions to test); None when the episode ends first."""
        rec = Recording()
        for _ in range(steps):
            blocked = blocked_moves(self.env)
            act = int(self.rng.choice(blocked)) if blocked and self.rng.random() < p_bump else self.player(self.env)
            if not self.step(act, rec):
                return None
        return self.close(rec)


@dataclass
class StartRecord:
    loops: dict  # n -> Recording
    wander: Recording
    shapes: dict = field(default_factory=dict)  # shape name -> Recording, the shapes this start could make
    placed: dict = field(default_factory=dict)  # obstacle name -> Recording (place_and_bump), those it could place


def record_start(env_seed: int, loop_lengths, wander_steps: int, p_bump: float, warmup: int, size, view,
                 daylight, keep_alive: bool = False, shapes=(), placed=(),
                 policy: str = "explorer") -> StartRecord | None:
    """One start, played by `policy` between the scripted walks: a few of its steps into a fresh world, a loop of
    each length, its wander, then each of `shapes` and each obstacle of `placed` (placed and walked into:
    Scene.place_and_bump) from where the wander ended, each on its own (the scene restored before it);
    None when the episode ended or a loop could not be made (a shape or an obstacle that could not be made is only
    missing from .shapes / .placed)."""
    scene = Scene(env_seed, size, view, daylight, keep_alive, policy)
    for _ in range(int(scene.rng.integers(1, warmup + 1))):
        if not scene.step(scene.player(scene.env)):
            return None
    loops = {}
    for n in loop_lengths:
        rec = scene.loop(int(n))
        if rec is None:
            return None
        loops[int(n)] = rec
    wander = scene.wander(wander_steps, p_bump)
    if wander is None:
        return None
    after_wander = scene.snapshot()  # each shape and each placed obstacle from here: none depends on the others
    made, bumped = {}, {}
    for shape in shapes:
        scene.restore(after_wander)
        rec = scene.shape(shape)
        if rec is not None:
            made[shape.name] = rec
    for name in placed:
        scene.restore(after_wander)
        rec = scene.place_and_bump(str(name))
        if rec is not None:
            bumped[str(name)] = rec
    return StartRecord(loops, wander, made, bumped)
