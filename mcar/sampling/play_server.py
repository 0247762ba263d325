"""Play's engine: games stepped frame by frame on the rolling KV cache, the games that step together batched.

`PlayServer` holds the model, its VQ and the games' rollouts (`mcar.core.sampler.Rollout`, docs/diagd.md
section 7); `PlaySession` is one game (one browser tab): its last frames, k, temperature and seed. The model sees
`context` frames at once (the checkpoint's clip length by default): the last `context - 1` frames and the one it
draws; nothing older reaches it.

Batching. The games that step at the same time (a tick: the actions collected while the previous tick ran) share
forward passes as the rows of one rollout. A rollout advances when every game in it steps; when only some do (a
partner pressed no key, reset, left or changed its k), those that step are split off into a rollout of their own
(`Rollout.split`: their rows' KV cache copied), so they go on exactly as before. A game starts a new rollout from
its last frames only on its own account (new, reset, k or temperature changed), together with the other games of
the tick that need one at the same settings (one prefill of the window). A restart recomputes the window's cached
keys from its tokens, which from the second layer on differ from the kept ones (section 7), so restarts happen
only when the game itself asks: **a game draws the frames it draws played alone**, whoever else plays, joins or
leaves. Each rollout has its own KV cache (`Transformer.swap_caches`), borrowed from the server's pool and given
back when its last game leaves: the next rollout of that batch width runs on the very same buffers (zeroed by its
prefill, or written over by a split's copy), since CUDA graphs read the caches at fixed addresses and record again
for a cache that moved. Noise is keyed by the game's seed and each frame's index in the game, whenever its rollout
began.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import torch
from omegaconf import DictConfig, open_dict

from mcar.core.devices import set_threads
from mcar.core.keyed_rng import seed_key
from mcar.core.layout import Layout
from mcar.core.model import KVCache
from mcar.core.sampler import Rollout, ScheduleSampler, build_sampler
from mcar.hydra_app import to_dict
from mcar.sampling.world_model import WorldModel
from mcar.tokenizer.pictures import data_action_space, decode_frames, to_u8


class GamesFull(RuntimeError):
    """The server holds `max_games` games: a new one waits for one to leave."""


class _Group:
    """One rollout and its KV caches; its rows the games `rows` in order (None: a ghost row, its game gone on)."""

    def __init__(self, rows: list, settings: tuple, run: Rollout, caches: list):
        self.rows, self.settings, self.run, self.caches = rows, settings, run, caches

    @property
    def members(self) -> set:
        return {s for s in self.rows if s is not None}


class _CachePool:
    """KV cache sets (a KVCache per layer) lent to rollouts and taken back when their last game leaves, so that a
    later rollout of the same shape runs on the very same buffers: CUDA graphs read the caches at fixed addresses,
    record again for a set that moved, and stop graphing a shape after 128 records. A set is made only when none of
    its shape is free, so the pool holds as many sets of a shape as were ever lent at once."""

    def __init__(self):
        self._free: dict[tuple, list[list[KVCache]]] = {}
        self.lent = 0

    @staticmethod
    def shape(caches: list[KVCache]) -> tuple:
        """(batch width, slots, dtype, device): what a rollout's prefill checks before reusing the model's caches."""
        k = caches[0].k
        return k.shape[0], k.shape[2], k.dtype, k.device

    def take(self, shape: tuple) -> list[KVCache] | None:
        """A free set of `shape`, or None (none free: the caller makes one)."""
        free = self._free.get(shape)
        return free.pop() if free else None

    def lend(self, caches: list[KVCache]) -> list[KVCache]:
        self.lent += 1
        return caches

    def give_back(self, caches: list[KVCache]) -> None:
        self._free.setdefault(self.shape(caches), []).append(caches)
        self.lent -= 1


class PlayServer:
    """The model, its VQ and the rollouts of every game (`join` makes one); `step_together` runs one tick, `step`
    is a game's step from any thread, batched with the steps other threads are waiting on. At most `max_games`
    games at once (None: no cap); a game's memory (its rollout's KV cache) goes back to the server's cache pool
    when it leaves, for the next rollout of that width."""

    def __init__(self, model, vq, layout: Layout, codebook_size: int, *, context: int, sampler: dict | None = None,
                 schedule: dict | None = None, actions: dict | None = None, device: str | torch.device = "cpu",
                 max_games: int | None = None):
        if context < 2:
            raise ValueError(f"sampler.context={context} is invalid: the model must see >= 2 frames (the previous "
                             f"and the new)")
        if max_games is not None and max_games < 1:
            raise ValueError(f"max_games={max_games} is invalid: it must be >= 1 or null (no cap)")
        self.model, self.vq, self.layout, self.cb, self.context = model, vq, layout, codebook_size, context
        self.device = torch.device(device)
        self.sampler_cfg = dict(sampler or {"name": "diagd"})
        self.schedule_cfg = dict(schedule or {})
        self.actions = dict(actions or {})
        self.max_games = max_games
        self.games: set[PlaySession] = set()  # joined and not yet gone
        self._samplers: dict[tuple[int, int], ScheduleSampler] = {}
        self._groups: list[_Group] = []  # rollouts with at least one game
        self._caches = _CachePool()  # the rollouts' KV caches, at addresses kept for CUDA graphs
        self._model_lock = threading.RLock()  # a tick, a leave: one at a time (the model has one cache slot)
        self._cv = threading.Condition()
        self._waiting: dict[PlaySession, tuple[str, list[int]]] = {}
        self._done: dict[PlaySession, object] = {}
        self._busy = False
        self.ticks = self.restarts = self.splits = 0

    def join(self, start: torch.Tensor, seed: int = 0, template: bool = False) -> "PlaySession":
        """A new game from `start` ((P, frame_len) tokens, their actions included); GamesFull at `max_games`.
        template: the game the page forks each player's from (not counted)."""
        with self._model_lock:
            if not template and self.max_games is not None and len(self.games) >= self.max_games:
                raise GamesFull(f"all {self.max_games} games are taken: try again when a player leaves "
                                f"(max_games={self.max_games})")
            game = PlaySession(self, start, seed)
            if not template:
                self.games.add(game)
            return game

    def sampler(self, k: int, prompt_frames: int) -> ScheduleSampler:
        """The sampler of a rollout at `k` from `prompt_frames` frames (built once; its rolling schedule checked).
        Temperature and top_k are a rollout's own (`ScheduleSampler.rollout`): nothing here changes per game."""
        key = (k, prompt_frames)
        if key not in self._samplers:
            sched = {**self.schedule_cfg, "k": k, "prompt_frames": prompt_frames}
            s = build_sampler({**self.sampler_cfg, "context": self.context}, self.layout, self.context, self.cb,
                              schedule=sched)
            s.rolling_schedule(self.device)
            self._samplers[key] = s
        return self._samplers[key]

    # ---- a tick -----------------------------------------------------------------------------------------
    def step_together(self, moves: list[tuple["PlaySession", object]]) -> list[tuple[np.ndarray, dict]]:
        """One tick: each (game, action) takes its step, games of one rollout as rows of one batch.
        -> [(frame, info)] in the order given."""
        steps = {}
        for session, action in moves:
            if session in steps:
                raise ValueError("a session takes one step per tick")
            steps[session] = session.action_ids(action)
        results = self._tick(steps)
        return [results[s] for s, _ in moves]

    def step(self, session: "PlaySession", action) -> tuple[np.ndarray, dict]:
        """`session` takes `action`; blocks until its frame is drawn, in the next tick, with whichever games are
        waiting then (the caller that finds no tick running runs it)."""
        move = session.action_ids(action)
        with self._cv:
            self._waiting[session] = move
            while session not in self._done:
                if self._busy:
                    self._cv.wait()
                    continue
                if session not in self._waiting:  # taken by a tick that gave no answer: never wait for ever
                    raise RuntimeError("play: this step was lost by its tick; step again")
                self._busy, batch, self._waiting = True, self._waiting, {}
                self._cv.release()
                try:
                    results = self._tick(batch)
                except Exception as e:  # every game of the tick hears of it
                    results = {s: e for s in batch}
                finally:
                    self._cv.acquire()
                    self._busy = False
                self._done.update(results)
                self._cv.notify_all()
            out = self._done.pop(session)
        if isinstance(out, Exception):
            raise out
        return out

    @torch.no_grad()
    def _tick(self, steps: dict["PlaySession", tuple[str, list[int]]]) -> dict:
        with self._model_lock:
            t0 = time.perf_counter()
            frames, passes = {}, {}
            kept = self._advancing(steps)
            restart: dict[tuple, list[PlaySession]] = {}
            for s in steps:
                if s._group not in kept:
                    restart.setdefault((s.settings(), s.held), []).append(s)
            groups = kept + [self._start(members) for members in restart.values()]
            for group in groups:
                self.model.swap_caches(group.caches)
                ids = torch.tensor([steps[s][1] for s in group.rows], device=self.device) + self.cb
                before = group.run.passes
                tokens = group.run.advance(ids).cpu()
                for s, row in zip(group.rows, tokens):
                    frames[s], passes[s] = row, group.run.passes - before
            images = {s: s.decode(tokens) for s, tokens in frames.items()}  # one by one: a frame's image never
            dt = time.perf_counter() - t0  # depends on the batch it was decoded in (a batched conv rounds differently)
            self.ticks += 1
            return {s: s._took(steps[s], frames[s], images[s], passes[s], dt, len(frames)) for s in steps}

    def _advancing(self, steps: dict) -> list[_Group]:
        """The rollouts that advance in this tick: of each rollout, the games stepping at its settings, split off
        into a rollout of their own (their rows' KV cache copied: they go on exactly) unless they are all of it."""
        kept = []
        for group in {id(s._group): s._group for s in steps if s._group is not None}.values():
            stepping = [s for s in group.rows if s in steps and s.settings() == group.settings]
            if stepping:
                kept.append(group if len(stepping) == len(group.rows) else self._split(group, stepping))
        return kept

    def _split(self, group: _Group, members: list["PlaySession"]) -> _Group:
        """`members` of `group` as a rollout of their own, going on from where they are (their rows in `group`
        become ghosts, never advanced: a rollout advances only when every row steps)."""
        self.model.swap_caches(group.caches)
        into = self._caches.take((len(members), *self._caches.shape(group.caches)[1:]))  # None: split makes one
        run = group.run.split([group.rows.index(s) for s in members], into)
        new = _Group(list(members), group.settings, run, self._caches.lend(self.model.kv_caches()))
        for s in members:
            self._drop_row(s)
            s._group = new
        self._groups.append(new)
        self.splits += 1
        return new

    def _start(self, members: list["PlaySession"]) -> _Group:
        """A new rollout for `members` from their last frames (each leaves the rollout it had)."""
        for s in members:
            self._drop_row(s)
        s0 = members[0]
        held = s0.held
        prompt = torch.stack([s.history[-held:].reshape(-1) for s in members]).to(self.device)
        sampler = self.sampler(s0.k, held)
        shape = (len(members), sampler.rolling_schedule(prompt.device).cache_slots,
                 self.model.cache_dtype(prompt.device), prompt.device)
        # the other rollouts keep their caches: a free set of this shape, which the prefill zeroes and reuses in
        # place (nothing of its last game is seen), or None and the prefill makes one
        self.model.swap_caches(self._caches.take(shape))
        run = sampler.rollout(
            self.model, prompt, temperature=s0.temperature, top_k=s0.top_k,
            noise_keys=torch.tensor([seed_key(s.seed) for s in members]),
            first_frames=torch.tensor([s.frames_played - held for s in members]))
        group = _Group(list(members), s0.settings(), run, self._caches.lend(self.model.kv_caches()))
        for s in members:
            s._group = group
        self._groups.append(group)
        self.restarts += 1
        return group

    def _drop_row(self, session: "PlaySession") -> None:
        """`session`'s row of its rollout becomes a ghost; a rollout left with no game goes, its KV cache back to
        the pool."""
        group, session._group = session._group, None
        if group is None:
            return
        group.rows = [None if s is session else s for s in group.rows]
        if not group.members:
            self._groups.remove(group)
            live = self.model.kv_caches()
            if live is not None and live[0] is group.caches[0]:
                self.model.swap_caches(None)
            self._caches.give_back(group.caches)
            group.caches = group.run = None

    def detach(self, session: "PlaySession") -> None:
        """`session` leaves its rollout (a reset: it restarts at its next step); waits for a running tick."""
        with self._model_lock:
            self._drop_row(session)

    def leave(self, session: "PlaySession") -> None:
        """`session` ends: its rollout row becomes a ghost, its place is free; waits for a running tick."""
        with self._model_lock:
            self._drop_row(session)
            self.games.discard(session)

    def leaves_nothing(self) -> bool:
        """No game and no rollout is held, and every KV cache set is back in the pool (what a server whose players
        all left must come back to; the pool keeps the sets for the next players)."""
        return not self.games and not self._groups and self.model.kv_caches() is None and self._caches.lent == 0


class PlaySession:
    """One game: the last `context - 1` frames (`history`, (n, frame_len) tokens with the action taken from each;
    the newest frame's action is the next step's), k, temperature, top_k and seed; `step(action)` draws and
    decodes the next frame (through its server, batched with the games stepping at the same time).

    Sampling is keyed by the seed and the frame's index in the game: the same actions after a reset give the same
    frames."""

    def __init__(self, server: PlayServer, start: torch.Tensor, seed: int = 0):
        L = server.layout.frame_len
        self.server, self.seed = server, seed
        self.start = torch.as_tensor(start).long().reshape(-1, L).cpu()
        if len(self.start) >= server.context:
            raise ValueError(f"{len(self.start)} start frame(s) leave no room in a context of {server.context} "
                             f"frames: set context={len(self.start) + 1} or more")
        self.k = int(server.schedule_cfg.get("k", 2))
        self.temperature = float(server.sampler_cfg.get("temperature", 1.0))
        self.top_k = server.sampler_cfg.get("top_k")
        self.actions = server.actions
        self._group: _Group | None = None
        self._lock = threading.Lock()  # one step / reset / setting change of this game at a time
        self._start_frame = self.decode(self.start[-1])
        self.reset()

    @property
    def context(self) -> int:
        """Frames the model sees at once: the last context - 1 frames and the one it draws."""
        return self.server.context

    @property
    def layout(self) -> Layout:
        return self.server.layout

    @property
    def held(self) -> int:
        """Frames a rollout started now would take as its prompt: the last context - 1 at most."""
        return min(len(self.history), self.context - 1)

    def settings(self) -> tuple:
        """What the games of one rollout share: (k, temperature, top_k)."""
        return self.k, self.temperature, self.top_k

    def fork(self, start: torch.Tensor | None = None, seed: int | None = None) -> "PlaySession":
        """A new game on the same server from this game's start frames (or `start`; at most context - 1 kept)."""
        start = self.start if start is None else torch.as_tensor(start).reshape(-1, self.layout.frame_len)
        game = self.server.join(start[-(self.context - 1):], self.seed if seed is None else seed)
        game.k, game.temperature, game.top_k = self.k, self.temperature, self.top_k
        game.info = {**game.info, "k": game.k, "temperature": game.temperature}
        return game

    def sampler(self) -> ScheduleSampler:
        """The sampler of this game's next restart (its k, its frames held)."""
        return self.server.sampler(self.k, self.held)

    def set_k(self, k: int) -> dict:
        """schedule.k for the next steps (>= 1: how far each row runs ahead of the one below)."""
        k = int(k)
        if k < 1:
            raise ValueError(f"k={k} is invalid: it must be >= 1")
        with self._lock:
            self.server.sampler(k, min(len(self.history), self.context - 1))  # validated now (a d may not fit)
            self.k = k
            self.info = {**self.info, "k": k}
            return self.info

    def set_temperature(self, temperature: float) -> dict:
        """The sampling temperature of the next steps (0: greedy, the most likely token everywhere)."""
        temperature = float(temperature)
        if not temperature >= 0:
            raise ValueError(f"temperature={temperature} is invalid: it must be >= 0 (0 = greedy)")
        with self._lock:
            self.temperature = temperature
            self.info = {**self.info, "temperature": temperature}
            return self.info

    def action_ids(self, action) -> tuple[str, list[int]]:
        """A name of `actions`, an id (n_a = 1) or n_a ids -> (label, local ids)."""
        n_a = self.layout.n_a
        if isinstance(action, str) and action in self.actions:
            return action, [int(i) for i in self.actions[action]]
        if isinstance(action, str) and action.isdigit():
            action = int(action)
        ids = [action] if isinstance(action, int) else list(action) if isinstance(action, (list, tuple)) else None
        if ids is None or len(ids) != n_a or not all(isinstance(i, int) for i in ids):
            names = ", ".join(self.actions) or "none"
            raise ValueError(f"action {action!r}: give one of the names ({names}) or {n_a} local action id(s)")
        named = [name for name, own in self.actions.items() if list(own) == ids]
        return (named[0] if named else str(ids[0] if n_a == 1 else ids)), ids

    def decode(self, frame_tokens: torch.Tensor) -> np.ndarray:
        """(frame_len,) tokens -> the frame's image, (H, W, 3) uint8."""
        ids = frame_tokens[: self.layout.frame_tokens].reshape(1, 1, self.layout.h, self.layout.w)
        return to_u8(decode_frames(self.server.vq, ids)[0])[0]

    def reset(self) -> tuple[np.ndarray, dict]:
        """Back to the start frame(s) (a new rollout at the next step); -> (the last start frame, info)."""
        with self._lock:
            self.server.detach(self)
            self.history = self.start.clone()
            self.frames_played = len(self.start)  # frames of the game so far, the start frames included
            self.steps = 0
            self.frame = self._start_frame.copy()
            self.info = {"action": "reset", "fps": None, "k": self.k, "temperature": self.temperature, "passes": 0,
                         "step": 0, "seconds": 0.0, "frames": len(self.history), "context": self.context,
                         "batch": 0}
            return self.frame, self.info

    def step(self, action) -> tuple[np.ndarray, dict]:
        """Take `action` from the current frame -> (the frame drawn (H, W, 3) uint8, info: action, fps (of this
        step's tick: sampling + decoding), k, temperature, passes, step, seconds, frames (held after the step),
        context, batch (games in the tick))."""
        with self._lock:
            return self.server.step(self, action)

    def _took(self, move: tuple[str, list[int]], tokens: torch.Tensor, image: np.ndarray, passes: int, dt: float,
              batch: int) -> tuple[np.ndarray, dict]:
        label, ids = move
        L, ft = self.layout.frame_len, self.layout.frame_tokens
        history = self.history.clone()
        history[-1, ft:] = torch.tensor(ids) + self.server.cb
        new = torch.full((1, L), self.server.cb, dtype=torch.long)  # its action: not taken yet
        new[0, :ft] = tokens
        self.history = torch.cat([history, new])[-(self.context - 1):]
        self.frames_played += 1
        self.steps += 1
        self.frame = image
        self.info = {"action": label, "fps": 1.0 / dt, "k": self.k, "temperature": self.temperature,
                     "passes": passes, "step": self.steps, "seconds": dt, "frames": len(self.history),
                     "context": self.context, "batch": batch}
        return self.frame, self.info

    def warm_up(self, action=None) -> float:
        """context steps, then a reset: builds the samplers of every frame count held at the current k (and with
        sampler.compile=true compiles them) before the first key press; -> seconds taken."""
        t0 = time.perf_counter()
        action = action if action is not None else (next(iter(self.actions)) if self.actions else [0] * self.layout.n_a)
        for held in range(len(self.start), self.context):  # a restart may come from any number of frames held
            self.server.sampler(self.k, held)
        self.reset()
        for _ in range(self.context):
            self.step(action)
        self.reset()
        return time.perf_counter() - t0


def named_actions(space: str | None) -> dict[str, list[int]]:
    """name -> ids of every action of the data's action space, when that space names its actions ({}: it does not)."""
    from mcar.tokenizer.actions import action_space

    names = action_space(space).names if space else None
    return {name: action_space(space).encode_name(name) for name in names or ()}


def start_frames(wm: WorldModel, prompt_frames: int) -> torch.Tensor:
    """The start frames: the first `prompt_frames` frames of held-out clip / episode `prompt`, or the tokens of
    `prompt_image` (then one start frame) -> (P, frame_len)."""
    cfg = wm.cfg
    if cfg.prompt_image:
        if prompt_frames != 1:
            raise ValueError(f"prompt_image gives one start frame: use schedule.prompt_frames=1 (not {prompt_frames})")
        with open_dict(cfg):  # generate's image prompt: the image, then one (unused) action
            cfg.actions = [[0] * wm.layout.n_a] if wm.layout.n_a > 1 else [0]
    clip, _, _ = wm.prompt(wm.context)
    return clip.reshape(-1, wm.layout.frame_len)[:prompt_frames]


def open_game(cfg: DictConfig) -> PlaySession:
    """A play config (conf/play.yaml) -> a game (PlaySession) on a PlayServer of the checkpoint, its data's VQ and
    the start frame(s)."""
    torch.manual_seed(cfg.seed)
    set_threads(cfg.threads)
    wm = WorldModel.from_config(cfg)
    schedule = to_dict(cfg.schedule)
    P = int(schedule.get("prompt_frames", 1))
    if P >= wm.context:
        raise ValueError(f"schedule.prompt_frames={P} start frames leave no room in a context of {wm.context} frames: "
                         f"set sampler.context={P + 1} or more (null: the checkpoint's {wm.trained_frames})")
    server = PlayServer(wm.model, wm.vq, wm.layout, wm.codebook_size, context=wm.context,
                        sampler=to_dict(cfg.sampler), schedule=schedule,
                        actions=named_actions(data_action_space(cfg.data)), device=wm.device,
                        max_games=cfg.get("max_games"))
    return server.join(start_frames(wm, P), seed=cfg.seed, template=True)
