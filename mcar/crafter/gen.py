"""Play Crafter episodes and write them as <name>.mp4 + <name>.jsonl (one record per frame), like VPT.

Frame t is what the agent saw before taking the action of record t. Rendered directly at the size asked for
(`size` = (H, W): the data's token grid times the VQ's downsampling, 224x384 for data=crafter; `crafter.Env(size=(W,
H))`). Episodes are seeded: episode i of seed s is always the same.

Episodes are kept to Crafter's first day by default (`frames <= 140`): from step ~148 the night overlays
fresh per-pixel random noise on every frame, which neither the VQ nor the world model can predict.

    mcar crafter_gen out=data/crafter/episodes episodes=24 frames=128 seed=0 size=[224,384]

(conf/crafter_gen.yaml.)
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mcar.atomic import write_atomic
from mcar.data.files import writing_into
from mcar.tokenizer.actions import CRAFTER_ACTIONS
from mcar.tokenizer.video import mp4_frame_count, write_mp4

ACTIONS = CRAFTER_ACTIONS  # crafter's own order: the action id is the token
MOVES = [1, 2, 3, 4]
MOVE_DELTA = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}  # Crafter's move action id -> (dx, dy) of the player
BACK = {1: 2, 2: 1, 3: 4, 4: 3}  # a move -> the move that undoes it
WALKABLE = ("grass", "sand", "path")  # Crafter's player walks on these
DO = 5
COLLECT = {"tree", "stone", "coal", "iron", "diamond", "water"}  # "do" on these changes the world
CRAFT = [7, 8, 9, 10, 11, 12, 14, 15]  # place / make actions worth trying (no-ops when not possible)
FPS = 20


def walkable(env, x: int, y: int) -> bool:
    """Crafter lets the player onto tile (x, y) now: inside the world, grass, sand or path, no object there."""
    if not (0 <= x < env._world.area[0] and 0 <= y < env._world.area[1]):
        return False
    material, obj = env._world[(x, y)]
    return material in WALKABLE and obj is None


def player_pos(env) -> tuple[int, int]:
    """The player's world (x, y) now."""
    return tuple(int(v) for v in env._player.pos)


def tile_kind(env, x: int, y: int) -> str:
    """What tile (x, y) holds, by Crafter's names: its object's kind when there is one (cow, zombie, skeleton,
    plant, arrow, ...), else its material (grass, sand, path, tree, water, stone, coal, iron, diamond, table,
    furnace, lava); `edge` outside the world."""
    material, obj = env._world[(x, y)]
    if obj is not None:
        return type(obj).__name__.lower()
    return "edge" if material is None else str(material)


def material(env, x: int, y: int) -> str | None:
    """Tile (x, y)'s material (None outside the world), whatever object stands on it."""
    return env._world[(x, y)][0]


def stock_up(env, amounts: dict[str, int]) -> None:
    """The player holds at least `amounts` of each item or need (Crafter's inventory, set directly)."""
    inventory = env._player.inventory
    for item, amount in amounts.items():
        inventory[item] = max(inventory[item], int(amount))


def blocked_moves(env) -> list[int]:
    """The moves Crafter would refuse now (their tile not walkable), in action-id order."""
    x, y = (int(v) for v in env._player.pos)
    return [a for a, (dx, dy) in MOVE_DELTA.items() if not walkable(env, x + dx, y + dy)]


class RandomPolicy:
    """Uniform over the 17 actions except sleep, which would darken most of the episode."""

    name = "random"

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def __call__(self, env) -> int:
        return int(self.rng.choice([a for a in range(len(ACTIONS)) if a != 6]))


PERPENDICULAR = {1: (3, 4), 2: (3, 4), 3: (1, 2), 4: (1, 2)}  # a move -> the two moves at right angles to it
NOOP = 0


def shape_actions(kind: str, a: int, n: int, m: int = 0, b: int | None = None, order=()) -> list[int]:
    """The actions of a walk that ends on the tile it started from when the env carries every move out (a recall
    shape: what it hid comes back into view). back: n moves `a`, n back; wait: n moves, m noops, n back; L: n
    moves `a`, m moves `b` (at right angles), m back, n back; revisit: n out and n back along each move of `order`
    in turn (e.g. [a, b, a]: a's far view seen twice, b's in between)."""
    if kind == "back":
        return [a] * n + [BACK[a]] * n
    if kind == "wait":
        return [a] * n + [NOOP] * m + [BACK[a]] * n
    if kind == "L":
        if b not in PERPENDICULAR[a]:
            raise ValueError(f"an L turns at right angles: move {b} after move {a}")
        return [a] * n + [b] * m + [BACK[b]] * m + [BACK[a]] * n
    if kind == "revisit":
        return [act for d in order for act in [d] * n + [BACK[d]] * n]
    raise ValueError(f"recall shape {kind!r}: one of back, wait, L, revisit")


def path_offsets(actions) -> list[tuple[int, int]]:
    """-> the player's (dx, dy) from its start before each action and after the last (len(actions) + 1), every move
    carried out (noops and other actions stay)."""
    out = [(0, 0)]
    for act in actions:
        dx, dy = MOVE_DELTA.get(int(act), (0, 0))
        out.append((out[-1][0] + dx, out[-1][1] + dy))
    return out


def path_open(env, actions) -> bool:
    """Every tile the walk steps on is walkable and empty now (the player's own tile left out)."""
    x, y = (int(v) for v in env._player.pos)
    return all(walkable(env, x + dx, y + dy) for dx, dy in set(path_offsets(actions)) - {(0, 0)})


# The recall plans' settings (data.recall / crafter_gen's recall; {} = these): the explorer starts a plan on
# p_explorer of its steps, the wanderer on p_wanderer (in place of its out-and-back loops); the plan's kind is drawn
# from `mix` (back: n out and n back, n from `lengths`; long: the same with n from `long_lengths`; wait: n out,
# w noops (w from `waits`), n back; L: n one way, m at right angles (both from `lengths`), m back, n back;
# revisit: `legs` out-and-backs of n along two moves in a varied order, one of them walked twice); a plan of more
# than max_actions actions is never drawn (null: no cap; clip_frames - 1 keeps every plan inside a training clip).
RECALL_DEFAULTS = {"p_explorer": 0.1, "p_wanderer": 0.15,
                   "mix": {"back": 0.25, "long": 0.15, "wait": 0.2, "L": 0.2, "revisit": 0.2},
                   "lengths": [1, 2], "long_lengths": [3, 4], "waits": [1, 2, 3], "legs": 3, "max_actions": None}
RECALL_KINDS = ("back", "long", "wait", "L", "revisit")


def recall_settings(recall: dict | None) -> dict | None:
    """data.recall -> the full settings (RECALL_DEFAULTS under what it names), None when it is None (today's
    policies); an unknown key, kind or a kind no plan of which fits max_actions is refused."""
    if recall is None:
        return None
    recall = dict(recall)
    unknown = sorted(set(recall) - set(RECALL_DEFAULTS))
    if unknown:
        raise ValueError(f"recall: unknown {unknown}; the settings are {sorted(RECALL_DEFAULTS)}")
    out = {**RECALL_DEFAULTS, **recall}
    out["mix"] = {str(k): float(v) for k, v in dict(out["mix"]).items()}
    bad = sorted(set(out["mix"]) - set(RECALL_KINDS))
    if bad or not out["mix"] or min(out["mix"].values()) < 0 or sum(out["mix"].values()) <= 0:
        raise ValueError(f"recall.mix={out['mix']}: non-negative weights of some of {list(RECALL_KINDS)}")
    for key in ("lengths", "long_lengths", "waits"):
        out[key] = [int(v) for v in out[key]]
        if not out[key] or min(out[key]) < 1:
            raise ValueError(f"recall.{key}={out[key]}: one or more lengths >= 1")
    out["legs"] = int(out["legs"])
    if out["legs"] < 2:
        raise ValueError(f"recall.legs={out['legs']}: a revisit walks >= 2 out-and-backs")
    for key in ("p_explorer", "p_wanderer"):
        out[key] = float(out[key])
        if not 0 <= out[key] <= 1:
            raise ValueError(f"recall.{key}={out[key]}: a probability")
    if out["max_actions"] is not None:
        out["max_actions"] = int(out["max_actions"])
        plans = RecallPlans(np.random.default_rng(0), out)
        empty = [k for k, w in out["mix"].items() if w > 0 and not plans.sizes[k]]
        if empty:
            raise ValueError(f"recall.max_actions={out['max_actions']}: no {empty} plan is that short")
    return out


# Placed obstacles (data.placing / crafter_gen's placing; {} = these): on p of its steps the wanderer places one of
# `kinds` on the tile it faces, where Crafter's place rule allows it, and then walks into it like any obstacle (the
# env refuses the move). The player is given what placing uses first (the inventory shows the same before and
# after), as the world test's placed obstacles are: the random and scripted policies seldom gather 4 stone.
PLACING_DEFAULTS = {"p": 0.03, "kinds": ["table", "furnace"]}


def place_rules() -> dict:
    """Crafter's place rules (its data.yaml `place`): name -> {uses: inventory spent, where: materials it goes on,
    type: material | object}."""
    from crafter import constants

    return {str(k): dict(v) for k, v in constants.place.items()}


def placing_settings(placing: dict | None) -> dict | None:
    """data.placing -> the full settings (PLACING_DEFAULTS under what it names), None when it is None (no placing);
    an unknown key or kind, or p outside [0, 1], is refused."""
    if placing is None:
        return None
    placing = dict(placing)
    unknown = sorted(set(placing) - set(PLACING_DEFAULTS))
    if unknown:
        raise ValueError(f"placing: unknown {unknown}; the settings are {sorted(PLACING_DEFAULTS)}")
    out = {**PLACING_DEFAULTS, **placing}
    out["p"], out["kinds"] = float(out["p"]), [str(k) for k in out["kinds"]]
    if not 0 <= out["p"] <= 1:
        raise ValueError(f"placing.p={out['p']}: a probability")
    bad = [k for k in out["kinds"] if k not in place_rules()]
    if bad or not out["kinds"]:
        raise ValueError(f"placing.kinds={out['kinds']}: some of {sorted(place_rules())}")
    return out


class RecallPlans:
    """Walks that come back to where they started, drawn from a mixture (recall_settings): out-and-back of short
    and longer lengths, back after waiting, L-shaped, and revisits in a varied order. A plan walks a way that is
    open now when there is one (the env then carries it out unless a creature steps in); else a random one."""

    def __init__(self, rng: np.random.Generator, settings: dict):
        self.rng, self.s = rng, settings
        cap = settings["max_actions"]
        lengths, legs = settings["lengths"], settings["legs"]
        sizes = {"back": [(n, 0) for n in lengths], "long": [(n, 0) for n in settings["long_lengths"]],
                 "wait": [(n, w) for n in lengths for w in settings["waits"]],
                 "L": [(n, m) for n in lengths for m in lengths], "revisit": [(n, 0) for n in lengths]}
        steps = {"back": lambda n, m: 2 * n, "long": lambda n, m: 2 * n, "wait": lambda n, m: 2 * n + m,
                 "L": lambda n, m: 2 * (n + m), "revisit": lambda n, m: 2 * n * legs}
        self.sizes = {k: [nm for nm in v if cap is None or steps[k](*nm) <= cap] for k, v in sizes.items()}
        self.kinds = [k for k, w in settings["mix"].items() if w > 0 and self.sizes[k]]
        w = np.array([settings["mix"][k] for k in self.kinds], float)
        self.p = w / w.sum()

    def draw(self, env) -> tuple[str, list[int]]:
        """-> (the plan's kind, its actions) from the player's position now."""
        kind = self.kinds[int(self.rng.choice(len(self.kinds), p=self.p))]
        sizes = self.sizes[kind]
        n, m = sizes[int(self.rng.integers(len(sizes)))]
        candidates = []
        for a in (int(v) for v in self.rng.permutation(MOVES)):
            if kind == "L":
                candidates += [shape_actions("L", a, n, m, int(b)) for b in self.rng.permutation(PERPENDICULAR[a])]
            elif kind == "revisit":  # two ways, each walked once, the other legs either of them, in any order
                for b in (int(v) for v in self.rng.permutation([d for d in MOVES if d != a])):
                    order = [a, b] + [int(self.rng.choice([a, b])) for _ in range(self.s["legs"] - 2)]
                    order = [int(d) for d in self.rng.permutation(order)]
                    candidates.append(shape_actions("revisit", a, n, order=order))
            else:
                candidates.append(shape_actions("wait" if kind == "wait" else "back", a, n, m))
        return kind, next((c for c in candidates if path_open(env, c)), candidates[0])


class ExplorerPolicy:
    """Holds a direction for several steps, collects what it faces, sometimes places or crafts things. With recall
    plans (data.recall) it also starts one on p_plan of its steps (RecallPlans: walks back to where it was)."""

    name = "explorer"

    def __init__(self, rng: np.random.Generator, hold=(3, 10), p_craft: float = 0.08, p_noop: float = 0.05,
                 plans: RecallPlans | None = None, p_plan: float = 0.0):
        self.rng, self.hold_range, self.p_craft, self.p_noop = rng, hold, p_craft, p_noop
        self.direction, self.hold, self.hits = int(rng.choice(MOVES)), 0, 0
        self.plans, self.p_plan, self.plan, self.current = plans, p_plan, [], None

    def __call__(self, env) -> int:
        if self.plan:
            return self.plan.pop(0)
        self.current = None
        player = env._player
        target = (player.pos[0] + player.facing[0], player.pos[1] + player.facing[1])
        material, obj = env._world[target]
        if (material in COLLECT or obj is not None) and self.hits < 6 and self.rng.random() < 0.8:
            self.hits += 1  # a few hits collect a tree / kill a cow; then move on
            return DO
        self.hits = 0
        if self.plans is not None and self.rng.random() < self.p_plan:
            self.current, self.plan = self.plans.draw(env)
            return self.plan.pop(0)
        r = self.rng.random()
        if r < self.p_craft:
            return int(self.rng.choice(CRAFT))
        if r < self.p_craft + self.p_noop:
            return 0
        blocked = material not in WALKABLE or obj is not None
        if self.hold <= 0 or blocked:
            self.direction = int(self.rng.choice(MOVES))
            self.hold = int(self.rng.integers(*self.hold_range))
        self.hold -= 1
        return self.direction


class WandererPolicy:
    """Moves only, for a world model that must learn collisions and memory. It walks a few steps in one direction;
    facing an obstacle (tree, water, stone, a creature: the env refuses the move, the map stays put) it pushes on with
    probability p_push before it turns; it bumps into a blocked neighbour with probability p_bump; and it walks
    out-and-back loops (n moves one way, n back: the start view comes back into sight) with probability p_loop, or,
    given recall plans (data.recall), one of those (RecallPlans: waits, L-shapes, longer ways, revisits). Given
    placing (placing_settings' output) it places obstacles and walks into them (place)."""

    name = "wanderer"

    def __init__(self, rng: np.random.Generator, p_push: float = 0.7, p_bump: float = 0.4, p_loop: float = 0.15,
                 loop_lengths=(1, 2, 3), hold=(3, 9), p_noop: float = 0.05, plans: RecallPlans | None = None,
                 placing: dict | None = None):
        self.rng, self.p_push, self.p_bump, self.p_loop = rng, p_push, p_bump, p_loop
        self.placing, self.rules = placing, place_rules() if placing else {}
        self.loop_lengths, self.hold_range, self.p_noop = tuple(loop_lengths), hold, p_noop
        self.plan: list[int] = []
        self.plans, self.current = plans, None
        self.direction, self.hold = int(rng.choice(MOVES)), 0

    def __call__(self, env) -> int:
        if self.plan:
            return self.plan.pop(0)
        self.current = None
        if self.placing and self.rng.random() < self.placing["p"]:
            action = self.place(env)
            if action is not None:
                return action
        blocked = blocked_moves(env)
        if self.direction in blocked and self.rng.random() < self.p_push:
            return self.direction
        r = self.rng.random()
        if blocked and r < self.p_bump:
            return int(self.rng.choice(blocked))
        if r < self.p_bump + self.p_loop:
            if self.plans is not None:
                self.current, self.plan = self.plans.draw(env)
                return self.plan.pop(0)
            n, d = int(self.rng.choice(self.loop_lengths)), int(self.rng.choice(MOVES))
            self.plan = [d] * (n - 1) + [BACK[d]] * n
            return d
        if r < self.p_bump + self.p_loop + self.p_noop:
            return 0
        if self.hold <= 0 or self.direction in blocked:
            free = [a for a in MOVES if a not in blocked] or MOVES
            self.direction, self.hold = int(self.rng.choice(free)), int(self.rng.integers(*self.hold_range))
        self.hold -= 1
        return self.direction


    def place(self, env) -> int | None:
        """-> the action placing one of placing's kinds on the tile the player faces, None when Crafter's rule does
        not allow it there (not free, the wrong material) or the inventory would pass Crafter's cap of 9. The player
        is given what it uses; the walk turns toward it, so the pushes that follow walk into it."""
        player = env._player
        (x, y), (dx, dy) = (int(v) for v in player.pos), (int(v) for v in player.facing)
        name = str(self.rng.choice(self.placing["kinds"]))
        rule = self.rules[name]
        if not walkable(env, x + dx, y + dy) or env._world[(x + dx, y + dy)][0] not in rule["where"]:
            return None
        if any(player.inventory[item] + amount > 9 for item, amount in rule["uses"].items()):
            return None
        for item, amount in rule["uses"].items():
            player.inventory[item] += amount
        self.direction = next(a for a, d in MOVE_DELTA.items() if d == (dx, dy))
        self.current = f"place_{name}"
        return ACTIONS.index(f"place_{name}")


class SweeperPolicy:
    """Sweeps the ground like a lawnmower: a long straight run (run tiles, or until something blocks it), one step
    to the side (always the same side while it can), then the run back the other way. Moves only: no collecting,
    no crafting, no noops."""

    name = "sweeper"

    def __init__(self, rng: np.random.Generator, run=(6, 13)):
        self.rng, self.run_range = rng, run
        self.direction = int(rng.choice(MOVES))
        self.side = int(rng.choice(PERPENDICULAR[self.direction]))
        self.left = int(rng.integers(*run))

    def __call__(self, env) -> int:
        blocked = blocked_moves(env)
        if self.left > 0 and self.direction not in blocked:
            self.left -= 1
            return self.direction
        if self.side in blocked:  # the wall is on this side: sweep toward the other
            self.side = BACK[self.side]
        self.direction, self.left = BACK[self.direction], int(self.rng.integers(*self.run_range))
        return self.side


class HesitantPolicy:
    """Stops and goes: after a move it often stands still for 1 to max_pause steps (noops), and it turns at random
    often (p_turn per move) to a free direction. Moves and noops only: the view is held still for longer than any
    other policy holds it."""

    name = "hesitant"

    def __init__(self, rng: np.random.Generator, p_pause: float = 0.5, max_pause: int = 4, p_turn: float = 0.4):
        self.rng, self.p_pause, self.max_pause, self.p_turn = rng, p_pause, max_pause, p_turn
        self.direction, self.pause = int(rng.choice(MOVES)), 0

    def __call__(self, env) -> int:
        if self.pause > 0:
            self.pause -= 1
            return NOOP
        blocked = blocked_moves(env)
        if self.direction in blocked or self.rng.random() < self.p_turn:
            free = [a for a in MOVES if a not in blocked] or MOVES
            self.direction = int(self.rng.choice(free))
        if self.rng.random() < self.p_pause:
            self.pause = int(self.rng.integers(1, self.max_pause + 1))
        return self.direction


FORAGED = ("tree", "water", "cow")  # what the forager goes for: wood, drink, food


class ForagerPolicy:
    """Goes for the nearest tree, water or cow in view (the larger gap first, around what is in the way), faces it
    and hits it a few times (`do`: wood, a drink, a cow's hits), then looks for the next; with none in view it walks
    a random straight line."""

    name = "forager"

    def __init__(self, rng: np.random.Generator, reach: int = 4, hits=(2, 6)):
        self.rng, self.reach, self.hit_range = rng, reach, hits
        self.direction, self.hits = int(rng.choice(MOVES)), 0

    def target(self, env) -> tuple[int, int] | None:
        """The nearest foraged tile within `reach` tiles of the player (Manhattan), None when there is none."""
        x, y = player_pos(env)
        near = [(abs(dx) + abs(dy), dx, dy) for dx in range(-self.reach, self.reach + 1)
                for dy in range(-self.reach, self.reach + 1)
                if (dx or dy) and 0 <= x + dx < env._world.area[0] and 0 <= y + dy < env._world.area[1]
                and tile_kind(env, x + dx, y + dy) in FORAGED]
        return min(near)[1:] if near else None

    def __call__(self, env) -> int:
        if self.hits > 0:
            self.hits -= 1
            return DO
        goal, blocked = self.target(env), blocked_moves(env)
        if goal is None:
            if self.direction in blocked or self.rng.random() < 0.15:
                self.direction = int(self.rng.choice([a for a in MOVES if a not in blocked] or MOVES))
            return self.direction
        dx, dy = goal
        if abs(dx) + abs(dy) == 1:  # next to it: turn to face it (the move is refused), then hit it
            self.hits = int(self.rng.integers(*self.hit_range))
            return next(a for a, d in MOVE_DELTA.items() if d == (dx, dy))
        toward = [a for a, (mx, my) in MOVE_DELTA.items() if mx * dx > 0 or my * dy > 0]
        toward.sort(key=lambda a: -abs(goal[0] if MOVE_DELTA[a][0] else goal[1]))
        free = [a for a in toward if a not in blocked]
        self.direction = free[0] if free else int(self.rng.choice([a for a in MOVES if a not in blocked] or MOVES))
        return self.direction


POLICIES = {"random": RandomPolicy, "explorer": ExplorerPolicy, "wanderer": WandererPolicy,
            "sweeper": SweeperPolicy, "hesitant": HesitantPolicy, "forager": ForagerPolicy}
TEST_PLAYERS = ("sweeper", "hesitant", "forager")  # players no shipped model's data or post-training used


def make_policy(name: str, rng: np.random.Generator, recall: dict | None = None, placing: dict | None = None):
    """The policy `name`; recall (recall_settings' output, None: today's policies) gives the explorer and the
    wanderer recall plans; placing (placing_settings' output) makes the wanderer place obstacles (the other
    policies take neither)."""
    if name not in POLICIES:
        raise ValueError(f"policy {name!r}: one of {sorted(POLICIES)}")
    if name not in ("explorer", "wanderer"):
        return POLICIES[name](rng)
    plans = None if recall is None else RecallPlans(rng, recall)
    if name == "explorer":
        return ExplorerPolicy(rng) if plans is None else ExplorerPolicy(rng, plans=plans, p_plan=recall["p_explorer"])
    if plans is None:
        return WandererPolicy(rng, placing=placing)
    return WandererPolicy(rng, p_loop=recall["p_wanderer"], plans=plans, placing=placing)


def episode_name(seed: int, index: int) -> str:
    return f"crafter_s{seed}_e{index:05d}"


class InsertionOrderedSet:
    """The set operations Crafter's world uses on a chunk's objects (add, remove, iterate), iterated in insertion
    order. Crafter keeps them in a plain set, iterated in the order of the objects' memory addresses, and its
    despawning picks `creatures[random.randint(len)]` from that order: the same seed gave other frames in another
    process (another heap layout)."""

    def __init__(self, items=()):
        self._items = dict.fromkeys(items)

    def add(self, obj) -> None:
        self._items[obj] = None

    def remove(self, obj) -> None:
        del self._items[obj]

    def discard(self, obj) -> None:
        self._items.pop(obj, None)

    def __iter__(self):
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, obj) -> bool:
        return obj in self._items

    def copy(self) -> "InsertionOrderedSet":
        return InsertionOrderedSet(self._items)


def deterministic_chunks(world) -> None:
    """Rebuild a freshly reset Crafter world's chunk -> objects map with insertion-ordered sets, the objects in the
    world's own (creation) order."""
    import collections

    chunks = collections.defaultdict(InsertionOrderedSet)
    for obj in world._objects:
        if obj is not None:
            chunks[world.chunk_key(obj.pos)].add(obj)
    world._chunks = chunks


def make_env(env_seed: int, size: tuple[int, int], view: tuple[int, int] | None = None,
             daylight: float | None = None):
    """-> (a reset Crafter env drawing (H, W) = size frames, its first observation); view and daylight as in
    `play_episode`. The same env_seed gives the same world in every process."""
    import crafter  # imported here: worker processes

    env = crafter.Env(size=(int(size[1]), int(size[0])), view=tuple(int(v) for v in (view or (9, 9))), seed=env_seed)
    pin_daylight(env, daylight)
    obs = env.reset()
    deterministic_chunks(env._world)
    return env, obs


def pin_daylight(env, daylight: float | None) -> None:
    """Crafter sets world.daylight from the step count in _update_time; a fixed `daylight` pins it instead (None:
    the day-night cycle). Set again on a copied env: the pin names the env it was set on."""
    if daylight is not None:
        env._update_time = lambda: setattr(env._world, "daylight", float(daylight))


def map_rows(view) -> int:
    """Crafter's map rows in a view of (W, H) tiles: H less the inventory's rows (crafter.Env's item_rows)."""
    from crafter import constants

    return int(view[1]) - -(-len(constants.items) // int(view[0]))


def episode_start(seed: int, index: int, policy_mix: dict[str, float], recall: dict | None = None,
                  placing: dict | None = None):
    """-> (the policy playing episode `index` of generator seed `seed`, its Crafter world seed): the one place both
    are drawn (play_episode plays them; training_world_seeds lists the seeds)."""
    rng = np.random.default_rng([seed, index])
    names = sorted(policy_mix)
    p = np.array([policy_mix[n] for n in names], float)
    policy = make_policy(names[rng.choice(len(names), p=p / p.sum())], rng, recall_settings(recall),
                         placing_settings(placing))
    return policy, int(rng.integers(2**31 - 1))


def training_world_seeds(seed: int, episodes: int) -> set[int]:
    """Every Crafter world seed an episode 0..episodes-1 of generator seed `seed` can be played in, whatever the
    policy mix, recall plans or placing (each policy draws from the episode's generator before the world seed: one
    seed per policy and episode): what a test's fresh worlds must never be."""
    return {episode_start(seed, i, {name: 1.0})[1] for i in range(int(episodes)) for name in POLICIES}


def play_episode(seed: int, index: int, frames: int, policy_mix: dict[str, float], size: tuple[int, int],
                 view: tuple[int, int] | None = None, daylight: float | None = None, recall: dict | None = None,
                 placing: dict | None = None):
    """-> (frames (T, H, W, 3) uint8 for size = (H, W), records). T < frames when the player dies. view: Crafter's
    grid in tiles (W, H), None for its default 9x9 (one tile is then size / view pixels). daylight: None for
    Crafter's day-night cycle, or a fixed light level (1.0: always noon; every frame then draws a tile with the
    same pixels, which a patch VQ turns into the same token). recall: the explorer's and the wanderer's recall
    plans (RECALL_DEFAULTS' keys; {}: those; None: none, today's episodes): a record made by a plan names its kind
    ("plan"). placing: the wanderer's placed obstacles (PLACING_DEFAULTS' keys; None: none); a place action it
    made names its kind ("plan": "place_furnace")."""
    policy, world_seed = episode_start(seed, index, policy_mix, recall, placing)
    env, obs = make_env(world_seed, size, view, daylight)
    out, records = [], []
    for t in range(frames):
        action = policy(env)
        out.append(obs)
        next_obs, reward, done, info = env.step(action)
        records.append({"frame": t, "action": ACTIONS[action], "action_id": action, "reward": float(reward),
                        "policy": policy.name, "pos": [int(v) for v in info["player_pos"]],
                        "daylight": round(float(env._world.daylight), 4)})
        if getattr(policy, "current", None) is not None:
            records[-1]["plan"] = policy.current
        obs = next_obs
        if done:
            break
    return np.stack(out), records


def write_episode(out_dir: Path, seed: int, index: int, frames: int, policy_mix: dict[str, float],
                  size: tuple[int, int], view: tuple[int, int] | None = None, daylight: float | None = None,
                  lossless: bool = False, recall: dict | None = None, placing: dict | None = None) -> str:
    name = episode_name(seed, index)
    mp4, jsonl = out_dir / f"{name}.mp4", out_dir / f"{name}.jsonl"
    if episode_complete(mp4, jsonl):
        return name  # cached
    video, records = play_episode(seed, index, frames, policy_mix, size, view, daylight, recall, placing)
    if lossless:  # bit-exact RGB: a tile drawn twice gives the same pixels, so a patch VQ gives the same token
        write_mp4(video, mp4, fps=FPS, crf=0, pix_fmt="rgb24", preset="veryfast", codec="libx264rgb")
    else:
        write_mp4(video, mp4, fps=FPS, crf=12, pix_fmt="yuv444p", preset="veryfast")  # near-lossless pixel art
    write_atomic(jsonl, "".join(json.dumps(r) + "\n" for r in records))  # last: both present == complete
    return name


def episode_complete(mp4: Path, jsonl: Path) -> bool:
    """Both files there and the mp4 holds one frame per record (a cut-off or empty mp4 is made again)."""
    if not (mp4.exists() and jsonl.exists()):
        return False
    with open(jsonl, "rb") as f:
        records = sum(1 for line in f if line.strip())
    return records > 0 and mp4_frame_count(mp4) == records


def die_with_parent(parent: int) -> None:
    """Worker initializer: a worker must not outlive a parent killed with kill -9 (it would finish its queue and
    then sit idle). Linux: the kernel sends SIGKILL when the parent dies (PR_SET_PDEATHSIG); elsewhere a thread
    polls the parent's pid."""
    import signal
    import threading

    try:
        import ctypes

        if ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):
        def watch():
            while os.getppid() == parent:
                time.sleep(1)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(1)


def generate(out_dir: str | Path, episodes: int, frames: int, seed: int = 0,
             policy_mix: dict[str, float] | None = None, workers: int = 1, *, size: tuple[int, int],
             view: tuple[int, int] | None = None, daylight: float | None = None, lossless: bool = False,
             recall: dict | None = None, placing: dict | None = None) -> list[str]:
    """Write `episodes` episodes of (H, W) = `size` frames into out_dir (finished ones are skipped). -> their names.
    view: Crafter's grid in tiles (W, H); None: its default 9x9. daylight: a fixed light level, None: Crafter's
    day-night cycle. lossless: bit-exact RGB video (libx264rgb, crf 0) instead of near-lossless yuv444p. recall:
    the policies' recall plans, placing: the wanderer's placed obstacles (play_episode; None: none)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    policy_mix = dict(policy_mix or {"random": 0.25, "explorer": 0.75})
    if frames < 1 or episodes < 1:
        raise ValueError(f"crafter generation needs episodes >= 1 and frames >= 1, got {episodes}, {frames}")
    recall = None if recall is None else dict(recall)
    placing = None if placing is None else dict(placing)
    recall_settings(recall), placing_settings(placing)  # a bad setting fails here, not in a worker
    with writing_into(out_dir, "Crafter episodes"):  # one generator per folder; a second waits, then skips
        return _generate(out_dir, episodes, frames, seed, policy_mix, workers, size, view, daylight, lossless,
                         recall, placing)


def _generate(out_dir, episodes, frames, seed, policy_mix, workers, size, view, daylight, lossless,
              recall=None, placing=None) -> list[str]:
    names = [episode_name(seed, i) for i in range(episodes)]
    todo = [i for i, n in enumerate(names) if not episode_complete(out_dir / f"{n}.mp4", out_dir / f"{n}.jsonl")]
    if not todo:  # all cached: no progress bar to flash
        return names
    bar = tqdm(total=len(todo), desc=f"crafter episodes -> {out_dir}", unit="ep")
    args = (frames, policy_mix, size, view, daylight, lossless, recall, placing)
    if workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(min(workers, len(todo)), initializer=die_with_parent,
                                 initargs=(os.getpid(),)) as pool:
            for f in [pool.submit(write_episode, out_dir, seed, i, *args) for i in todo]:
                f.result()
                bar.update()
    else:
        for i in todo:
            write_episode(out_dir, seed, i, *args)
            bar.update()
    bar.close()
    return names
