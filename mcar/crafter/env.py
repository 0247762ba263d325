"""Crafter behind mcar's environment protocol (mcar.data.environment): reset(seed) -> frame, step(action) ->
(frame, info) with the player's position, and save_state / restore_state (the whole world copied: its random
state too, so a restored world goes on as the saved one would have).
"""
from __future__ import annotations

import copy

import numpy as np

from mcar.crafter.gen import make_env, pin_daylight, player_pos


class CrafterEnv:
    """Fresh Crafter worlds drawn at (H, W) = `size`, `view` tiles (W, H; None: Crafter's 9x9), at a fixed
    `daylight` (None: the day-night cycle). `.env` is the crafter.Env being played (for Crafter's own policies and
    tests, mcar.crafter.gen); info: {"done", "pos": the player's world (x, y) after the step, "reward"}."""

    def __init__(self, size, view=None, daylight: float | None = None):
        self.size, self.view, self.daylight = tuple(size), view, daylight
        self.env, self.frame = None, None

    def reset(self, seed: int) -> np.ndarray:
        self.env, self.frame = make_env(seed, self.size, self.view, self.daylight)
        return self.frame

    def step(self, action: int) -> tuple[np.ndarray, dict]:
        if self.env is None:
            raise RuntimeError("CrafterEnv.step before reset(seed): no world yet")
        self.frame, reward, done, _ = self.env.step(int(action))
        return self.frame, {"done": bool(done), "pos": player_pos(self.env), "reward": float(reward)}

    @property
    def pos(self) -> tuple[int, int]:
        return player_pos(self.env)

    def save_state(self):
        return copy.deepcopy((self.env, self.frame))

    def restore_state(self, state) -> np.ndarray:
        self.env, self.frame = copy.deepcopy(state)
        pin_daylight(self.env, self.daylight)
        return self.frame
