"""The environment protocol: a simulator as the world tests (mcar.eval.world_tests) and post-training's rewards
take it. Frames are (H, W, 3) uint8 at the data's frame size, actions the data's action ids. Crafter's is the first
(mcar.crafter.env.CrafterEnv); any simulator with these two calls plugs in.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Environment(Protocol):
    def reset(self, seed: int) -> np.ndarray:
        """A fresh world, the same for the same seed -> its first frame."""

    def step(self, action: int) -> tuple[np.ndarray, dict]:
        """One action -> (the next frame, info): info["done"] is whether the episode ended; anything else the
        simulator tells (Crafter: the player's position "pos") rides along for the tests that read it."""


@runtime_checkable
class SavesState(Protocol):
    """An environment whose state can be kept and gone back to (a branch point: several futures from one frame)."""

    def save_state(self) -> Any:
        """-> the whole state now, untouched by later steps."""

    def restore_state(self, state: Any) -> np.ndarray:
        """Back to a saved state (it stays usable again) -> the frame seen there."""
