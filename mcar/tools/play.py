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
        self.actions = dict(actions or {})
        self._samplers: dict[tuple[int, int], ScheduleSampler] = {}
        self._lock = threading.Lock()
        self.reset()

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
            self.info = {"action": "reset", "fps": None, "k": self.k, "passes": 0, "step": 0, "seconds": 0.0,
                         "frames": len(self.context)}
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
            tokens, stats = sampler.generate(self.model, clip)
            frame_tokens = tokens[0, -L:].cpu()
            self.context = torch.cat([ctx, frame_tokens[None]])[-(self.window - 1):]
            self.frame = self.decode(frame_tokens)
            self.steps += 1
            dt = time.perf_counter() - t0
            self.info = {"action": label, "fps": 1.0 / dt, "k": self.k, "passes": stats.passes, "step": self.steps,
                         "seconds": dt, "frames": len(self.context)}
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
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
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
def describe(info: dict) -> str:
    fps = "-" if info["fps"] is None else f"{info['fps']:.2f}"
    return (f"**{info['action']}** &nbsp; {fps} frames/s &nbsp; k={info['k']} ({info['passes']} passes) &nbsp; "
            f"step {info['step']}, context {info['frames']} frame(s)")


def key_script(keys: dict[str, str]) -> str:
    """Browser JS: a key of `keys` clicks the button `play-<action>` (not while typing in a field)."""
    import json

    table = {**keys, **{k.upper(): v for k, v in keys.items() if len(k) == 1 and k.isalpha()}}
    return """() => {
  const keys = %s;
  if (window.__mcarPlayKeys) return;
  window.__mcarPlayKeys = true;
  document.addEventListener('keydown', (e) => {
    const t = e.target;
    if (t && (t.tagName === 'TEXTAREA' || (t.tagName === 'INPUT' && t.type !== 'radio'))) return;
    const name = keys[e.key];
    if (!name) return;
    const b = document.getElementById('play-' + name);
    if (!b) return;
    e.preventDefault();
    (b.tagName === 'BUTTON' ? b : b.querySelector('button') || b).click();
  });
}""" % json.dumps(table)


def build_app(session: PlaySession, buttons=(), ks=(1, 2, 3, 4), title: str = "mcar play"):
    """A gradio Blocks page over `session`: the frame, the action/fps line, the k choice, reset and one button per
    action (the moves, then `buttons`); keys as in KEYS when the session knows those actions."""
    import gradio as gr

    names = [a for a in dict.fromkeys([*MOVES, "do", *buttons]) if a in session.actions] or \
        [str(i) for i in range(len(session.actions) or 0)]
    keys = {k: v for k, v in KEYS.items() if v in names}
    ks = sorted({int(k) for k in ks} | {session.k})

    def show(frame_info):
        frame, info = frame_info
        return frame, describe(info)

    def take(name):
        return show(session.step(name))

    def change_k(k):
        return describe(session.set_k(int(k)))

    # lossless frames where the Image component can say so (gradio >= 4.x's `format`; webp is the default)
    png = {"format": "png"} if "format" in inspect.signature(gr.Image.__init__).parameters else {}
    with gr.Blocks(title=title, analytics_enabled=False) as demo:
        gr.Markdown(f"### {title}\n" + ("Arrow keys or WASD move, space is `do`; " if keys else "")
                    + "the buttons take an action; each step generates the next frame with DiagD.")
        with gr.Row():
            image = gr.Image(value=session.frame, type="numpy", label="frame", interactive=False,
                             elem_id="play-frame", **png)
            with gr.Column():
                info = gr.Markdown(describe(session.info), elem_id="play-info")
                k = gr.Radio(choices=ks, value=session.k, label="schedule.k (DiagD)", elem_id="play-k")
                reset = gr.Button("reset", elem_id="play-reset")
        with gr.Row():
            for name in names:
                b = gr.Button(name, elem_id=f"play-{name}", size="sm")
                b.click(partial(take, name), None, [image, info], concurrency_limit=1, concurrency_id="play")
        reset.click(lambda: show(session.reset()), None, [image, info], concurrency_limit=1, concurrency_id="play")
        k.change(change_k, k, info, concurrency_limit=1, concurrency_id="play")
        demo.load(lambda: (session.frame, describe(session.info)), None, [image, info])
        demo.load(None, None, None, js=key_script(keys))
    return demo


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


def play(cfg: DictConfig, block: bool = True):
    """Build the session and serve its page on cfg.host:cfg.port; -> (demo, session). With bench.steps > 0, time
    the session instead (no page, no gradio): prints one JSON line, also written to bench.out; -> (None, session)."""
    if cfg.bench.steps:
        session = build_session(cfg)
        result = {"ckpt": str(cfg.ckpt), "device": str(session.device), "sampler": session.sampler_cfg.get("name"),
                  **bench_session(session, list(cfg.bench.ks or cfg.ks), list(cfg.bench.actions),
                                  int(cfg.bench.steps), int(cfg.bench.repeats))}
        line = json.dumps(result)
        Path(cfg.bench.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.bench.out).write_text(line + "\n")
        print(line, flush=True)
        return None, session
    try:
        import gradio  # noqa: F401
    except ImportError as e:
        raise ImportError("mcar.play needs gradio: pip install -e '.[play]'") from e
    session = build_session(cfg)
    log.info("mcar.play: warming up at k=%d (with sampler.compile=true this compiles, ~1 min on CPU)", session.k)
    log.info("mcar.play: warm-up took %.1f s", session.warm_up())
    demo = build_app(session, buttons=list(cfg.buttons), ks=list(cfg.ks))
    log.info("mcar.play: %s, window %d frames, k=%d: http://%s:%d", cfg.ckpt, session.window, session.k, cfg.host,
             cfg.port)
    demo.queue().launch(server_name=cfg.host, server_port=cfg.port, prevent_thread_lock=not block,
                        inbrowser=False, share=False)
    return demo, session


@hydra_tool("play")
def main(cfg: DictConfig) -> None:
    play(cfg)
