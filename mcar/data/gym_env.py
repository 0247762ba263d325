"""Any Gymnasium game that renders pixels, as mcar sees a game: its action schema, its actions as records, and the
environment protocol (reset(seed) -> frame; step(action) -> frame, info; save_state/restore_state where the
simulator has them: the Arcade Learning Environment's cloneState/restoreState).

    env = GymGame("ALE/Pong-v5")            # pip install gymnasium ale-py (the Atari ROMs ship inside ale-py)
    frame = env.reset(seed=3)               # (H, W, 3) uint8, env.render()
    frame, info = env.step(env.schema_action(2))

The schema (mcar.tokenizer.action_schema) follows the action space: Discrete -> one choice (ALE: its action
meanings, NOOP, FIRE, UP, ...), MultiBinary -> keys, MultiDiscrete -> a choice per part, Box -> a uniform axis
per element over its bounds, Dict/Tuple -> their parts, prefixed by their keys.
"""
from __future__ import annotations

import importlib
import json
import time
from pathlib import Path

import numpy as np
import yaml
from tqdm import tqdm

from mcar.atomic import write_atomic
from mcar.tokenizer.video import write_mp4

BOX_BINS = 21
PLAY_KEYS = {"ArrowUp": "UP", "ArrowDown": "DOWN", "ArrowLeft": "LEFT", "ArrowRight": "RIGHT", " ": "FIRE"}


def require_gymnasium():
    try:
        import gymnasium
    except ImportError:
        raise SystemExit("Gymnasium games need gymnasium (and ale-py for Atari): pip install gymnasium ale-py") \
            from None
    try:
        import ale_py

        gymnasium.register_envs(ale_py)  # ALE/<Game>-v5 ids
    except ImportError:
        pass
    return gymnasium


def space_parts(space, prefix: str, names=None) -> list[dict]:
    """A Gymnasium space -> schema entries (their `name` is where the record keeps the value)."""
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        choices = list(names) if names is not None else [int(space.start) + i for i in range(int(space.n))]
        return [{"name": prefix or "action", "type": "choice", "choices": choices}]
    if isinstance(space, spaces.MultiBinary):
        n = int(np.prod(space.shape))
        return [{"name": prefix or "buttons", "type": "keys", "keys": [f"b{i}" for i in range(n)]}]
    if isinstance(space, spaces.MultiDiscrete):
        return [{"name": f"{prefix or 'part'}{i}", "type": "choice", "choices": list(range(int(n)))}
                for i, n in enumerate(np.asarray(space.nvec).ravel())]
    if isinstance(space, spaces.Box):
        lo, hi = np.broadcast_to(space.low, space.shape).ravel(), np.broadcast_to(space.high, space.shape).ravel()
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
            raise ValueError(f"action space {space}: an unbounded Box has no bins; wrap the env to clip its actions "
                             f"(gymnasium.wrappers.ClipAction) or record with a schema of your own")
        return [{"name": f"{prefix or 'axis'}{i}", "type": "axis", "range": [float(a), float(b)],
                 "bins": BOX_BINS} for i, (a, b) in enumerate(zip(lo, hi))]
    if isinstance(space, spaces.Dict):
        return [p for key, sub in space.spaces.items() for p in space_parts(sub, f"{prefix}{key}.")]
    if isinstance(space, spaces.Tuple):
        return [p for i, sub in enumerate(space.spaces) for p in space_parts(sub, f"{prefix}{i}.")]
    raise ValueError(f"action space {type(space).__name__} has no action schema here: Discrete, MultiBinary, "
                     f"MultiDiscrete, Box, Dict or Tuple")


def action_record(space, action, prefix: str = "", names=None) -> dict:
    """A Gymnasium action -> its record under `space_parts`' names (JSON-ready)."""
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        i = int(action)
        return {prefix or "action": names[i - int(space.start)] if names is not None else i}
    if isinstance(space, spaces.MultiBinary):
        return {prefix or "buttons": [f"b{i}" for i, v in enumerate(np.asarray(action).ravel()) if v]}
    if isinstance(space, spaces.MultiDiscrete):
        return {f"{prefix or 'part'}{i}": int(v) for i, v in enumerate(np.asarray(action).ravel())}
    if isinstance(space, spaces.Box):
        return {f"{prefix or 'axis'}{i}": float(v) for i, v in enumerate(np.asarray(action, float).ravel())}
    subs = space.spaces.items() if isinstance(space, spaces.Dict) else enumerate(space.spaces)  # Dict, Tuple
    return {k: v for key, sub in subs for k, v in action_record(sub, action[key], f"{prefix}{key}.").items()}


class GymGame:
    """A Gymnasium env id played through the environment protocol (mcar.data.environment), frames from `render()`,
    resized to `size` = (H, W) when given (the data's frame size: as the recordings' frames are read)."""

    def __init__(self, env_id: str, size: tuple[int, int] | None = None, **make_kwargs):
        gym = require_gymnasium()
        try:
            self.env = gym.make(env_id, render_mode="rgb_array", **make_kwargs)
        except gym.error.Error as e:
            raise ValueError(f"env={env_id}: {str(e).splitlines()[0]} (ALE games: pip install ale-py; ids like "
                             f"ALE/Pong-v5)") from None
        self.env_id, self.space, self.size = env_id, self.env.action_space, size
        meanings = getattr(self.env.unwrapped, "get_action_meanings", None)
        self.names = list(meanings()) if meanings is not None and hasattr(self.space, "n") else None

    def schema(self) -> dict:
        """The action schema of this game's action space, with its frame rate and play keys where known."""
        schema: dict = {"actions": space_parts(self.space, "", self.names)}
        if self.names is not None:
            schema["moves"] = [n for n in ("UP", "DOWN", "LEFT", "RIGHT") if n in self.names]
            schema["play_keys"] = [[k, n] for k, n in PLAY_KEYS.items() if n in self.names]
        fps = self.env.metadata.get("render_fps")
        skip = (self.env.spec.kwargs or {}).get("frameskip") if self.env.spec is not None else None
        if fps:
            schema["fps"] = float(fps) / skip if isinstance(skip, int) and skip > 0 else float(fps)
        return schema

    def data_id(self, action) -> int:
        """A Discrete game's own action -> its data action id (the choice's index), what `step` takes."""
        return int(action) - int(self.space.start)

    def record(self, action) -> dict:
        return action_record(self.space, action, "", self.names)

    def reset(self, seed: int | None = None) -> np.ndarray:
        self.env.reset(seed=seed)
        self.space.seed(seed)
        return self.frame()

    def step(self, action) -> tuple[np.ndarray, dict]:
        """A Discrete game takes its data action id (the choice's index) as its own action."""
        if hasattr(self.space, "n"):
            action = int(action) + int(self.space.start)
        _, reward, terminated, truncated, info = self.env.step(action)
        return self.frame(), {**info, "reward": float(reward), "done": bool(terminated or truncated)}

    def frame(self) -> np.ndarray:
        frame = np.ascontiguousarray(self.env.render(), dtype=np.uint8)
        if self.size is None or frame.shape[:2] == tuple(self.size):
            return frame
        import av  # the resize the recordings' frames get when read (mcar.tokenizer.video.FrameStream)

        return av.VideoFrame.from_ndarray(frame, format="rgb24").to_ndarray(
            format="rgb24", width=int(self.size[1]), height=int(self.size[0]))

    def save_state(self):
        """The simulator's state (ALE: cloneState), or None where the game has none to give."""
        ale = getattr(self.env.unwrapped, "ale", None)
        return ale.cloneState() if ale is not None else None

    def restore_state(self, state) -> np.ndarray:
        ale = getattr(self.env.unwrapped, "ale", None)
        if ale is None or state is None:
            raise ValueError(f"{self.env_id} cannot restore a state: only games with cloneState/restoreState")
        ale.restoreState(state)
        return self.frame()

    def close(self) -> None:
        self.env.close()


# ------------------------------------------------------------------------------------------------ policies
class RandomPolicy:
    """Each step a fresh action from the space (seeded)."""

    def __init__(self, space, rng: np.random.Generator):
        self.space, self.rng = space, rng
        self.space.seed(int(rng.integers(2**31)))

    def __call__(self, frame) -> object:
        return self.space.sample()


class StickyPolicy(RandomPolicy):
    """Bursts: an action held for a random run of steps (geometric, mean `hold`), so the data shows what a held
    action does (a paddle crossing the screen, a ship turning around) as well as every action's first effect."""

    def __init__(self, space, rng: np.random.Generator, hold: float = 6.0):
        super().__init__(space, rng)
        self.hold, self.left, self.action = float(hold), 0, None

    def __call__(self, frame) -> object:
        if self.left <= 0:
            self.action, self.left = self.space.sample(), int(self.rng.geometric(1 / self.hold))
        self.left -= 1
        return self.action


POLICIES = {"random": RandomPolicy, "sticky": StickyPolicy}


# ------------------------------------------------------------------------------------------------ recording
def make_policy(name: str, space, rng: np.random.Generator, hold: float):
    """policy=random|sticky, or `package.module:factory` (imported because it was named: factory(space, rng))."""
    if name == "sticky":
        return StickyPolicy(space, rng, hold)
    if name in POLICIES:
        return POLICIES[name](space, rng)
    if ":" not in name:
        raise ValueError(f"policy={name!r}: random, sticky or package.module:factory")
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)(space, rng)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"policy={name}: {e}") from None


def play_episode(game: GymGame, policy, seed: int, frames: int) -> tuple[list[np.ndarray], list[dict]]:
    """Up to `frames` frames from reset(seed), each with the action the policy took at it."""
    frame, shown, records = game.reset(seed), [], []
    for _ in range(frames):
        action = policy(frame)
        shown.append(frame)
        records.append(game.record(action))
        frame, info = game.step(game.data_id(action) if hasattr(game.space, "n") else action)
        if info["done"]:
            break
    return shown, records


def record_folder(env: str, out, episodes: int, frames: int, policy: str = "sticky", hold: float = 6.0,
                  seed: int = 0, make: dict | None = None, lossless: bool = True) -> dict:
    """Play `episodes` episodes of `env` (at most `frames` frames each) into the recordings folder `out`:
    <name>.mp4 + <name>.jsonl each and actions.yaml. Episodes already there are kept (a stopped run resumes);
    each is written whole or not at all (its jsonl, then its mp4, each renamed into place). -> a summary."""
    out = Path(out)
    game = GymGame(env, **(make or {}))
    schema = game.schema()
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "actions.yaml", yaml.safe_dump(schema, sort_keys=False).encode())
    fps = schema.get("fps") or 15
    codec = dict(codec="libx264rgb", pix_fmt="rgb24", crf=0) if lossless else dict(crf=12, pix_fmt="yuv444p")
    written, kept, t0 = 0, 0, time.perf_counter()
    stem = env.replace("/", "_")
    for i in tqdm(range(episodes), desc=f"recording {env}", unit="ep"):
        name = f"{stem}_s{seed + i:05d}"
        if (out / f"{name}.mp4").exists():
            kept += 1
            continue
        rng = np.random.default_rng(seed + i)
        shown, records = play_episode(game, make_policy(policy, game.space, rng, hold), seed + i, frames)
        write_atomic(out / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
        write_mp4(shown, out / f"{name}.mp4", fps, **codec)  # last: a present mp4 is a finished episode
        written += len(shown)
    game.close()
    seconds = time.perf_counter() - t0
    summary = {"out": str(out), "episodes": episodes, "kept": kept, "frames": written,
               "seconds": round(seconds, 1), "n_a": len(schema["actions"])}
    print(f"{env}: {episodes - kept} episodes ({written} frames) in {seconds:.1f} s -> {out}"
          f"{f' ({kept} kept from before)' if kept else ''}; train: python train.py data=recordings data.root={out}")
    return summary


# ------------------------------------------------------------------------------------------------ post-training
class GymStarts:
    """Post-training's source (mcar.data.starts.StartsDataModule) for a Gymnasium game: game seed -> its true clips
    under a policy (the simulator's real next frames from the same state, which rollouts are scored against),
    tokenised by the data's VQ, each with (frames, 2) zero positions (a game tells no player position). A random
    warm-up of up to `warmup` steps, then `clips_per_world` x `frames` frames; a game that ends first is skipped and
    counted (`dead`)."""

    def __init__(self, env: str, layout, codebook_size: int, frames: int, vq_path: str | None,
                 policy: str = "sticky", hold: float = 6.0, warmup: int = 16, clips_per_world: int = 1,
                 make: dict | None = None):
        from mcar.tokenizer.vq_model import frame_size, load_vq

        if not env:
            raise ValueError("posttrain.data.source.env is null: the Gymnasium id of the checkpoint's game (its "
                             "data.record.env, when its recordings were made on first use)")
        if clips_per_world < 1 or warmup < 0:
            raise ValueError(f"clips_per_world={clips_per_world}, warmup={warmup}: at least 1 clip, warm-up >= 0")
        self.layout, self.codebook_size, self.frames, self.warmup = layout, codebook_size, frames, warmup
        self.clips_per_world, self.policy, self.hold = clips_per_world, policy, hold
        self.vq = load_vq(vq_path)
        self.game = GymGame(env, size=frame_size(self.vq, layout.h, layout.w), **(make or {}))
        self.dead = 0

    def __call__(self, seed: int) -> list:
        import torch

        from mcar.tokenizer.clips import join_clip
        from mcar.tokenizer.vq_model import encode_tokens

        rng = np.random.default_rng(seed)
        policy = make_policy(self.policy, self.game.space, rng, self.hold)
        n = self.frames * self.clips_per_world
        frame, shown, actions = self.game.reset(seed), [], []
        for _ in range(int(rng.integers(0, self.warmup + 1)) + n):
            action = policy(frame)
            shown.append(frame)
            actions.append(self.game.data_id(action))
            frame, info = self.game.step(actions[-1])
            if info["done"]:
                self.dead += 1
                return []
        with torch.no_grad():
            images = encode_tokens(self.vq, torch.from_numpy(np.stack(shown[-n:])))
        clip = join_clip(images, torch.tensor(actions[-n:])[:, None], self.codebook_size)
        zeros = torch.zeros(self.clips_per_world, self.frames, 2, dtype=torch.long)
        return list(zip(clip.view(self.clips_per_world, -1), zeros))
