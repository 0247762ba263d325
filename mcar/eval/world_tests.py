"""World tests on the tile-exact Crafter setting (data=crafter_tiles: one tile per token, a move is an exact
one-token shift of the map): memory, collisions and long rollouts, from starts on fresh Crafter seeds.

    mcar worldtest ckpt=checkpoints/shipped/crafter_tiles_diagd starts=32

Every start is a fresh Crafter world (seed `seed_base + i`, never a training episode's), played in-process by a
scripted policy and tokenised by the data's patch VQ. Four tests, each per start, with a 95% bootstrap interval
over starts (mcar.eval.metrics.bootstrap_ci):

- loop: n moves one way and n back (a direction whose n tiles are walkable; a loop the env did not carry out
  exactly, e.g. a cow stepped in, is dropped), generated from the start frame alone. `recall`: the share of
  re-revealed map tiles (in view at the start, out of view at the far end, in view again at the end) equal to the
  start view's; `loop_acc`: every generated frame's map tokens against the real ones. Rows: the model on its
  context (`context`, default the checkpoint's clip_frames), the model on the smallest window the rolling sampler
  allows (2 frames: the frame being made and the one before), copy_last ("nothing moves", whose end frame is the
  start view: recall 1 by construction, so read it with loop_acc) and real (the env's own frames: the ceiling).
  Each row also scores the inventory rows (the view's bottom rows, below the map: `inventory`, every frame) apart
  from the map, and `invented`: the share of a generated frame's tiles whose code is in neither the real frame nor
  the prompt frame(s) (tile types made up, not misplaced; copy_last and real score 0 by construction).
- shapes: other walks back to the start view, the same rows and scores (`shapes`, e.g. [wait_n1_w2, L_n1_m1,
  back_n3]): back_n<n> n out and n back (a longer loop); wait_n<n>_w<w> n out, w noops, n back (the view held
  still while memory must last); L_n<n>_m<m> n one way, m at right angles, m back, n back. `recall` counts the
  tiles the walk hid at any point (in view at the start, out of view on the way, in view at the end);
  `recall_far` only those out of view in both frames before the last, which no copy from two frames back (what
  the training's out-and-back loops teach) can restore: an L's first-leg tiles, not its second leg's. A shape is
  only a test of memory when the start frame is still in the model's window at the end: one of more frames than
  the model's context is skipped and said so (`shapes_beyond_context=true` runs it, marked, as a control).
  `teacher_forced=true` adds rows whose last frame is the model's greedy guess from the real frames before it on
  each window: memory with no sampled frame in the way, paired against the teacher-forced 2-frame window. Each
  is walked after the wander from where it ended, along a way open then; a start where the env did not carry it
  out exactly (a creature stepped in) or found no open way is counted out of that shape only ("made").
- blocked: a move the env refused (player position unchanged) and a free move, each predicted from two real
  frames: `stayed` is the share of refused moves whose generated map is nearer the previous map than the previous
  map shifted one tile (the map the move would have shown), `moved` the share of free moves where it is the other
  way round (a model that never moves scores stayed 1, moved 0). The player's own tile (its sprite turns) is left
  out. The refused moves are also split by what refused them (`by_type`: the target tile's object, e.g. cow,
  zombie, plant, else its material, e.g. tree, water, stone, table; `edge` outside the world), each type's share
  with a 95% bootstrap interval over starts (starts drawn with replacement, their moves pooled). Placed obstacles
  (`placed`, default [table, furnace]): after the other walks each world's player is given what Crafter's place
  rule uses (inventory counts set directly), steps onto a free tile facing another, places the obstacle with
  Crafter's own place action (drawn as Crafter draws it; checked in env._world), then walks into it: the refused
  move is scored like the others, on the frames before and after the placing, as `<type> (placed)`; a world where
  it could not be placed (no open way, a creature stepped in, the episode ended) is counted out of that type only.
- rollout: `rollout_frames` frames from one real frame and the real actions: image-token agreement with the real
  frames per step (a curve), for the model on its context, the 2-frame window, copy_last and scroll_start (the start
  frame scrolled by the player's true movement: what greedy sampling must beat); and whether the frames
  stay plausible where they no longer agree: `tv`, the total-variation distance between the generated frame's
  histogram of tile codes and the real frame's (0: the same mix of tiles, 1: none in common); the agreement of the
  map and of the inventory rows apart; and `invented` (as for the loops) per step. `creatures`: whether creatures
  come and go as in the game: per frame, the creatures drawn, those that entered or left at the view's edge and
  those that popped up or vanished inside it, for each row and the real frames, and each row minus the real
  frames, paired by start (a creature is a tile whose code only the game's creature textures have, creature_codes).
`tests` picks which run (a long horizon: `tests=[rollout] rollout_frames=512 keep_alive=true`: the player's needs
are refilled before each step, so no start dies before its rollout ends); `windows` the model rows' windows.

Writes world_tests.{json,md}, rollout_agreement.csv and videos/loop_n<n>.{mp4,gif}, videos/shape_<name>.{mp4,gif}
(real | generated) under the output dir, and the same to W&B when logger is wandb (offline by default).
"""
from __future__ import annotations

import csv
import itertools
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from mcar.atomic import write_atomic, written_atomically
from mcar.core.agreement import frame_agreement, histogram_distance, nothing_moves
from mcar.core.devices import set_threads
from mcar.core.layout import Layout
from mcar.data.crafter_gen import (
    ACTIONS,
    BACK,
    MOVE_DELTA,
    MOVES,
    PERPENDICULAR,
    ExplorerPolicy,
    blocked_moves,
    make_env,
    map_rows,
    path_offsets,
    path_open,
    place_rules,
    shape_actions,
    walkable,
)
from mcar.data.crafter_textures import creature_codes, tile_textures
from mcar.eval.metrics import bootstrap_ci
from mcar.sampling.world_model import WorldModel
from mcar.tokenizer.clips import join_clip
from mcar.tokenizer.pictures import comparison_frames, data_action_space, write_video
from mcar.tokenizer.vq_model import encode_tokens, frame_size
from mcar.wandb_run import log_media, log_table, open_run

log = logging.getLogger("mcar.eval.world_tests")
TESTS = ("loop", "shapes", "blocked", "rollout")



# ------------------------------------------------------------------------------------------------ token geometry
@dataclass(frozen=True)
class MapGrid:
    """Where the map is in a frame's token grid: rows [0, map_h) (the inventory rows below), the player drawn at
    (player_row, player_col) (Crafter's view centre: grid // 2)."""

    map_h: int
    w: int

    @property
    def player(self) -> tuple[int, int]:
        return self.map_h // 2, self.w // 2

    def maps(self, images: torch.Tensor) -> torch.Tensor:
        """(..., h, w) image tokens -> (..., map_h, w) map tokens."""
        return images[..., :self.map_h, :]

    def inventory(self, images: torch.Tensor) -> torch.Tensor:
        """(..., h, w) image tokens -> (..., h - map_h, w) the inventory rows below the map."""
        return images[..., self.map_h:, :]


def rerevealed_mask(grid: MapGrid, dx: int, dy: int) -> torch.Tensor:
    """(map_h, w) bool: the start view's tiles that are out of view once the view has moved by (dx, dy) tiles."""
    r, c = torch.meshgrid(torch.arange(grid.map_h), torch.arange(grid.w), indexing="ij")
    r, c = r - dy, c - dx  # where each start tile sits in the moved view
    return (r < 0) | (r >= grid.map_h) | (c < 0) | (c >= grid.w)


def hidden_mask(grid: MapGrid, offsets) -> torch.Tensor:
    """(map_h, w) bool: the start view's tiles out of view at any of the view's (dx, dy) offsets (a walk's)."""
    out = torch.zeros(grid.map_h, grid.w, dtype=torch.bool)
    for dx, dy in offsets:
        out |= rerevealed_mask(grid, int(dx), int(dy))
    return out


def far_mask(grid: MapGrid, offsets) -> torch.Tensor:
    """(map_h, w) bool: the start view's tiles out of view in both frames before a walk's last (its (dx, dy)
    offsets): no copy from two frames back, the memory an out-and-back loop teaches, brings them back."""
    offsets = [(int(dx), int(dy)) for dx, dy in offsets]
    if len(offsets) < 3:
        return torch.zeros(grid.map_h, grid.w, dtype=torch.bool)
    return rerevealed_mask(grid, *offsets[-2]) & rerevealed_mask(grid, *offsets[-3])


def masked_recall(end_maps: torch.Tensor, start_maps: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """end_maps, start_maps (B, map_h, w), masks (B, map_h, w) bool -> (B,) share of the masked tiles where the end
    frame equals the start frame (NaN where a mask is empty)."""
    same = (end_maps == start_maps) & masks
    return same.flatten(1).sum(1).double() / masks.flatten(1).sum(1).double()


def loop_recall(end_maps: torch.Tensor, start_maps: torch.Tensor, grid: MapGrid, far: torch.Tensor) -> torch.Tensor:
    """end_maps, start_maps (B, map_h, w), far (B, 2) the view's (dx, dy) at the loop's far end -> (B,) share of the
    re-revealed tiles where the end frame equals the start frame."""
    masks = torch.stack([rerevealed_mask(grid, dx, dy) for dx, dy in far.tolist()])
    return masked_recall(end_maps, start_maps, masks)


def invented_share(frames: torch.Tensor, real: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """frames, real (B, T, h, w) generated and real image codes, prompt (B, P, h, w) the prompt frames -> (B, T)
    share of each generated frame's tiles whose code is in neither the real frame at that step nor any prompt
    frame: tile types the model made up (0 for a frame that only rearranges what it was shown or what is there)."""
    B, T = frames.shape[:2]
    size = int(max(frames.max(), real.max(), prompt.max())) + 1
    seen = torch.zeros(B, T, size, dtype=torch.bool)
    seen.scatter_(2, real.flatten(2), True)
    shown = torch.zeros(B, size, dtype=torch.bool)
    shown.scatter_(1, prompt.flatten(1), True)
    seen |= shown[:, None]
    return (~seen.gather(2, frames.flatten(2))).double().mean(-1)


CREATURE_EVENTS = ("creatures", "entered", "left", "popped")


def creature_events(maps: torch.Tensor, codes: torch.Tensor, moves: torch.Tensor) -> dict[str, torch.Tensor]:
    """maps (B, T, h, w) map codes, codes the creatures' (creature_codes), moves (B, T-1, 2) the player's true
    (dx, dy) from each frame to the next -> {name: (B,)} per frame over frames 1..T-1: `creatures` (creature
    tiles), `entered` (new creatures on the view's edge: no creature of the frame before, scrolled by the move,
    within one tile: a creature steps one tile a turn), `left` (creatures of the frame before, scrolled, off the
    view or on its edge with no creature within one tile now), `popped` (creatures that appeared or vanished
    inside the view: the game only does that when one is killed or spawns). Matching is by distance, not identity:
    two creatures passing are not told apart."""
    B, T, h, w = maps.shape
    is_c = torch.isin(maps, codes).float()
    inside = torch.zeros(h + 2, w + 2, dtype=torch.bool)  # the view padded by a ring of just-out-of-view tiles
    inside[2:h, 2:w] = True  # the view less its edge
    out = {k: torch.zeros(B, dtype=torch.float64) for k in CREATURE_EVENTS}
    near = lambda x: torch.nn.functional.max_pool2d(x[None, None], 3, 1, 1)[0, 0] > 0
    for b in range(B):
        for t in range(1, T):
            dx, dy = (int(v) for v in moves[b, t - 1])
            prev = torch.zeros(h + 2 + 2 * abs(dy), w + 2 + 2 * abs(dx))
            cur = torch.zeros(h + 2, w + 2)
            cur[1:h + 1, 1:w + 1] = is_c[b, t]
            # the frame before as seen from the new view: a creature at (r, c) sits at (r - dy, c - dx)
            r0, c0 = 1 + abs(dy) - dy, 1 + abs(dx) - dx
            prev[r0:r0 + h, c0:c0 + w] = is_c[b, t - 1]
            prev = prev[abs(dy):abs(dy) + h + 2, abs(dx):abs(dx) + w + 2]
            new = (cur > 0) & ~near(prev)
            gone = (prev > 0) & ~near(cur)
            out["creatures"][b] += float(is_c[b, t].sum())
            out["entered"][b] += float((new & ~inside).sum())
            out["left"][b] += float((gone & ~inside).sum())
            out["popped"][b] += float((new & inside).sum() + (gone & inside).sum())
    return {k: v / max(T - 1, 1) for k, v in out.items()}


def shifted(maps: torch.Tensor, dx: int, dy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., H, W) map tokens -> (the map the view shows after moving (dx, dy) tiles, (H, W) bool where it is known:
    the tiles that were in view before)."""
    H, W = maps.shape[-2:]
    out, known = torch.zeros_like(maps), torch.zeros(H, W, dtype=torch.bool)
    r0, r1, c0, c1 = max(0, -dy), min(H, H - dy), max(0, -dx), min(W, W - dx)
    if r0 >= r1 or c0 >= c1:  # moved a whole view away: nothing known (a negative slice bound would wrap round)
        return out, known
    out[..., r0:r1, c0:c1] = maps[..., r0 + dy:r1 + dy, c0 + dx:c1 + dx]
    known[r0:r1, c0:c1] = True
    return out, known


def scroll_start(clips: torch.Tensor, positions: list[list], grid: MapGrid, layout: Layout, prompt: int
                 ) -> torch.Tensor:
    """(B, N) clips and each one's player positions per frame -> a copy whose frames >= prompt show the last prompt
    frame's map scrolled by the player's true movement since: the floor a greedy model must beat ("scroll the start
    frame by the true movement"). Tiles that come into view keep what the start frame showed there; the player's
    tile and the inventory rows stay the start frame's; every action stays the clip's own."""
    out = clips.clone()
    images = out.view(out.shape[0], -1, layout.frame_len)[..., :layout.frame_tokens].unflatten(-1, (layout.h,
                                                                                                     layout.w))
    start = images[:, prompt - 1].clone()
    pr, pc = grid.player
    for b, pos in enumerate(positions):
        for t in range(prompt, images.shape[1]):
            moved, known = shifted(grid.maps(start[b]), pos[t][0] - pos[prompt - 1][0],
                                   pos[t][1] - pos[prompt - 1][1])
            known[pr, pc] = False
            frame = start[b].clone()
            frame[:grid.map_h][known] = moved[known]
            images[b, t] = frame
    return out


def stay_or_move(prev: torch.Tensor, nxt: torch.Tensor, moves: torch.Tensor, grid: MapGrid
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """prev, nxt (B, map_h, w) maps before and after a move action, moves (B,) its action ids -> (agreement of nxt
    with prev, agreement with prev shifted one tile the move's way), each (B,), over the tiles both know, the
    player's tile left out."""
    stay, move = [], []
    pr, pc = grid.player
    for p, n, a in zip(prev, nxt, moves.tolist()):
        s, known = shifted(p, *MOVE_DELTA[a])
        known = known.clone()
        known[pr, pc] = False
        stay.append((n[known] == p[known]).double().mean())
        move.append((n[known] == s[known]).double().mean())
    return torch.stack(stay), torch.stack(move)


def interval(per_start: torch.Tensor, seed: int) -> dict:
    """per-start values -> {mean, lo, hi, n, per_start}: the mean and its 95% bootstrap interval over starts, and the
    values (the same seed_base gives every model the same starts: two runs compare paired, start by start)."""
    v = per_start.double()
    lo, hi = bootstrap_ci(v, lambda x: x.mean(-1), seed)
    return {"mean": float(v.mean()), "lo": lo, "hi": hi, "n": len(v), "per_start": [round(float(x), 6) for x in v]}


def pooled_interval(values: torch.Tensor, starts, seed: int) -> dict:
    """per-move values and the start each came from -> {mean: over the moves, lo, hi: its 95% bootstrap interval
    over starts (starts drawn with replacement, their moves pooled: moves of one start are not independent draws;
    None with fewer than 2 starts), n: moves, starts}."""
    v = values.double()
    _, which = torch.unique(torch.as_tensor(starts), return_inverse=True)
    k = int(which.max()) + 1
    per = torch.stack([torch.zeros(k, dtype=torch.float64).index_add_(0, which, v),
                       torch.bincount(which, minlength=k).double()], 1)  # (starts, [sum, moves])
    lo = hi = None
    if k >= 2:
        lo, hi = bootstrap_ci(per, lambda x: x[..., 0].sum(-1) / x[..., 1].sum(-1), seed)
    return {"mean": float(v.mean()), "lo": lo, "hi": hi, "n": len(v), "starts": k}


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


def tile_kind(env, x: int, y: int) -> str:
    """What tile (x, y) holds, by Crafter's names: its object's kind when there is one (cow, zombie, skeleton,
    plant, arrow, ...), else its material (grass, sand, path, tree, water, stone, coal, iron, diamond, table,
    furnace, lava); `edge` outside the world."""
    material, obj = env._world[(x, y)]
    if obj is not None:
        return type(obj).__name__.lower()
    return "edge" if material is None else str(material)


KEPT_UP = {"health": 9, "food": 9, "drink": 9, "energy": 9}  # Crafter's maxima, refilled before each step (keep_alive)


class Scene:
    """One fresh Crafter world, stepped by the tests, each step recorded into the open recording."""

    def __init__(self, env_seed: int, size, view, daylight, keep_alive: bool = False):
        self.env, self.obs = make_env(env_seed, size, view, daylight)
        self.rng = np.random.default_rng(env_seed)
        self.explorer = ExplorerPolicy(self.rng)
        self.keep_alive, self.over = keep_alive, False

    @property
    def pos(self) -> tuple[int, int]:
        return tuple(int(v) for v in self.env._player.pos)

    def step(self, action: int, rec: Recording | None = None) -> bool:
        """-> whether the episode goes on."""
        if rec is not None:
            rec.frames.append(self.obs)
            rec.actions.append(int(action))
            rec.pos.append(self.pos)
            rec.blocker.append(self.target_kind(int(action)))
        if self.keep_alive:  # a long rollout is one episode: hunger, thirst, fatigue and zombies never end it
            for need in KEPT_UP:
                self.env._player.inventory[need] = KEPT_UP[need]
        self.obs, _, done, _ = self.env.step(int(action))
        self.over = bool(done)
        return not done

    def close(self, rec: Recording) -> Recording:
        """Add the frame after the last action (its own action a noop, never used)."""
        rec.frames.append(self.obs)
        rec.actions.append(0)
        rec.pos.append(self.pos)
        return rec

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
        the rule allows (explorer steps first while there is none, up to `tries`), places it there (facing it) and
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
                        and self.env._world[(x + 2 * dx, y + 2 * dy)][0] in rule["where"]):
                    return a
            return None

        for _ in range(tries):
            if self.over:
                return None
            a = find()
            if a is not None:
                break
            if not self.step(self.explorer(self.env)):
                return None
        else:
            return None
        inventory = self.env._player.inventory
        for item, amount in rule["uses"].items():
            inventory[item] = max(inventory[item], int(amount))
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
        """The shape walked from where the player is (explorer steps first until a way is open), the frames recorded;
        None when no open way was found, the episode ended, or the env did not move the player exactly along it."""
        return self.walk(lambda: self.open_shape(shape), tries)

    def walk(self, find, tries: int) -> Recording | None:
        """The actions `find()` gives (explorer steps first while it finds none, up to `tries`), the frames recorded;
        None when it found none, the episode ended, or the env did not move the player exactly along them."""
        for _ in range(tries):
            acts = find()
            if acts is not None:
                break
            if not self.step(self.explorer(self.env)):
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
        """`steps` actions of the explorer policy, moving into a blocked neighbour tile with probability p_bump when
        there is one (collisions to test); None when the episode ends first."""
        rec = Recording()
        for _ in range(steps):
            blocked = blocked_moves(self.env)
            act = int(self.rng.choice(blocked)) if blocked and self.rng.random() < p_bump else self.explorer(self.env)
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
                 daylight, keep_alive: bool = False, shapes=(), placed=()) -> StartRecord | None:
    """One start: a few explorer steps into a fresh world, a loop of each length, a wander, then each of `shapes`
    from where the wander ended, then each obstacle of `placed` placed and walked into (Scene.place_and_bump);
    None when the episode ended or a loop could not be made (a shape or an obstacle that could not be made is only
    missing from .shapes / .placed)."""
    scene = Scene(env_seed, size, view, daylight, keep_alive)
    for _ in range(int(scene.rng.integers(1, warmup + 1))):
        if not scene.step(scene.explorer(scene.env)):
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
    made = {}
    for shape in shapes:
        if scene.over:
            break
        rec = scene.shape(shape)
        if rec is not None:
            made[shape.name] = rec
    bumped = {}
    for name in placed:
        rec = None if scene.over else scene.place_and_bump(str(name))
        if rec is not None:
            bumped[str(name)] = rec
    return StartRecord(loops, wander, made, bumped)


# ------------------------------------------------------------------------------------------------ the run
class Tokens:
    """Frames -> clips with the data's VQ (its patch VQ maps every tile to its token)."""

    def __init__(self, vq, layout: Layout, codebook_size: int, batch: int = 64):
        self.vq, self.layout, self.cb, self.batch = vq, layout, codebook_size, batch

    def images(self, frames) -> torch.Tensor:
        x = torch.from_numpy(np.stack(frames))
        return torch.cat([encode_tokens(self.vq, b.to(self.vq.device)).cpu() for b in x.split(self.batch)])

    def clip(self, rec: Recording) -> torch.Tensor:
        return join_clip(self.images(rec.frames), torch.tensor(rec.actions)[:, None], self.cb)


def images_of(clips: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(B, N) clips -> (B, T, h, w) image tokens."""
    x = clips.view(clips.shape[0], -1, layout.frame_len)[..., :layout.frame_tokens]
    return x.reshape(*x.shape[:2], layout.h, layout.w)


class WorldTests:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.wm = WorldModel.load(cfg)
        self.layout, self.cb, self.vq = self.wm.layout, self.wm.codebook_size, self.wm.vq
        view = cfg.data.get("view")
        if view is None or list(view) != [self.layout.w, self.layout.h]:
            raise ValueError(f"data.view={None if view is None else list(view)}: the world tests need the tile-exact "
                             f"setting (data=crafter_tiles: view [{self.layout.w}, {self.layout.h}], one tile per "
                             f"token)")
        self.size = frame_size(self.vq, self.layout.h, self.layout.w)
        self.view, self.daylight = tuple(int(v) for v in view), cfg.data.get("daylight")
        self.grid = MapGrid(map_rows(self.view), self.layout.w)
        self.tokens = Tokens(self.vq, self.layout, self.cb)
        if "rollout" in cfg.tests:  # the creatures' codes, from the game's textures at the data's tile size
            self.creature_codes, self.creatures_hidden = creature_codes(self.vq, tile_textures(self.size[0] //
                                                                                               self.layout.h))
        self.context = self.wm.context
        # the model rows' windows: its own, and the smallest a rolling window allows (the frame being made and one
        # before, mcar.core.rolling)
        self.windows = [int(w) for w in cfg.windows] if cfg.get("windows") else [self.context, 2]
        self.prompt = int(OmegaConf.select(cfg, "schedule.prompt_frames", default=1) or 1)
        # the shapes to walk: those whose clip fits the model's window (the start frame still seen at the end)
        shapes = [parse_shape(s) for s in cfg.get("shapes") or []] if "shapes" in cfg.tests else []
        self.shapes, self.skipped = fitting_shapes(shapes, self.context, bool(cfg.get("shapes_beyond_context")))
        # the obstacles placed and walked into, scored with the refused moves
        self.placed = [str(n) for n in cfg.get("placed") or []] if "blocked" in cfg.tests else []

    def generate(self, clips: torch.Tensor, context: int | None = None,
                 prompt_frames: int | None = None) -> torch.Tensor:
        """clips generated from their first prompt_frames frames (None: the schedule's) on a window of `context`
        frames (None: the model's)."""
        frames = clips.shape[1] // self.layout.frame_len
        schedule = None if prompt_frames is None else {"prompt_frames": prompt_frames}
        sampler = self.wm.sampler(frames, context=context, schedule=schedule)
        return self.wm.generate(clips, sampler, int(self.cfg.batch_size))[0]

    @torch.no_grad()
    def teacher_forced(self, clips: torch.Tensor, context: int) -> torch.Tensor:
        """clips with the last frame's image tokens the model's greedy guess from the real frames before it, on a
        window of `context` frames (one causal pass): what its memory holds, with no sampled frame in the way."""
        fl, ft = self.layout.frame_len, self.layout.frame_tokens
        frames = clips.shape[1] // fl
        window = min(context, frames)
        x, out = clips[:, (frames - window) * fl:], clips.clone()
        coords = self.layout.coords(window).to(self.wm.device)
        last = (window - 1) * fl  # the last frame's first slot in the window; slot s is predicted at s - 1
        for i in range(0, len(x), int(self.cfg.batch_size)):
            logits = self.wm.model(x[i:i + int(self.cfg.batch_size)].to(self.wm.device), coords)
            guess = logits[:, last - 1:last - 1 + ft, :self.cb].argmax(-1)
            out[i:i + len(guess), (frames - 1) * fl:(frames - 1) * fl + ft] = guess.to(out)
        return out

    def record(self) -> list[StartRecord]:
        cfg, starts, seed = self.cfg, [], int(self.cfg.seed_base)
        while len(starts) < cfg.starts:
            if seed - cfg.seed_base > 20 * cfg.starts + 20:
                raise RuntimeError(f"only {len(starts)} of starts={cfg.starts} Crafter starts could make every loop "
                                   f"{list(cfg.loop_lengths)}: use shorter loop_lengths")
            rec = record_start(seed, cfg.loop_lengths, cfg.rollout_frames, cfg.p_bump, cfg.warmup, self.size,
                               self.view, self.daylight, bool(cfg.keep_alive), self.shapes, self.placed)
            seed += 1
            if rec is not None:
                starts.append(rec)
        self.worlds_tried = seed - int(cfg.seed_base)
        return starts

    def run(self) -> dict:
        t0 = time.perf_counter()
        starts = self.record()
        t_record = time.perf_counter() - t0
        log.info("%d starts recorded from %d fresh Crafter worlds in %.0f s", len(starts), self.worlds_tried, t_record)
        results = {"loops": {}, "shapes": {}, "blocked": {}, "rollout": {}, "context": self.context,
                   "windows": self.windows, "seed": int(self.cfg.seed),
                   "starts": len(starts), "worlds_tried": self.worlds_tried, "sampler": self.wm.sampler(2).label}
        t1 = time.perf_counter()
        self.videos, self.curves = {}, {}
        if "loop" in self.cfg.tests:
            for n in self.cfg.loop_lengths:
                results["loops"][int(n)] = self.loop_test(int(n), [s.loops[int(n)] for s in starts])
                log.info("loop n=%d scored (%.0f s so far)", n, time.perf_counter() - t1)
        if "shapes" in self.cfg.tests:
            for shape in self.shapes:
                recs = [s.shapes[shape.name] for s in starts if shape.name in s.shapes]
                entry = {"frames": shape.frames, "made": len(recs), "starts": len(starts),
                         "beyond_context": shape.frames > self.context}
                if recs:
                    entry["rows"] = self.shape_test(shape, recs)
                results["shapes"][shape.name] = entry
                log.info("shape %s scored on %d of %d starts (%.0f s so far)", shape.name, len(recs), len(starts),
                         time.perf_counter() - t1)
            results["shapes"] |= self.skipped
            if self.skipped:
                log.info("shapes skipped, longer than the model's context of %d frames "
                         "(shapes_beyond_context=true runs them): %s", self.context, ", ".join(self.skipped))
        if "blocked" in self.cfg.tests:
            results["blocked"] = self.blocked_test([s.wander for s in starts],
                                                   {n: [s.placed.get(n) for s in starts] for n in self.placed})
            log.info("blocked and free moves scored (%.0f s so far)", time.perf_counter() - t1)
        if "rollout" in self.cfg.tests:
            results["rollout"], self.curves = self.rollout_test([s.wander for s in starts])
            results["creatures"] = {"codes": self.creature_codes.tolist(), "hidden": self.creatures_hidden,
                                    "rows": self.rollout_creatures}
        results["seconds"] = {"record": t_record, "model": time.perf_counter() - t1}
        return results

    def rows_for(self, clips: torch.Tensor, teacher_forced: bool = False) -> dict[str, torch.Tensor]:
        """{row: (B, N) clips}: the model on each window, copy_last, real; teacher_forced: also the model's last
        frame from the real ones on each window (`teacher_forced`)."""
        forced = {f"model context={w} teacher-forced": self.teacher_forced(clips, w) for w in self.windows} \
            if teacher_forced else {}
        return {**{f"model context={w}": self.generate(clips, w) for w in self.windows}, **forced,
                "copy_last": nothing_moves(clips, self.layout, 1), "real": clips}

    def loop_test(self, n: int, recs: list[Recording]) -> dict:
        masks = torch.stack([rerevealed_mask(self.grid, *(a - b for a, b in zip(r.pos[n], r.pos[0]))) for r in recs])
        return self.memory_test(recs, masks, f"loop_n{n}")

    def shape_test(self, shape: Shape, recs: list[Recording]) -> dict:
        offsets = [[(x - r.pos[0][0], y - r.pos[0][1]) for x, y in r.pos] for r in recs]
        masks = torch.stack([hidden_mask(self.grid, offs) for offs in offsets])
        far = torch.stack([far_mask(self.grid, offs) for offs in offsets])
        return self.memory_test(recs, masks, f"shape_{shape.name}", far if far.flatten(1).any(1).all() else None)

    def memory_test(self, recs: list[Recording], masks: torch.Tensor, video: str,
                    far: torch.Tensor | None = None) -> dict:
        """Walks back to the start view, generated from their first frame: per row `recall` (the masked start tiles
        at the end), `recall_far` (those of `far`, far_mask's, where every start has some), `loop_acc` (map, every
        generated frame), `inventory` (its rows, every frame), `invented`."""
        clips = torch.stack([self.tokens.clip(r) for r in recs])
        real = images_of(clips, self.layout)
        real_maps = self.grid.maps(real)
        out = {}
        for name, gen in self.rows_for(clips, bool(self.cfg.get("teacher_forced"))).items():
            images = images_of(gen, self.layout)
            maps = self.grid.maps(images)
            recall = masked_recall(maps[:, -1], real_maps[:, 0], masks)
            acc = (maps[:, 1:] == real_maps[:, 1:]).double().flatten(1).mean(1)
            out[name] = {"recall": interval(recall, self.cfg.seed), "loop_acc": interval(acc, self.cfg.seed),
                         **self.split_scores(images, real)}
            if far is not None:
                out[name]["recall_far"] = interval(masked_recall(maps[:, -1], real_maps[:, 0], far), self.cfg.seed)
            if name == f"model context={self.context}":
                self.videos[video] = {"real": clips[0], name: gen[0]}
        return out

    def split_scores(self, images: torch.Tensor, real: torch.Tensor) -> dict:
        """(B, T, h, w) generated and real image tokens -> {inventory: agreement of the inventory rows, invented:
        share of made-up tile types}, each per start over frames 1.. (the prompt's own frames agree, invent nothing)."""
        out = {}
        if self.layout.h > self.grid.map_h:
            inv = (self.grid.inventory(images)[:, 1:] == self.grid.inventory(real)[:, 1:]).double().flatten(1)
            out["inventory"] = interval(inv.mean(1), self.cfg.seed)
        invented = invented_share(images[:, 1:], real[:, 1:], real[:, :self.prompt])
        out["invented"] = interval(invented.mean(1), self.cfg.seed)
        return out

    def blocked_test(self, recs: list[Recording], placed: dict | None = None) -> dict:
        """Refused and free moves of the wanders, each predicted from the two real frames before it; the refused
        ones also by what refused them (`by_type`), with the placed obstacles' (placed: name -> per start, its
        place_and_bump recording or None) as `<name> (placed)`."""
        P = 2
        events = {"blocked": [], "free": []}
        for i, r in enumerate(recs):
            for t in range(P - 1, len(r.actions) - 1):
                a = r.actions[t]
                if a in MOVE_DELTA:
                    refused = r.pos[t + 1] == r.pos[t]
                    events["blocked" if refused else "free"].append((r, t, a, i, r.blocker[t] if refused else None))
        out, cap = {}, int(self.cfg.max_moves)
        for kind, evs in events.items():
            evs = [evs[i] for i in np.random.default_rng(self.cfg.seed).permutation(len(evs))[:cap]]
            if not evs:
                out[kind] = {"n": 0}
                continue
            share, real_share, acc = self.score_moves(evs, refused=kind == "blocked")
            key = "stayed" if kind == "blocked" else "moved"
            out[kind] = {key: interval(share, self.cfg.seed), f"real_{key}": interval(real_share, self.cfg.seed),
                         "map_acc": interval(acc, self.cfg.seed), "n": len(evs)}
            if kind == "blocked":
                out[kind]["by_type"] = {name: {"type": name, "placed": False, **scores} for name, scores in
                                        self.by_type(evs, share, real_share, acc).items()}
        by_type = out["blocked"].setdefault("by_type", {})
        for name, per_start in (placed or {}).items():
            evs = [(r, len(r.actions) - 2, r.actions[-2], i, name) for i, r in enumerate(per_start) if r is not None]
            entry = {"type": name, "placed": True, "tried": len(per_start), "n": 0}
            if evs:
                entry |= self.by_type(evs, *self.score_moves(evs, refused=True))[name]
            by_type[f"{name} (placed)"] = entry
        return out

    def score_moves(self, evs: list[tuple], refused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Moves (recording, t, action, ...): each generated from the two real frames before it -> per move (the
        model's map nearer the previous map than the shifted one (refused) or the other way round (free), the same
        for the real frames, the generated map's agreement with the real one)."""
        P = 2
        clips = torch.stack([self.tokens.clip(Recording(r.frames[t - P + 1:t + 2], r.actions[t - P + 1:t + 2],
                                                        r.pos[t - P + 1:t + 2])) for r, t, *_ in evs])
        moves = torch.tensor([a for _, _, a, *_ in evs])
        gen = self.generate(clips, prompt_frames=P)
        real, made = (self.grid.maps(images_of(c, self.layout)) for c in (clips, gen))
        stay, move = stay_or_move(real[:, -2], made[:, -1], moves, self.grid)
        real_stay, real_move = stay_or_move(real[:, -2], real[:, -1], moves, self.grid)
        share = (stay > move) if refused else (move > stay)
        real_share = (real_stay > real_move) if refused else (real_move > real_stay)
        acc = (made[:, -1] == real[:, -1]).double().flatten(1).mean(1)
        return share.double(), real_share.double(), acc

    def by_type(self, evs: list[tuple], share: torch.Tensor, real_share: torch.Tensor, acc: torch.Tensor) -> dict:
        """Refused moves (recording, t, action, start, what refused it) and their scores -> {type: {n, starts,
        stayed, real_stayed, map_acc}}, each with a bootstrap interval over starts (pooled_interval)."""
        out = {}
        for name in sorted({e[4] for e in evs}):
            pick = [k for k, e in enumerate(evs) if e[4] == name]
            starts = [evs[k][3] for k in pick]
            scored = {key: pooled_interval(v[pick], starts, int(self.cfg.seed))
                      for key, v in (("stayed", share), ("real_stayed", real_share), ("map_acc", acc))}
            out[name] = {"n": len(pick), "starts": scored["stayed"]["starts"], **scored}
        return out

    def rollout_test(self, recs: list[Recording]) -> tuple[dict, dict]:
        T = int(self.cfg.rollout_frames) + 1
        clips = torch.stack([self.tokens.clip(Recording(r.frames[:T], r.actions[:T], r.pos[:T])) for r in recs])
        out, curves = {}, {}
        rows = self.rows_for(clips)
        rows.pop("real")
        rows["scroll_start"] = scroll_start(clips, [r.pos[:T] for r in recs], self.grid, self.layout, self.prompt)
        every = images_of(clips, self.layout)
        real = every[:, 1:]
        has_inv = self.layout.h > self.grid.map_h
        moves = torch.tensor([[[b[0] - a[0], b[1] - a[1]] for a, b in zip(r.pos[:T - 1], r.pos[1:T])] for r in recs])
        creatures = {name: creature_events(self.grid.maps(images_of(gen, self.layout)), self.creature_codes, moves)
                     for name, gen in {**rows, "real": clips}.items()}
        self.rollout_creatures = {name: {k: interval(v, self.cfg.seed) for k, v in ev.items()} |
                                  ({} if name == "real" else {f"{k}_minus_real": interval(v - creatures["real"][k],
                                                                                          self.cfg.seed)
                                                              for k, v in ev.items()})
                                  for name, ev in creatures.items()}
        for name, gen in rows.items():
            images = images_of(gen, self.layout)[:, 1:]
            per = frame_agreement(gen, clips, self.layout)[:, 1:]  # (B, T-1)
            tv = histogram_distance(images, real, self.cb)  # (B, T-1)
            maps = (self.grid.maps(images) == self.grid.maps(real)).double().flatten(2).mean(-1)  # (B, T-1)
            inv = (self.grid.inventory(images) == self.grid.inventory(real)).double().flatten(2).mean(-1) \
                if has_inv else torch.full_like(maps, float("nan"))
            invented = invented_share(images, real, every[:, :self.prompt])  # (B, T-1)
            curves[name] = [interval(per[:, k], self.cfg.seed) | {
                "tv": float(tv[:, k].mean()), "map": float(maps[:, k].mean()), "inventory": float(inv[:, k].mean()),
                "invented": float(invented[:, k].mean())} for k in range(per.shape[1])]
            out[name] = {"mean": interval(per.mean(1), self.cfg.seed), "last": interval(per[:, -1], self.cfg.seed),
                         "tv_mean": interval(tv.mean(1), self.cfg.seed), "tv_last": interval(tv[:, -1], self.cfg.seed),
                         "map_mean": interval(maps.mean(1), self.cfg.seed),
                         **({"inventory_mean": interval(inv.mean(1), self.cfg.seed)} if has_inv else {}),
                         "invented_mean": interval(invented.mean(1), self.cfg.seed),
                         "invented_last": interval(invented[:, -1], self.cfg.seed)}
        return out, curves


# ------------------------------------------------------------------------------------------------ reporting
def _ci(d: dict | None) -> str:
    if not d or "mean" not in d:
        return "n/a"
    if d.get("lo") is None:  # one start: no interval
        return f"{d['mean']:.3f} (one start)"
    return f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}]"


def type_rows(by_type: dict) -> list[tuple[str, dict]]:
    """by_type's rows in table order: the wander's types by n (most first), then the placed obstacles."""
    return sorted(by_type.items(), key=lambda kv: (bool(kv[1].get("placed")), -kv[1]["n"], kv[0]))


def _memory_cells(v: dict, far: bool = False) -> str:
    return (f"{_ci(v['recall'])} | " + (f"{_ci(v.get('recall_far'))} | " if far else "") +
            f"{_ci(v['loop_acc'])} | {_ci(v.get('inventory'))} | {_ci(v.get('invented'))} |")


def markdown(res: dict) -> str:
    lines = [f"World tests: {res['starts']} starts (fresh Crafter worlds), model context {res['context']} frames, "
             f"sampler {res['sampler']}; 95% bootstrap intervals over starts. inventory: its rows' agreement, every "
             f"frame; invented: share of tiles whose type is in neither the real frame nor the prompt.", "",
             "| loop n | row | recall (re-revealed tiles) | loop_acc (map, every frame) | inventory | invented |",
             "|---|---|---|---|---|---|"]
    for n, rows in res["loops"].items():
        lines += [f"| {n} | {name} | {_memory_cells(v)}" for name, v in rows.items()]
    if res.get("shapes"):
        lines += ["", "| shape | frames | made / starts | row | recall (tiles the walk hid) | recall_far (hidden "
                      "in both frames before the last: beyond a copy from 2 frames back) | loop_acc (map) | "
                      "inventory | invented |", "|---|---|---|---|---|---|---|---|---|"]
        for name, v in res["shapes"].items():
            if "skipped" in v:
                lines.append(f"| {name} | {v['frames']} | skipped: {v['skipped']} (shapes_beyond_context=true runs "
                             f"it) | | | | | | |")
                continue
            mark = " (beyond context: a control)" if v.get("beyond_context") else ""
            made = f"{v['made']} / {v['starts']}{mark}"
            if not v.get("rows"):
                lines.append(f"| {name} | {v['frames']} | {made} | | | | | | |")
            lines += [f"| {name} | {v['frames']} | {made} | {row} | {_memory_cells(r, far=True)}"
                      for row, r in v.get("rows", {}).items()]
    b = res["blocked"]
    lines += ["", "| moves | n | model | real frames | map_acc |", "|---|---|---|---|---|"]
    for kind, key in (("blocked", "stayed"), ("free", "moved")) if b else ():
        v = b[kind]
        lines.append(f"| {kind} ({key}) | {v['n']} | {_ci(v.get(key, {}))} | {_ci(v.get('real_' + key, {}))} | "
                     f"{_ci(v.get('map_acc', {}))} |")
    if b and b.get("blocked", {}).get("by_type"):
        lines += ["", "Refused moves by what refused them (the share whose map stayed put; 95% bootstrap interval "
                      "over starts; placed: put there by Crafter's place action, then walked into):", "",
                  "| refused by | n | starts | model stayed | real frames | map_acc |", "|---|---|---|---|---|---|"]
        for name, v in type_rows(b["blocked"]["by_type"]):
            starts = f"{v.get('starts', 0)} of {v['tried']} worlds" if v.get("placed") else v.get("starts", 0)
            lines.append(f"| {name} | {v['n']} | {starts} | {_ci(v.get('stayed'))} | {_ci(v.get('real_stayed'))} | "
                         f"{_ci(v.get('map_acc'))} |")
    lines += ["", "| rollout row | token agreement, mean over steps | at the last step | map | inventory | "
                  "invented, mean | at the last step | tile-mix distance (tv), mean | at the last step |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {name} | {_ci(v['mean'])} | {_ci(v['last'])} | {_ci(v.get('map_mean'))} | "
              f"{_ci(v.get('inventory_mean'))} | {_ci(v.get('invented_mean'))} | {_ci(v.get('invented_last'))} | "
              f"{_ci(v['tv_mean'])} | {_ci(v['tv_last'])} |" for name, v in res["rollout"].items()]
    gains = window_gains(res, int(res.get("seed", 0)))
    if gains:
        lines += ["", "| memory: recall minus the 2-frame window's, start by start | row | difference |",
                  "|---|---|---|"]
        lines += [f"| {g['walk']} | {g['row']} | {g['mean']:+.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}] |" for g in gains]
    lines += creature_markdown(res.get("creatures"))
    margins = baseline_margins(res.get("rollout", {}), int(res.get("seed", 0)))
    if margins:
        lines += ["", "| rollout: model row minus baseline, start by start | token agreement, mean | map | "
                      "inventory |", "|---|---|---|---|"]
        lines += [f"| {m['row']} - {m['baseline']} | " + " | ".join(
            f"{m[k]['mean']:+.3f} [{m[k]['lo']:+.3f}, {m[k]['hi']:+.3f}]" if m.get(k) else "" for k in
            ("mean", "map_mean", "inventory_mean")) + " |" for m in margins]
    return "\n".join(lines) + "\n"


def creature_markdown(creatures: dict | None) -> list[str]:
    """The rollouts' creatures table: per row, each event per frame and its difference from the real frames'."""
    if not creatures:
        return []
    hidden = f"; not told from the ground by this VQ, so uncounted: {', '.join(creatures['hidden'])}" \
        if creatures["hidden"] else ""
    lines = ["", f"Creatures in the rollouts, per frame (cow, zombie, skeleton: {len(creatures['codes'])} codes"
                 f"{hidden}); entered / left: at the view's edge, popped: appeared or vanished inside it; (model - "
                 f"real): paired by start.", "",
             "| rollout row | " + " | ".join(CREATURE_EVENTS) + " | " +
             " | ".join(f"{k} - real" for k in CREATURE_EVENTS) + " |", "|---" * (1 + 2 * len(CREATURE_EVENTS)) + "|"]
    for name, v in creatures["rows"].items():
        diffs = [v.get(f"{k}_minus_real") for k in CREATURE_EVENTS]
        lines.append(f"| {name} | " + " | ".join(_ci(v[k]) for k in CREATURE_EVENTS) + " | " + " | ".join(
            f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" if d and d.get("lo") is not None else "" for d in
            diffs) + " |")
    return lines


def baseline_margins(rollout: dict, seed: int) -> list[dict]:
    """Each model row's rollout scores minus each baseline's (copy_last: nothing moves; scroll_start: the start frame
    scrolled by the true movement), paired start by start, each a mean and its 95% bootstrap interval."""
    out = []
    for row, v in rollout.items():
        if not row.startswith("model"):
            continue
        for base in ("copy_last", "scroll_start"):
            if base not in rollout:
                continue
            m = {"row": row, "baseline": base}
            for key in ("mean", "map_mean", "inventory_mean"):
                a, b = v.get(key), rollout[base].get(key)
                if a and b and "per_start" in a and "per_start" in b:
                    m[key] = interval(torch.tensor(a["per_start"], dtype=torch.float64) -
                                      torch.tensor(b["per_start"], dtype=torch.float64), seed)
            out.append(m)
    return out


def window_gains(res: dict, seed: int) -> list[dict]:
    """What memory buys: each loop's and shape's recall for every model row with a longer window minus the 2-frame
    window's (which cannot see the start frame at the end), paired start by start, with a 95% bootstrap interval
    over starts: recall "clearly above the 2-frame window" is an interval clear of 0."""
    walks = [(f"loop n={n}", rows) for n, rows in res.get("loops", {}).items()]
    walks += [(f"shape {name}", v.get("rows", {})) for name, v in res.get("shapes", {}).items()]
    out = []
    for (walk, rows), key in itertools.product(walks, ("recall", "recall_far")):
        for row, r in rows.items():
            forced = " teacher-forced" if row.endswith(" teacher-forced") else ""  # against the window's own kind
            short, mine = rows.get(f"model context=2{forced}", {}).get(key) or {}, r.get(key) or {}
            if not row.startswith("model") or row == f"model context=2{forced}" or "per_start" not in mine \
                    or "per_start" not in short:
                continue
            d = torch.tensor(mine["per_start"], dtype=torch.float64) - torch.tensor(short["per_start"],
                                                                                  dtype=torch.float64)
            out.append({"walk": walk + (" (far tiles)" if key == "recall_far" else ""), "row": row,
                        **interval(d, seed)})
    return out


def paired_versus(mine: dict, theirs: dict, seed: int) -> list[dict]:
    """This run's model rows minus another run's (`versus`: its world_tests.json), start by start (the same
    seed_base and starts: the same worlds and actions), each with a 95% bootstrap interval over starts: the
    rollout's agreement (mean, last step), map, inventory and invented tiles, and each loop's and shape's recall."""
    pairs = []
    for name, row in mine.get("rollout", {}).items():
        for key in ("mean", "last", "map_mean", "inventory_mean", "invented_mean", "tv_mean"):
            pairs.append((f"rollout {name}: {key}", row.get(key), theirs.get("rollout", {}).get(name, {}).get(key)))
    for name, row in mine.get("creatures", {}).get("rows", {}).items():
        for key in CREATURE_EVENTS if name != "real" else ():
            pairs.append((f"creatures {name}: {key}", row.get(key),
                          theirs.get("creatures", {}).get("rows", {}).get(name, {}).get(key)))
    for n, rows in mine.get("loops", {}).items():
        for name, r in rows.items():
            pairs.append((f"loop {n} {name}: recall", r.get("recall"),
                          theirs.get("loops", {}).get(str(n), {}).get(name, {}).get("recall")))
    for shape, v in mine.get("shapes", {}).items():
        for name, r in v.get("rows", {}).items():
            for key in ("recall", "recall_far"):
                pairs.append((f"shape {shape} {name}: {key}", r.get(key),
                              theirs.get("shapes", {}).get(shape, {}).get("rows", {}).get(name, {}).get(key)))
    out = []
    for what, a, b in pairs:
        if not a or not b or "per_start" not in a or "per_start" not in b or len(a["per_start"]) != len(b["per_start"]):
            continue
        d = torch.tensor(a["per_start"], dtype=torch.float64) - torch.tensor(b["per_start"], dtype=torch.float64)
        lo, hi = bootstrap_ci(d, lambda x: x.mean(-1), seed)
        out.append({"what": what, "mine": a["mean"], "theirs": b["mean"], "difference": float(d.mean()), "lo": lo,
                    "hi": hi, "n": len(d)})
    return out


def versus_markdown(rows: list[dict], versus: str) -> str:
    lines = [f"This run minus {versus}, start by start (95% bootstrap interval over starts):", "",
             "| measure | this run | versus | difference |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['mine']:.3f} | {r['theirs']:.3f} | {r['difference']:+.3f} [{r['lo']:+.3f}, "
              f"{r['hi']:+.3f}] |" for r in rows]
    return "\n".join(lines) + "\n"


CURVE_COLUMNS = ["row", "step", "agreement", "lo", "hi", "tv", "map", "inventory", "invented"]


def write_curves(curves: dict, path: Path) -> list[list]:
    table = [[name, k + 1, c["mean"], c["lo"], c["hi"], c["tv"], c["map"], c["inventory"], c["invented"]]
             for name, per in curves.items() for k, c in enumerate(per)]
    with written_atomically(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CURVE_COLUMNS)
        w.writerows(table)
    return table


def log_wandb(cfg: DictConfig, res: dict, table: list[list], media: dict) -> None:
    """The curve, the summary numbers and the loop videos to the configured W&B run (as mcar evaluate logs)."""
    run = open_run(cfg)
    if run is None:
        return
    log_table(run, "world/rollout_agreement", CURVE_COLUMNS, table,
              curve=("step", "agreement", "row", "token agreement per rollout step"))
    log_media(run, media)
    for n, rows in res["loops"].items():
        for name, v in rows.items():
            run.summary[f"loop{n}/{name}/recall"] = v["recall"]["mean"]
    for shape, entry in res["shapes"].items():
        for name, v in entry.get("rows", {}).items():
            run.summary[f"{shape}/{name}/recall"] = v["recall"]["mean"]
            if "recall_far" in v:
                run.summary[f"{shape}/{name}/recall_far"] = v["recall_far"]["mean"]
    for kind, v in res["blocked"].items():
        for key in ("stayed", "moved"):
            if key in v:
                run.summary[f"{kind}/{key}"] = v[key]["mean"]
    for name, v in res["blocked"].get("blocked", {}).get("by_type", {}).items():
        run.summary[f"blocked/{name}/n"] = v["n"]
        if "stayed" in v:
            run.summary[f"blocked/{name}/stayed"] = v["stayed"]["mean"]


def world_tests(cfg: DictConfig) -> dict:
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    for key in ("starts", "rollout_frames", "max_moves", "batch_size", "warmup"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key}={cfg[key]}: worldtest needs at least 1 (conf/worldtest.yaml)")
    unknown = [t for t in cfg.tests if t not in TESTS]
    if unknown or not cfg.tests:
        raise ValueError(f"tests={list(cfg.tests)}: choose some of {list(TESTS)} (conf/worldtest.yaml)")
    if cfg.get("windows") and any(int(w) < 2 for w in cfg.windows):
        raise ValueError(f"windows={list(cfg.windows)}: each window is >= 2 frames (the frame being made and one "
                         f"before; conf/worldtest.yaml)")
    bad = [n for n in cfg.loop_lengths if not 1 <= int(n)]
    if bad:
        raise ValueError(f"loop_lengths={list(cfg.loop_lengths)}: each n must be >= 1 (conf/worldtest.yaml)")
    if "shapes" in cfg.tests:
        for spec in cfg.get("shapes") or []:
            parse_shape(spec)
    unknown = [str(n) for n in cfg.get("placed") or [] if str(n) not in place_rules()]
    if unknown:
        raise ValueError(f"placed={list(cfg.placed)}: Crafter places {sorted(place_rules())} (conf/worldtest.yaml)")
    versus = None
    if cfg.get("versus"):  # checked now, not after the run
        versus = Path(cfg.versus) / "world_tests.json" if Path(cfg.versus).is_dir() else Path(cfg.versus)
        if not versus.is_file():
            raise FileNotFoundError(f"versus={cfg.versus}: no world_tests.json there (another worldtest's output)")
    tests = WorldTests(cfg)
    res = tests.run()
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    media = {}
    space = data_action_space(cfg.data)
    for key, clips in tests.videos.items():
        video = comparison_frames(clips, tests.layout, tests.cb, tests.vq, space)
        media[f"world/{key}"] = write_video(video, out / "videos" / key, cfg.fps)[1]
    table = write_curves(tests.curves, out / "rollout_agreement.csv")
    write_atomic(out / "world_tests.json", json.dumps({**res, "curves": tests.curves}, indent=1))
    md = markdown(res)
    if versus is not None:
        path = versus
        res["versus"] = {"path": str(path), "rows": paired_versus(res, json.loads(path.read_text()), int(cfg.seed))}
        md += "\n" + versus_markdown(res["versus"]["rows"], str(path))
        write_atomic(out / "world_tests.json", json.dumps({**res, "curves": tests.curves}, indent=1))
    write_atomic(out / "world_tests.md", md)
    log_wandb(cfg, res, table, media)
    log.info("%s\nwritten to %s (world_tests.json, rollout_agreement.csv, videos/)", md, out)
    return res
