"""Play's engine: games stepped frame by frame on the rolling KV cache, the games that step together batched.

`PlayServer` holds the model, its VQ and the games' rollouts (`mcar.core.sampler.Rollout`, docs/diagd.md
section 7); `PlaySession` is one game (one browser tab): its last frames, k, temperature and seed. The model sees
`context` frames at once (the checkpoint's clip length by default): the last `context - 1` frames and the one it
draws; nothing older reaches it.

Batching. The sessions that step at the same time (a tick: the actions collected while the previous tick ran)
share forward passes as batch rows of one rollout. Rows of a rollout advance together on one schedule from one
frame index, so a tick's sessions are grouped by (k, temperature, top_k, frames held): a group that is exactly an
existing rollout's rows advances it (d passes, no prefill); any other group starts a new rollout from each
member's last frames (one prefill of the window: what every step cost before the rolling cache). Each rollout keeps
its own KV cache, swapped into the model while it runs (the cache is the model's: one rollout in it at a time), so
a session stepping alone between others' steps continues its own rollout exactly. Chosen over restarting one
shared rollout whenever membership changes (players press keys at different times: every tick would restart) and
over rows at different frame indices (a schedule pass is one frame index for every row). A restart recomputes the
window's cached keys from its tokens, which from the second layer on differ from the kept ones (section 7): a
session's frames depend on when its rollout (re)started, never on the other rows. Noise is keyed by the session's
seed and frames, not by its batch row.
"""
from __future__ import annotations

import statistics
import threading
import time

import numpy as np
import torch

from mcar.core.keyed_rng import mix32, seed_key
from mcar.core.layout import Layout
from mcar.core.sampler import Rollout, ScheduleSampler, build_sampler
from mcar.tokenizer.pictures import decode_frames, to_u8


class _Group:
    """One rollout and its KV cache (one per layer), its rows the sessions `members` in order."""

    def __init__(self, members: tuple, settings: tuple, run: Rollout, caches: list):
        self.members, self.settings, self.run, self.caches = members, settings, run, caches


class PlayServer:
    """The model, its VQ and the rollouts of every session (`join` makes one); `step_together` runs one tick,
    `step` is a session's step from any thread, batched with the steps other threads are waiting on."""

    def __init__(self, model, vq, layout: Layout, codebook_size: int, *, context: int, sampler: dict | None = None,
                 schedule: dict | None = None, actions: dict | None = None, device: str | torch.device = "cpu"):
        if context < 2:
            raise ValueError(f"context={context} is invalid: the model must see >= 2 frames (the previous and the new)")
        self.model, self.vq, self.layout, self.cb, self.context = model, vq, layout, codebook_size, context
        self.device = torch.device(device)
        self.sampler_cfg = dict(sampler or {"name": "diagd"})
        self.schedule_cfg = dict(schedule or {})
        self.actions = dict(actions or {})
        self._samplers: dict[tuple[int, int], ScheduleSampler] = {}
        self._live: _Group | None = None  # the group whose caches are in the model
        self._cv = threading.Condition()
        self._waiting: dict[PlaySession, tuple[str, list[int]]] = {}
        self._done: dict[PlaySession, object] = {}
        self._busy = False
        self.ticks = self.restarts = 0

    def join(self, start: torch.Tensor, seed: int = 0) -> "PlaySession":
        """A new game from `start` ((P, frame_len) tokens, their actions included)."""
        return PlaySession(self, start, seed)

    def sampler(self, k: int, prompt_frames: int) -> ScheduleSampler:
        """The sampler of a rollout at `k` from `prompt_frames` frames (built once; its rolling schedule checked)."""
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
        """One tick: each (session, action) takes its step, sessions of one group as rows of one batch.
        -> [(frame, info)] in the order given."""
        steps = {}
        for session, action in moves:
            if session in steps:
                raise ValueError("a session takes one step per tick")
            steps[session] = session.action_ids(action)
        results = self._tick(steps)
        return [results[s] for s, _ in moves]

    def step(self, session: "PlaySession", action) -> tuple[np.ndarray, dict]:
        """`session` takes `action`; blocks until its frame is drawn, in the next tick, with whichever sessions
        are waiting then (the caller that finds no tick running runs it)."""
        move = session.action_ids(action)
        with self._cv:
            self._waiting[session] = move
            while session not in self._done:
                if self._busy:
                    self._cv.wait()
                    continue
                self._busy, batch, self._waiting = True, self._waiting, {}
                self._cv.release()
                try:
                    results = self._tick(batch)
                except Exception as e:  # every session of the tick hears of it
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
        t0 = time.perf_counter()
        groups: dict[tuple, list[PlaySession]] = {}
        for s in steps:
            held = min(len(s.history), self.context - 1)
            groups.setdefault((s.k, s.temperature, s.top_k, held), []).append(s)
        frames, passes = {}, {}
        for key, members in groups.items():
            group = members[0]._group
            if group is None or group.settings != key[:3] or set(group.members) != set(members) or \
                    any(s._group is not group for s in members):
                group = self._start(members)
            self._install(group)
            ids = torch.tensor([steps[s][1] for s in group.members], device=self.device) + self.cb
            before = group.run.passes
            tokens = group.run.advance(ids).cpu()
            for s, row in zip(group.members, tokens):
                frames[s], passes[s] = row, group.run.passes - before
        images = {s: s.decode(tokens) for s, tokens in frames.items()}  # one by one: a frame's image never
        dt = time.perf_counter() - t0  # depends on the batch it was decoded in (a batched conv rounds differently)
        self.ticks += 1
        return {s: s._took(steps[s], frames[s], images[s], passes[s], dt, len(frames)) for s in frames}

    def _start(self, members: list["PlaySession"]) -> _Group:
        """A new rollout for `members` from their last frames (each leaves the rollout it had)."""
        held = min(len(members[0].history), self.context - 1)
        s0 = members[0]
        sampler = self.sampler(s0.k, held)
        sampler.temperature, sampler.top_k = s0.temperature, s0.top_k
        prompt = torch.stack([s.history[-held:].reshape(-1) for s in members]).to(self.device)
        self.model.clear_cache()  # the live group keeps its caches: a fresh one for this rollout
        run = sampler.rollout(self.model, prompt)
        bases = torch.tensor([seed_key(s.seed) ^ (s.frames_played - held) for s in members], device=self.device)
        run.rows = mix32(bases)[:, None]  # noise keyed by the session's seed and frame, not its batch row
        group = _Group(tuple(members), (s0.k, s0.temperature, s0.top_k), run,
                       [layer.attention.cache for layer in self.model.layers])
        for s in members:
            if s._group is not None and s._group is not group:
                s._group.members = tuple(m for m in s._group.members if m is not s)
            s._group = group
        self._live = group
        self.restarts += 1
        return group

    def _install(self, group: _Group) -> None:
        if self._live is not group:
            for layer, cache in zip(self.model.layers, group.caches):
                layer.attention.cache = cache
            self._live = group

    def leave(self, session: "PlaySession") -> None:
        """`session` ends: its rollout row is dropped (the others restart without it at their next step)."""
        group, session._group = session._group, None
        if group is not None:
            group.members = tuple(m for m in group.members if m is not session)
            if self._live is group and not group.members:
                self._live = None
                self.model.clear_cache()


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

    def fork(self, start: torch.Tensor | None = None, seed: int | None = None) -> "PlaySession":
        """A new game on the same server from this game's start frames (or `start`; at most context - 1 kept)."""
        start = self.start if start is None else torch.as_tensor(start).reshape(-1, self.layout.frame_len)
        game = self.server.join(start[-(self.context - 1):], self.seed if seed is None else seed)
        game.k, game.temperature, game.top_k = self.k, self.temperature, self.top_k
        game.info = {**game.info, "k": game.k, "temperature": game.temperature}
        return game

    def sampler(self) -> ScheduleSampler:
        """The sampler of this game's next restart (its k, its frames held)."""
        return self.server.sampler(self.k, min(len(self.history), self.context - 1))

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
            self.server.leave(self)
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


# ---- measurements ---------------------------------------------------------------------------------------------
def bench_session(session: PlaySession, ks, actions, steps: int, repeats: int) -> dict:
    """The page's speed without the page: for each k, `repeats` rounds of `steps` steps (the actions in turn), each
    round from a reset after an untimed warm-up -> {"ks": {k: {"frames_per_s": median of the rounds' steps /
    seconds, "rounds": [...], "passes": per frame}}, "context", "threads", "steps"}. Rounds replay the same frames."""
    _check(steps, repeats)
    actions = list(actions) if session.actions else [[0] * session.layout.n_a]  # no action names: local id 0
    out = {}
    for k in ks:
        session.set_k(k)
        rounds = []
        for _ in range(repeats):
            session.warm_up(actions[0])  # untimed, ends with a reset
            t0 = time.perf_counter()
            for i in range(steps):
                _, info = session.step(actions[i % len(actions)])
            rounds.append(round(steps / (time.perf_counter() - t0), 2))
        out[str(k)] = {"frames_per_s": statistics.median(rounds), "rounds": rounds, "passes": info["passes"]}
    return {"ks": out, "context": session.context, "threads": torch.get_num_threads(), "steps": steps}


def bench_sessions(session: PlaySession, counts, actions, steps: int, repeats: int) -> dict:
    """Many players: for each n of `counts`, n games (forks of `session`, seeds seed + i) step together `steps`
    ticks, `repeats` rounds from a reset after one untimed tick -> {"sessions": {n: {"per_session_frames_per_s":
    each game's frames/s (median round), "frames_per_s": all games' together, "rounds": [...]}}, "k", "context",
    "threads", "steps"}."""
    _check(steps, repeats)
    actions = list(actions) if session.actions else [[0] * session.layout.n_a]
    out = {}
    for n in counts:
        games = [session.fork(seed=session.seed + i) for i in range(int(n))]
        rounds = []
        for _ in range(repeats):
            for g in games:
                g.reset()
            session.server.step_together([(g, actions[0]) for g in games])  # untimed: builds the batch's rollout
            t0 = time.perf_counter()
            for i in range(steps):
                session.server.step_together([(g, actions[(i + j) % len(actions)]) for j, g in enumerate(games)])
            rounds.append(round(steps / (time.perf_counter() - t0), 3))
        for g in games:
            session.server.leave(g)
        per = statistics.median(rounds)
        out[str(n)] = {"per_session_frames_per_s": per, "frames_per_s": round(per * int(n), 2), "rounds": rounds}
    return {"sessions": out, "k": session.k, "context": session.context, "threads": torch.get_num_threads(),
            "steps": steps}


def _check(steps: int, repeats: int) -> None:
    if steps < 1 or repeats < 1:
        raise ValueError(f"bench.steps={steps} and bench.repeats={repeats} must be >= 1")


def rollout_agreement(session: PlaySession, clips: list[torch.Tensor]) -> dict:
    """How well play holds together at the session's settings: each clip (F frames of a held-out episode) starts
    a game at its first frame and takes the episode's own next F - 1 actions; each generated frame is compared
    with the real one. -> {"agreement": per step, the mean fraction of image tokens equal to the real frame's;
    "copy_first": the same for the unchanged start frame (nothing moves: the floor a model must beat);
    "final", "mean": of agreement; "clips"}."""
    L, ft = session.layout.frame_len, session.layout.frame_tokens
    agree, still = [], []
    for clip in clips:
        frames = clip.reshape(-1, L)
        game = session.fork(start=frames[:1])
        row, row_still = [], []
        for t in range(1, len(frames)):
            ids = (frames[t - 1, ft:] - session.server.cb).tolist()  # the real action, as local ids
            game.step(ids if len(ids) > 1 else ids[0])
            real = frames[t, :ft]
            row.append((game.history[-1, :ft] == real).float().mean().item())
            row_still.append((frames[0, :ft] == real).float().mean().item())
        session.server.leave(game)
        agree.append(row), still.append(row_still)
    per_step = [round(statistics.fmean(col), 4) for col in zip(*agree)]
    return {"agreement": per_step, "copy_first": [round(statistics.fmean(col), 4) for col in zip(*still)],
            "final": per_step[-1], "mean": round(statistics.fmean(per_step), 4), "clips": len(clips)}
