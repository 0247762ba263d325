"""World tests on the tile-exact Crafter setting (data=crafter_tiles: one tile per token, a move is an exact
one-token shift of the map): memory, collisions and long rollouts, from starts on fresh Crafter seeds.

    mcar worldtest ckpt=checkpoints/shipped/crafter_tiles_diagd starts=32

Every start is a fresh Crafter world (seed `seed_base + i`, never a training episode's), played in-process by a
scripted policy and tokenised by the data's patch VQ. Four tests, each per start, with a 95% bootstrap interval
over starts (mcar.eval.stats):

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
  Crafter's own place action (drawn as Crafter draws it; checked in the world's tiles), then walks into it: the refused
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

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from mcar.atomic import write_atomic
from mcar.core.devices import set_threads
from mcar.crafter.gen import MOVE_DELTA, POLICIES, map_rows, place_rules
from mcar.crafter.map_tokens import (
    MapGrid,
    creature_events,
    far_mask,
    hidden_mask,
    masked_recall,
    rerevealed_mask,
    scroll_start,
    stay_or_move,
)
from mcar.crafter.scenes import Recording, Shape, StartRecord, fitting_shapes, parse_shape, record_start
from mcar.crafter.seeds import check_fresh_worlds, seen_policies, worlds_a_test_plays
from mcar.crafter.textures import creature_codes, tile_textures
from mcar.crafter.world_report import log_wandb, markdown
from mcar.eval.stats import interval, pooled_interval
from mcar.eval.world_tests import (
    ModelRows,
    Tokens,
    images_of,
    invented_share,
    paired_versus,
    score_rollouts,
    versus_markdown,
    write_curves,
)
from mcar.sampling.world_model import WorldModel
from mcar.tokenizer.pictures import comparison_frames, data_action_space, write_video
from mcar.tokenizer.vq_model import frame_size

log = logging.getLogger("mcar.crafter.world_tests")
TESTS = ("loop", "shapes", "blocked", "rollout")



# ------------------------------------------------------------------------------------------------ the run
class WorldTests(ModelRows):
    """Crafter's world tests on one checkpoint: the shared rows (mcar.eval.world_tests.ModelRows) on Crafter's own
    walks, refused moves and rollouts."""

    def __init__(self, cfg: DictConfig):
        wm = WorldModel.from_config(cfg)
        super().__init__(wm, cfg.get("windows"), OmegaConf.select(cfg, "schedule.prompt_frames", default=1) or 1,
                         cfg.batch_size)
        self.cfg = cfg
        self.seeds = check_fresh_worlds(int(cfg.seed_base), int(cfg.starts), wm.hp)
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
        # the shapes to walk: those whose clip fits the model's window (the start frame still seen at the end)
        shapes = [parse_shape(s) for s in cfg.get("shapes") or []] if "shapes" in cfg.tests else []
        self.shapes, self.skipped = fitting_shapes(shapes, self.context, bool(cfg.get("shapes_beyond_context")))
        # the obstacles placed and walked into, scored with the refused moves
        self.placed = [str(n) for n in cfg.get("placed") or []] if "blocked" in cfg.tests else []

    def record(self, policy: str) -> list[StartRecord]:
        cfg, starts, seed = self.cfg, [], int(self.cfg.seed_base)
        worlds = worlds_a_test_plays(cfg.seed_base, cfg.starts)  # those check_fresh_worlds checked
        while len(starts) < cfg.starts:
            if seed not in worlds:
                raise RuntimeError(f"only {len(starts)} of starts={cfg.starts} Crafter starts could make every loop "
                                   f"{list(cfg.loop_lengths)} with policy {policy}: use shorter loop_lengths")
            rec = record_start(seed, cfg.loop_lengths, cfg.rollout_frames, cfg.p_bump, cfg.warmup, self.size,
                               self.view, self.daylight, bool(cfg.keep_alive), self.shapes, self.placed, policy)
            seed += 1
            if rec is not None:
                starts.append(rec)
        self.worlds_tried = seed - int(cfg.seed_base)
        return starts

    def run(self) -> dict:
        """Every test for each policy of `policies` on the same fresh worlds -> {policies: {name: its results,
        seen: whether the checkpoint's data or post-training played it}, and what every policy shares}."""
        seen = seen_policies(self.wm.hp)
        results = {"policies": {}, "context": self.context, "windows": self.windows, "seed": int(self.cfg.seed),
                   "sampler": self.wm.sampler(2).label, "seeds": self.seeds, "seconds": {}}
        self.videos, self.curves = {}, {}
        for policy in self.cfg.policies:
            t0 = time.perf_counter()
            results["policies"][str(policy)] = {**self.run_policy(str(policy)), "seen": str(policy) in seen}
            results["seconds"][str(policy)] = time.perf_counter() - t0
        return results

    def run_policy(self, policy: str) -> dict:
        t0 = time.perf_counter()
        starts = self.record(policy)
        log.info("%s: %d starts recorded from %d fresh Crafter worlds in %.0f s", policy, len(starts),
                 self.worlds_tried, time.perf_counter() - t0)
        results = {"loops": {}, "shapes": {}, "blocked": {}, "rollout": {}, "starts": len(starts),
                   "worlds_tried": self.worlds_tried}
        t1 = time.perf_counter()
        self.video_prefix = f"{policy}/"
        if "loop" in self.cfg.tests:
            for n in self.cfg.loop_lengths:
                results["loops"][int(n)] = self.loop_test(int(n), [s.loops[int(n)] for s in starts])
                log.info("%s: loop n=%d scored (%.0f s so far)", policy, n, time.perf_counter() - t1)
        if "shapes" in self.cfg.tests:
            for shape in self.shapes:
                recs = [s.shapes[shape.name] for s in starts if shape.name in s.shapes]
                entry = {"frames": shape.frames, "made": len(recs), "starts": len(starts),
                         "beyond_context": shape.frames > self.context}
                if recs:
                    entry["rows"] = self.shape_test(shape, recs)
                results["shapes"][shape.name] = entry
                log.info("%s: shape %s scored on %d of %d starts (%.0f s so far)", policy, shape.name, len(recs),
                         len(starts), time.perf_counter() - t1)
            results["shapes"] |= self.skipped
            if self.skipped:
                log.info("shapes skipped, longer than the model's context of %d frames "
                         "(shapes_beyond_context=true runs them): %s", self.context, ", ".join(self.skipped))
        if "blocked" in self.cfg.tests:
            results["blocked"] = self.blocked_test([s.wander for s in starts],
                                                   {n: [s.placed.get(n) for s in starts] for n in self.placed})
            log.info("%s: blocked and free moves scored (%.0f s so far)", policy, time.perf_counter() - t1)
        if "rollout" in self.cfg.tests:
            results["rollout"], curves = self.rollout_test([s.wander for s in starts])
            self.curves |= {f"{policy} {row}": per for row, per in curves.items()}
            results["creatures"] = {"codes": self.creature_codes.tolist(), "hidden": self.creatures_hidden,
                                    "rows": self.rollout_creatures}
        return results

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
                self.videos[self.video_prefix + video] = {"real": clips[0], name: gen[0]}
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
        """The shared rollout scores (mcar.eval.world_tests.score_rollouts) with scroll_start as the oracle and the map
        and inventory rows apart, and the creatures' comings and goings per row."""
        T = int(self.cfg.rollout_frames) + 1
        clips = torch.stack([self.tokens.clip(Recording(r.frames[:T], r.actions[:T], r.pos[:T])) for r in recs])
        rows = self.rows_for(clips)
        rows.pop("real")
        rows["scroll_start"] = scroll_start(clips, [r.pos[:T] for r in recs], self.grid, self.layout, self.prompt)
        moves = torch.tensor([[[b[0] - a[0], b[1] - a[1]] for a, b in zip(r.pos[:T - 1], r.pos[1:T])] for r in recs])
        creatures = {name: creature_events(self.grid.maps(images_of(gen, self.layout)), self.creature_codes, moves)
                     for name, gen in {**rows, "real": clips}.items()}
        self.rollout_creatures = {name: {k: interval(v, self.cfg.seed) for k, v in ev.items()} |
                                  ({} if name == "real" else {f"{k}_minus_real": interval(v - creatures["real"][k],
                                                                                          self.cfg.seed)
                                                              for k, v in ev.items()})
                                  for name, ev in creatures.items()}
        bands = {"map": slice(0, self.grid.map_h), "inventory": slice(self.grid.map_h, None)}
        return score_rollouts(rows, clips, self.layout, self.cb, self.prompt, self.cfg.seed, bands)


def checked_config(cfg: DictConfig) -> Path | None:
    """Every setting checked before any work, one line naming the field -> the `versus` run's world_tests.json."""
    for key in ("starts", "rollout_frames", "max_moves", "batch_size", "warmup"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key}={cfg[key]}: worldtest needs at least 1 (conf/worldtest.yaml)")
    policies = [str(p) for p in cfg.get("policies") or []]
    if not policies or any(p not in POLICIES for p in policies) or len(set(policies)) < len(policies):
        raise ValueError(f"policies={policies}: some of {sorted(POLICIES)}, each once (conf/worldtest.yaml)")
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
    if not cfg.get("versus"):
        return None
    versus = Path(cfg.versus) / "world_tests.json" if Path(cfg.versus).is_dir() else Path(cfg.versus)
    if not versus.is_file():
        raise FileNotFoundError(f"versus={cfg.versus}: no world_tests.json there (another worldtest's output)")
    return versus


def world_tests(cfg: DictConfig) -> dict:
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    versus = checked_config(cfg)
    tests = WorldTests(cfg)
    res = tests.run()
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    media = {}
    space = data_action_space(cfg.data)
    for key, clips in tests.videos.items():
        video = comparison_frames(clips, tests.layout, tests.cb, tests.vq, space)
        media[f"world/{key}"] = write_video(video, out / "videos" / key, cfg.fps)[1]
    columns, table = write_curves(tests.curves, out / "rollout_agreement.csv")
    write_atomic(out / "world_tests.json", json.dumps({**res, "curves": tests.curves}, indent=1))
    md = markdown(res)
    if versus is not None:
        path = versus
        theirs = json.loads(path.read_text()).get("policies", {})
        rows = [{**r, "what": f"{name}: {r['what']}"} for name, mine in res["policies"].items() if name in theirs
                for r in paired_versus(mine, theirs[name], int(cfg.seed))]
        res["versus"] = {"path": str(path), "rows": rows}
        md += "\n" + versus_markdown(res["versus"]["rows"], str(path))
        write_atomic(out / "world_tests.json", json.dumps({**res, "curves": tests.curves}, indent=1))
    write_atomic(out / "world_tests.md", md)
    log_wandb(cfg, res, columns, table, media)
    log.info("%s\nwritten to %s (world_tests.json, rollout_agreement.csv, videos/)", md, out)
    return res
