"""Play a trained world model in the browser: keys and buttons pick the action, DiagD draws the next frame.

    pip install -e '.[play]'                                  # gradio, an optional extra
    mcar play ckpt=checkpoints/<run> [prompt=3] [schedule.k=2] [port=7860]
    mcar play ckpt=... prompt_image=frame.png       # start from an image instead of a held-out clip

    mcar play ckpt=... bench.steps=20               # no page: time the steps per k, print JSON

Then open http://127.0.0.1:7860. Crafter keys: arrows or WASD move, space is `do`; buttons take the other
actions (noop, sleep, place_stone, ...), `reset` goes back to the start frame, the k radio sets schedule.k.

Each step appends the chosen action to the context (the action of the context's last frame, the one that leads
to the next frame), generates one frame with the DiagD sampler (the context as prompt frames), decodes it with
the VQ and shows it. The context is a sliding window: at most `window - 1` frames (window: 2 by default, the previous
frame only; null: the checkpoint's clip_frames, the longest clips the model was trained on). The
start frame(s): the first schedule.prompt_frames frames of held-out clip `prompt` (as in mcar.generate), or
`prompt_image`. The logic is `PlaySession` (no gradio); `build_app` is a thin gradio layer over it.
"""
from __future__ import annotations

import inspect
import json
import logging
import statistics
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, open_dict

from mcar.core.devices import set_threads
from mcar.core.layout import Layout
from mcar.core.sampler import ScheduleSampler, build_sampler
from mcar.eval.prompts import prompt_clip
from mcar.hydra_app import hydra_tool, to_dict
from mcar.tokenizer.pictures import data_action_space, decode_frames, to_u8

log = logging.getLogger("mcar.play")

# Crafter: key -> action (KeyboardEvent.key); the page also binds upper-case letters
KEYS = {"ArrowLeft": "move_left", "a": "move_left", "ArrowRight": "move_right", "d": "move_right",
        "ArrowUp": "move_up", "w": "move_up", "ArrowDown": "move_down", "s": "move_down", " ": "do"}
MOVES = ["move_left", "move_right", "move_up", "move_down"]


class PlaySession:
    """A model, its VQ and a sliding window of context frames; `step(action)` generates and decodes one frame.

    start: (P * frame_len,) or (P, frame_len) tokens of the start frame(s), their actions included (the last
    one is replaced by each step's action). window: frames per sampled clip (context + the generated frame).
    actions: name -> local action ids (n_a of them); steps may also give the ids themselves. Sampling is keyed by
    `seed + step number`: the same actions from a reset give the same frames."""

    def __init__(self, model, vq, layout: Layout, codebook_size: int, start: torch.Tensor, *, window: int,
                 sampler: dict | None = None, schedule: dict | None = None, actions: dict | None = None,
                 device: str | torch.device = "cpu", seed: int = 0):
        self.model, self.vq, self.layout, self.cb = model, vq, layout, codebook_size
        self.start = torch.as_tensor(start).long().reshape(-1, layout.frame_len).cpu()
        if window < 2 or len(self.start) >= window:
            raise ValueError(f"window={window} must be >= 2 and hold the {len(self.start)} start frame(s) + 1")
        self.window, self.device, self.seed = window, torch.device(device), seed
        self.sampler_cfg = dict(sampler or {"name": "diagd"})
        self.schedule_cfg = dict(schedule or {})
        self.k = int(self.schedule_cfg.get("k", 2))
        self.temperature = float(self.sampler_cfg.get("temperature", 1.0))
        self.top_k = self.sampler_cfg.get("top_k")
        self.actions = dict(actions or {})
        self._samplers: dict[tuple[int, int], ScheduleSampler] = {}
        self._lock = threading.Lock()
        self.reset()

    def fork(self, start: torch.Tensor | None = None) -> "PlaySession":
        """A new game from the start frame(s) (or `start`, tokens as in __init__) on the same model, VQ and
        samplers (built once, shared): one per browser session. Steps of every fork take the one lock: the model
        and its KV cache serve one at a time."""
        game = object.__new__(PlaySession)
        game.__dict__.update(self.__dict__)  # shares model, vq, start, _samplers, _lock, _start_frame
        if start is not None:
            game.start = torch.as_tensor(start).long().reshape(-1, self.layout.frame_len).cpu()[-(self.window - 1):]
            del game._start_frame
        game.k, game.temperature, game.top_k = int(self.schedule_cfg.get("k", 2)), \
            float(self.sampler_cfg.get("temperature", 1.0)), self.sampler_cfg.get("top_k")
        game.reset()
        return game

    # ---- the sampler ------------------------------------------------------------------------------------
    def sampler(self, frames: int | None = None) -> ScheduleSampler:
        """The DiagD sampler for a clip of `frames` frames (default: the next step's) at the current k: every
        frame but the last is a prompt frame."""
        frames = len(self.context) + 1 if frames is None else frames
        key = (self.k, frames)
        if key not in self._samplers:
            sched = {**self.schedule_cfg, "k": self.k, "prompt_frames": frames - 1}
            self._samplers[key] = build_sampler(self.sampler_cfg, self.layout, frames, self.cb, schedule=sched)
        return self._samplers[key]

    def set_k(self, k: int) -> dict:
        """schedule.k for the next steps (>= 1: how far each row runs ahead of the one below)."""
        k = int(k)
        if k < 1:
            raise ValueError(f"k={k} is invalid: it must be >= 1")
        with self._lock:
            old, self.k = self.k, k
            try:
                self.sampler()  # validated now (a d set in the schedule may not fit every k)
            except ValueError:
                self.k = old
                raise
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

    # ---- actions ----------------------------------------------------------------------------------------
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

    # ---- play -------------------------------------------------------------------------------------------
    def decode(self, frame_tokens: torch.Tensor) -> np.ndarray:
        """(frame_len,) tokens -> the frame's image, (H, W, 3) uint8."""
        ids = frame_tokens[: self.layout.frame_tokens].reshape(1, 1, self.layout.h, self.layout.w)
        return to_u8(decode_frames(self.vq, ids)[0])[0]

    def reset(self) -> tuple[np.ndarray, dict]:
        """Back to the start frame(s): the context is the start tokens; -> (the last start frame, info)."""
        with self._lock:
            self.context = self.start.clone()  # (n, frame_len), n <= window - 1
            self.steps = 0
            if not hasattr(self, "_start_frame"):
                self._start_frame = self.decode(self.start[-1])
            self.frame = self._start_frame.copy()
            self.info = {"action": "reset", "fps": None, "k": self.k, "temperature": self.temperature, "passes": 0,
                         "step": 0, "seconds": 0.0, "frames": len(self.context)}
            return self.frame, self.info

    def warm_up(self, action=None) -> float:
        """`window - 1` steps, then a reset: builds the samplers of every context length at the current k (and with
        sampler.compile=true compiles them) before the first key press; -> seconds taken."""
        t0 = time.perf_counter()
        action = action if action is not None else (next(iter(self.actions)) if self.actions else [0] * self.layout.n_a)
        self.reset()
        for _ in range(self.window - 1):
            self.step(action)
        self.reset()
        return time.perf_counter() - t0

    @torch.no_grad()
    def step(self, action) -> tuple[np.ndarray, dict]:
        """Take `action` from the current frame -> (the generated frame (H, W, 3) uint8, info: action, fps
        (of this step: sampling + decoding), k, passes, step, seconds, frames (context after the step))."""
        label, ids = self.action_ids(action)
        with self._lock:
            t0 = time.perf_counter()
            L, ft = self.layout.frame_len, self.layout.frame_tokens
            ctx = self.context.clone()
            ctx[-1, ft:] = torch.tensor(ids) + self.cb  # the action that leads to the next frame
            new = torch.full((1, L), 0, dtype=torch.long)
            new[0, ft:] = self.cb  # its action is not known yet (not seen by its image tokens): action 0
            clip = torch.cat([ctx, new]).reshape(1, -1).to(self.device)
            sampler = self.sampler(len(ctx) + 1)
            sampler.seed = self.seed + self.steps  # fresh noise each step, replayed after a reset
            sampler.temperature, sampler.top_k = self.temperature, self.top_k  # this game's (samplers are shared)
            tokens, stats = sampler.generate(self.model, clip)
            frame_tokens = tokens[0, -L:].cpu()
            self.context = torch.cat([ctx, frame_tokens[None]])[-(self.window - 1):]
            self.frame = self.decode(frame_tokens)
            self.steps += 1
            dt = time.perf_counter() - t0
            self.info = {"action": label, "fps": 1.0 / dt, "k": self.k, "temperature": self.temperature,
                         "passes": stats.passes, "step": self.steps, "seconds": dt, "frames": len(self.context)}
            return self.frame, self.info


def crafter_actions() -> dict[str, list[int]]:
    from mcar.tokenizer.actions import CRAFTER_ACTIONS, action_space

    space = action_space("crafter")
    return {name: space.encode({"action": name}) for name in CRAFTER_ACTIONS}


def start_clip(cfg: DictConfig, layout: Layout, frames: int, vq, prompt_frames: int) -> torch.Tensor:
    """The start frames: the first `prompt_frames` frames of held-out clip / episode `prompt`, or the tokens of
    `prompt_image` (then one start frame) -> (P, frame_len)."""
    if cfg.prompt_image:
        if prompt_frames != 1:
            raise ValueError(f"prompt_image gives one start frame: use schedule.prompt_frames=1 (not {prompt_frames})")
        cfg = cfg.copy()
        with open_dict(cfg):  # generate's image prompt: the image, then one (unused) action
            cfg.actions = [[0] * layout.n_a] if layout.n_a > 1 else [0]
    clip, _, _ = prompt_clip(cfg, layout, frames, vq)
    return clip.reshape(-1, layout.frame_len)[:prompt_frames]


def build_session(cfg: DictConfig) -> PlaySession:
    """play.yaml -> a PlaySession on the checkpoint, its data's VQ and the start frame(s)."""
    from mcar.eval.generation import load_for_sampling

    torch.manual_seed(cfg.seed)
    set_threads(cfg.threads)
    module, hp, vq, device = load_for_sampling(cfg)
    layout, cb = module.layout, cfg.data.codebook_size
    window = int(cfg.window or hp["clip_frames"])
    schedule = to_dict(cfg.schedule)
    P = int(schedule.get("prompt_frames", 1))
    if P >= window:
        raise ValueError(f"schedule.prompt_frames={P} start frames leave no room in a window of {window} frames: "
                         f"set window={P + 1} or more (null: the checkpoint's {hp['clip_frames']})")
    start = start_clip(cfg, layout, window, vq, P)
    actions = crafter_actions() if data_action_space(cfg.data) == "crafter" else {}
    return PlaySession(module.model, vq, layout, cb, start, window=window, sampler=to_dict(cfg.sampler),
                       schedule=schedule, actions=actions, device=device, seed=cfg.seed)


# ---- the page ---------------------------------------------------------------------------------------------
K_HELP = ("**k** is DiagD's slope: row i of the next frame starts k tokens after row i - 1, so a frame takes "
          "(h - 1)·k + w model passes instead of h·w. Small k: fewer passes, a faster step; large k: each token "
          "sees more of the row above it. **temperature** 0 takes the most likely token everywhere (the steadiest "
          "world); higher values sample more freely (more variety, more drift).")


def describe(info: dict) -> str:
    fps = "-" if info["fps"] is None else f"{info['fps']:.2f}"
    return (f"**{info['action']}** &nbsp; {fps} frames/s &nbsp; k={info['k']} ({info['passes']} passes) &nbsp; "
            f"temperature {info.get('temperature', '-')} &nbsp; step {info['step']}, context {info['frames']} "
            f"frame(s)")


class Games:
    """One game per browser session, forked from the loaded session (its model, VQ and samplers are shared);
    `live` counts the games a session still holds (gradio drops one after the session's idle time)."""

    def __init__(self, base: PlaySession):
        self.base, self.live, self._lock = base, 0, threading.Lock()

    def of(self, game: PlaySession | None) -> PlaySession:
        """The session's game; a new one (from the start frame) for a session that has none yet."""
        if game is not None:
            return game
        with self._lock:
            self.live += 1
        return self.base.fork()

    def dropped(self, game: PlaySession | None) -> None:
        if game is not None:
            with self._lock:
                self.live -= 1
            log.info("mcar.play: an idle game was dropped after %d step(s); %d live", game.steps, self.live)


def key_script(keys: dict[str, str]) -> str:
    """Browser JS: a key of `keys` clicks the button `play-<action>` (not while typing in a field)."""
    table = {**keys, **{k.upper(): v for k, v in keys.items() if len(k) == 1 and k.isalpha()}}
    return """() => {
  const keys = %s;
  if (window.__mcarPlayKeys) return;
  window.__mcarPlayKeys = true;
  document.addEventListener('keydown', (e) => {
    const t = e.target;
    if (t && (t.tagName === 'TEXTAREA' || (t.tagName === 'INPUT' && t.type !== 'radio' && t.type !== 'range'))) return;
    const name = keys[e.key];
    if (!name) return;
    const b = document.getElementById('play-' + name);
    if (!b) return;
    e.preventDefault();
    (b.tagName === 'BUTTON' ? b : b.querySelector('button') || b).click();
  });
}""" % json.dumps(table)


def build_app(session: PlaySession, buttons=(), ks=(1, 2, 3, 4), title: str = "mcar play", idle_minutes: float = 30,
              cache_seconds: int = 120):
    """A gradio Blocks page over `session`: the frame, the action/fps line, k and temperature, reset and one button
    per action (the moves, then `buttons`); keys as in KEYS when the session knows those actions. Every browser
    session plays its own game (a gr.State holding a fork of `session`), dropped after `idle_minutes` without a
    step; the frames' temporary PNGs older than `cache_seconds` are deleted. -> the page (`demo.games`: Games)."""
    import gradio as gr

    names = [a for a in dict.fromkeys([*MOVES, "do", *buttons]) if a in session.actions] or \
        [str(i) for i in range(len(session.actions) or 0)]
    keys = {k: v for k, v in KEYS.items() if v in names}
    ks = sorted({int(k) for k in ks} | {session.k})
    games = Games(session)

    def take(name, game):
        game = games.of(game)
        frame, info = game.step(name)
        return frame, describe(info), game

    def reset(game):
        game = games.of(game)
        frame, info = game.reset()
        return frame, describe(info), game

    def change_k(k, game):
        game = games.of(game)
        return describe(game.set_k(int(k))), game

    def change_temperature(t, game):
        game = games.of(game)
        return describe(game.set_temperature(float(t))), game

    def opened(game):  # a (re)loaded page shows its own game and that game's k and temperature
        game = games.of(game)
        return game.frame, describe(game.info), game.k, game.temperature, game

    # lossless frames where the Image component can say so (gradio >= 4.x's `format`; webp is the default)
    png = {"format": "png"} if "format" in inspect.signature(gr.Image.__init__).parameters else {}
    cache = {"delete_cache": (cache_seconds, cache_seconds)} if cache_seconds and \
        "delete_cache" in inspect.signature(gr.Blocks.__init__).parameters else {}
    serial = {"concurrency_limit": 1, "concurrency_id": "play"}  # one model: steps of all sessions take turns
    with gr.Blocks(title=title, analytics_enabled=False, **cache) as demo:
        game = gr.State(None, time_to_live=idle_minutes * 60 if idle_minutes else None,
                        delete_callback=games.dropped)
        gr.Markdown(f"### {title}\n" + ("Arrow keys or WASD move, space is `do`; " if keys else "")
                    + "the buttons take an action; each step generates the next frame with DiagD.")
        with gr.Row():
            image = gr.Image(value=session.frame, type="numpy", label="frame", interactive=False,
                             elem_id="play-frame", **png)
            with gr.Column():
                info = gr.Markdown(describe(session.info), elem_id="play-info")
                k = gr.Radio(choices=ks, value=session.k, label="k (DiagD)", elem_id="play-k")
                temperature = gr.Slider(0, 1.5, value=session.temperature, step=0.05, label="temperature",
                                        elem_id="play-temperature")
                reset_button = gr.Button("reset", elem_id="play-reset")
                gr.Markdown(K_HELP, elem_id="play-help")
        with gr.Row():
            for name in names:
                b = gr.Button(name, elem_id=f"play-{name}", size="sm")
                b.click(partial(take, name), game, [image, info, game], api_name=f"step_{name}", **serial)
        reset_button.click(reset, game, [image, info, game], api_name="reset", **serial)
        k.input(change_k, [k, game], [info, game], api_name="set_k", **serial)
        temperature.release(change_temperature, [temperature, game], [info, game], api_name="set_temperature",
                            **serial)
        demo.load(opened, game, [image, info, k, temperature, game], api_name="open", **serial)
        demo.load(None, None, None, js=key_script(keys))
    demo.games = games
    return demo


def serving_port(host: str, port: int, tries: int = 100) -> int:
    """`port` when it is free on `host`, else the next free one of the `tries` after it (said in the log)."""
    import socket

    for candidate in range(port, port + tries):
        with socket.socket() as s:
            try:
                s.bind((host, candidate))
            except OSError:
                continue
        if candidate != port:
            log.warning("mcar.play: port %d is taken: serving on %d instead", port, candidate)
        return candidate
    raise OSError(f"port={port}: it and the {tries - 1} after it are taken on {host}; pick another (port=...)")


def bench_session(session: PlaySession, ks, actions, steps: int, repeats: int) -> dict:
    """The page's speed without the page: for each k, `repeats` rounds of `steps` steps (the actions in turn), each
    round from a reset and after window - 1 untimed steps -> {"ks": {k: {"frames_per_s": median of the rounds' steps /
    seconds, "rounds": [...], "passes": per frame}}, "window", "threads"}. Rounds replay the same frames."""
    if steps < 1 or repeats < 1:
        raise ValueError(f"bench.steps={steps} and bench.repeats={repeats} must be >= 1")
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
    return {"ks": out, "window": session.window, "threads": torch.get_num_threads(), "steps": steps}


def print_bench(result: dict, out: str) -> None:
    """One JSON line to stdout and to `out`."""
    line = json.dumps(result)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(line + "\n")
    print(line, flush=True)


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
            ids = (frames[t - 1, ft:] - session.cb).tolist()  # the real action, as local ids
            game.step(ids if len(ids) > 1 else ids[0])
            real = frames[t, :ft]
            row.append((game.context[-1, :ft] == real).float().mean().item())
            row_still.append((frames[0, :ft] == real).float().mean().item())
        agree.append(row), still.append(row_still)
    per_step = [round(statistics.fmean(col), 4) for col in zip(*agree)]
    return {"agreement": per_step, "copy_first": [round(statistics.fmean(col), 4) for col in zip(*still)],
            "final": per_step[-1], "mean": round(statistics.fmean(per_step), 4), "clips": len(clips)}


def play(cfg: DictConfig, block: bool = True):
    """Build the session and serve its page on cfg.host:cfg.port; -> (demo, session). With bench.steps > 0, time
    the session instead (no page, no gradio): prints one JSON line, also written to bench.out; -> (None, session)."""
    if cfg.bench.rollouts:
        from mcar.eval.generation import held_out_source, pick_clips

        session = build_session(cfg)
        source = held_out_source(cfg, int(cfg.bench.rollout_steps) + 1)
        clips = [source.clip(i) for i in pick_clips(source, int(cfg.bench.rollouts))]
        result = {"ckpt": str(cfg.ckpt), "sampler": session.sampler_cfg.get("name"), "k": session.k,
                  "temperature": session.temperature, "top_k": session.top_k, "window": session.window,
                  "steps": int(cfg.bench.rollout_steps), **rollout_agreement(session, clips)}
        return print_bench(result, cfg.bench.out), session
    if cfg.bench.steps:
        session = build_session(cfg)
        result = {"ckpt": str(cfg.ckpt), "device": str(session.device), "sampler": session.sampler_cfg.get("name"),
                  **bench_session(session, list(cfg.bench.ks or cfg.ks), list(cfg.bench.actions),
                                  int(cfg.bench.steps), int(cfg.bench.repeats))}
        return print_bench(result, cfg.bench.out), session
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise RuntimeError("mcar play needs gradio: pip install -e '.[play]'") from None
    session = build_session(cfg)
    log.info("mcar.play: warming up at k=%d (with sampler.compile=true this compiles, ~1 min on CPU)", session.k)
    log.info("mcar.play: warm-up took %.1f s", session.warm_up())
    demo = build_app(session, buttons=list(cfg.buttons), ks=list(cfg.ks), idle_minutes=cfg.idle_minutes,
                     cache_seconds=cfg.cache_seconds)
    port = serving_port(cfg.host, int(cfg.port))
    log.info("mcar.play: %s, window %d frames, k=%d, temperature %g: http://%s:%d", cfg.ckpt, session.window,
             session.k, session.temperature, cfg.host, port)
    demo.queue().launch(server_name=cfg.host, server_port=port, prevent_thread_lock=not block,
                        inbrowser=False, share=False, quiet=True)
    return demo, session


@hydra_tool("play")
def main(cfg: DictConfig) -> None:
    play(cfg)
