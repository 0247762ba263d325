"""Action tokenizers: one action dict per frame -> `n_a` token ids in [0, vocab_size).

The data pipeline adds the image codebook size to these ids, so actions live after the codebook in one vocabulary.

- `vpt`: MineWorld's layout, 11 tokens per frame
      [bos, camera pitch, camera yaw, hotbar, forward|back, left|right, sprint|sneak, use|attack, jump,
       drop|pickItem, eos]
  Each slot owns a contiguous id range (`VPT_SLOTS`), so a token id alone says what it is. A pair with both
  keys pressed is null. Camera degrees are mu-law quantised (maxval 90, binsize 9, mu 11.4887: 21 bins, 0° at
  bin 10), as VPT's CameraQuantizer does.
- `mineworld`: the same 11 slots and action dicts with the public MineWorld code's ids (its mcdataset.py): 23
  buttons (use, attack, forward, back, left, right, jump, sneak, sprint, drop, swapHands, pickItem, inventory,
  ESC, hotbar.1-9), the pitch and yaw bins, then <act_bos>, <null_act>, <act_eos>; 70 ids (its vocabulary of 8,262
  = 8,192 codes + 70), for checkpoints converted with `mcar convert format=mineworld`.
- `crafter`: one token per frame, the id of Crafter's action (17). Crafter's action is a single discrete choice,
  so one token carries it exactly and keeps frames short (336 + 1 slots).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mcar.tokenizer.action_schema import ActionSpace, SchemaActions

# ------------------------------------------------------------------------------------------------ camera
CAM_MAXVAL, CAM_BINSIZE, CAM_MU = 90.0, 9.0, 11.4887
CAM_BINS = int(2 * CAM_MAXVAL / CAM_BINSIZE) + 1  # 21
CAM_ZERO_BIN = CAM_BINS // 2  # 10


def camera_to_bin(deg: float) -> int:
    """Mu-law quantisation of a camera angle in degrees -> bin in [0, 21)."""
    x = np.clip(deg, -CAM_MAXVAL, CAM_MAXVAL) / CAM_MAXVAL
    x = np.sign(x) * np.log1p(CAM_MU * abs(x)) / np.log1p(CAM_MU) * CAM_MAXVAL
    return int(np.round((x + CAM_MAXVAL) / CAM_BINSIZE))


def bin_to_camera(b: int) -> float:
    """Bin centre in degrees (the inverse of the mu-law)."""
    x = (b * CAM_BINSIZE - CAM_MAXVAL) / CAM_MAXVAL
    return float(np.sign(x) * ((1 + CAM_MU) ** abs(x) - 1) / CAM_MU * CAM_MAXVAL)


def pressed_label(action: dict) -> str:
    """A VPT action dict -> its pressed keys, camera move and hotbar in a few characters ("noop" for none)."""
    keys = [k for k, v in action.items() if k not in ("camera", "hotbar") and v]
    cam = action["camera"]
    if abs(cam[0]) > 0.5 or abs(cam[1]) > 0.5:
        keys.append(f"cam{cam[0]:+.0f},{cam[1]:+.0f}")
    if action["hotbar"]:
        keys.append(f"hb{action['hotbar']}")
    return " ".join(keys) or "noop"


# ------------------------------------------------------------------------------------------------ vpt
PAIRS = [("forward", "back"), ("left", "right"), ("sprint", "sneak"), ("use", "attack"), ("jump", None),
         ("drop", "pickItem")]
# (slot name, number of ids); ids of slot k start at the sum of the sizes before it
VPT_SLOTS = [("bos", 1), ("pitch", CAM_BINS), ("yaw", CAM_BINS), ("hotbar", 10)] + \
            [("|".join(p for p in pair if p), 1 + sum(p is not None for p in pair)) for pair in PAIRS] + [("eos", 1)]
VPT_OFFSETS = np.cumsum([0] + [n for _, n in VPT_SLOTS])[:-1].tolist()
VPT_VOCAB = sum(n for _, n in VPT_SLOTS)  # 71
BUTTONS = [b for pair in PAIRS for b in pair if b]


def checked_vpt_action(action: dict) -> tuple[float, float, int]:
    """(pitch, yaw, hotbar) of a VPT action dict, or a ValueError naming the bad field: a finite camera (degrees;
    clipped to +-90 by the quantiser), hotbar an int in 0..9 (0 = none), keys 0/1."""
    cam = action.get("camera", (0.0, 0.0))
    if len(cam) != 2 or not all(np.isfinite(float(c)) for c in cam):
        raise ValueError(f"action camera={cam!r} is invalid: two finite angles in degrees (pitch, yaw)")
    hotbar = action.get("hotbar", 0)
    if isinstance(hotbar, bool) or not isinstance(hotbar, (int, np.integer)) or not 0 <= hotbar <= 9:
        raise ValueError(f"action hotbar={hotbar!r} is invalid: an int in 0..9 (0 = no hotbar key)")
    for name in BUTTONS:
        if action.get(name, 0) not in (0, 1, True, False):
            raise ValueError(f"action {name}={action[name]!r} is invalid: 0 or 1")
    return float(cam[0]), float(cam[1]), int(hotbar)


VPT_SCHEMA = {"actions": [
    {"name": "bos", "type": "constant"},
    {"name": "pitch", "field": "camera[0]", "type": "axis", "range": [-CAM_MAXVAL, CAM_MAXVAL], "bins": CAM_BINS,
     "scale": "mu_law", "mu": CAM_MU},
    {"name": "yaw", "field": "camera[1]", "type": "axis", "range": [-CAM_MAXVAL, CAM_MAXVAL], "bins": CAM_BINS,
     "scale": "mu_law", "mu": CAM_MU},
    {"name": "hotbar", "type": "choice", "choices": list(range(10))},  # 0 = no hotbar key
    *[{"name": "|".join(k for k in pair if k), "field": "*", "type": "keys", "keys": [k for k in pair if k],
       "mode": "one"} for pair in PAIRS],  # a pair pressed together is null, as MineWorld has it
    {"name": "eos", "type": "constant"}]}


class VPTActions(SchemaActions):
    """Action dict {camera: (pitch, yaw) degrees, hotbar: 0..9 (0 = none), forward, back, ...: 0/1} <-> 11 ids:
    VPT_SCHEMA, whose parts own VPT_SLOTS' ranges."""

    def __init__(self):
        super().__init__(VPT_SCHEMA)

    def label(self, ids) -> str:
        return pressed_label(self.decode(ids))

    def encode(self, action: dict) -> list[int]:
        checked_vpt_action(action)  # VPT's own checks: keys 0/1 and a whole-number hotbar, named
        return super().encode(action)

    def decode(self, ids) -> dict:
        out = super().decode(ids)
        return out | {"camera": tuple(out["camera"])}


# ------------------------------------------------------------------------------------------------ mineworld
MW_BUTTONS = ["use", "attack", "forward", "back", "left", "right", "jump", "sneak", "sprint", "drop", "swapHands",
              "pickItem", "inventory", "ESC"] + [f"hotbar.{i}" for i in range(1, 10)]
MW_PITCH, MW_YAW = len(MW_BUTTONS), len(MW_BUTTONS) + CAM_BINS  # first id of cam_0 (pitch) and cam_1 (yaw) bins
MW_BOS, MW_NULL, MW_EOS = MW_YAW + CAM_BINS, MW_YAW + CAM_BINS + 1, MW_YAW + CAM_BINS + 2  # 65, 66, 67
MINEWORLD_VOCAB = 70  # 8,262 - 8,192: two ids after <act_eos> are never used


class MineWorldActions(ActionSpace):
    """The VPT action dict <-> MineWorld's 11 ids: [bos, pitch, yaw, hotbar, forward|back, left|right,
    sprint|sneak, use|attack, jump, drop|pickItem, eos]; an unpressed (or doubly pressed) pair is <null_act>."""

    n_a, vocab_size = len(VPT_SLOTS), MINEWORLD_VOCAB

    def label(self, ids) -> str:
        return pressed_label(self.decode(ids))

    def encode(self, action: dict) -> list[int]:
        pitch, yaw, hotbar = checked_vpt_action(action)
        ids = [MW_BOS, MW_PITCH + camera_to_bin(pitch), MW_YAW + camera_to_bin(yaw),
               MW_BUTTONS.index(f"hotbar.{hotbar}") if hotbar else MW_NULL]
        for a, b in PAIRS:
            on_a, on_b = bool(action.get(a, 0)), bool(b and action.get(b, 0))
            ids.append(MW_NULL if on_a == on_b else MW_BUTTONS.index(a if on_a else b))
        return ids + [MW_EOS]

    def decode(self, ids) -> dict:
        ids = [int(i) for i in ids]
        if len(ids) != self.n_a or ids[0] != MW_BOS or ids[-1] != MW_EOS:
            raise ValueError(f"{ids} is not 11 MineWorld action ids from <act_bos> to <act_eos>")
        if not (MW_PITCH <= ids[1] < MW_YAW and MW_YAW <= ids[2] < MW_BOS):
            raise ValueError(f"{ids[1:3]} are not MineWorld camera ids")
        out = {"camera": (bin_to_camera(ids[1] - MW_PITCH), bin_to_camera(ids[2] - MW_YAW)), "hotbar": 0}
        if ids[3] != MW_NULL:
            name = MW_BUTTONS[ids[3]] if ids[3] < MW_PITCH else ""
            if not name.startswith("hotbar."):
                raise ValueError(f"id {ids[3]} is not a hotbar id")
            out["hotbar"] = int(name.split(".")[1])
        for (a, b), i in zip(PAIRS, ids[4:-1]):
            pressed = None if i == MW_NULL else MW_BUTTONS[i] if i < MW_PITCH else "?"
            if pressed not in (None, a, b):
                raise ValueError(f"id {i} is not {a}, {b} or <null_act>")
            out[a] = int(pressed == a)
            if b:
                out[b] = int(pressed == b)
        return out


# ------------------------------------------------------------------------------------------------ crafter
CRAFTER_ACTIONS = ["noop", "move_left", "move_right", "move_up", "move_down", "do", "sleep", "place_stone",
                   "place_table", "place_furnace", "place_plant", "make_wood_pickaxe", "make_stone_pickaxe",
                   "make_iron_pickaxe", "make_wood_sword", "make_stone_sword", "make_iron_sword"]


CRAFTER_SCHEMA = {"actions": [{"name": "action", "type": "choice", "choices": CRAFTER_ACTIONS}],
                  "moves": ["move_left", "move_right", "move_up", "move_down"],
                  "play_keys": [["ArrowLeft", "move_left"], ["a", "move_left"], ["ArrowRight", "move_right"],
                                ["d", "move_right"], ["ArrowUp", "move_up"], ["w", "move_up"],
                                ["ArrowDown", "move_down"], ["s", "move_down"], [" ", "do"]]}


class CrafterActions(SchemaActions):
    """{"action": name} <-> one id, Crafter's own action index: CRAFTER_SCHEMA."""

    def __init__(self):
        super().__init__(CRAFTER_SCHEMA)


ACTION_SPACES = {"vpt": VPTActions, "mineworld": MineWorldActions, "crafter": CrafterActions}


def action_space(spec: str | dict) -> ActionSpace:
    """A space by name (ACTION_SPACES), or the space a schema mapping declares (mcar.tokenizer.action_schema)."""
    if isinstance(spec, Mapping):
        return SchemaActions(spec)
    if spec not in ACTION_SPACES:
        raise ValueError(f"unknown action space {spec!r}; choose one of {sorted(ACTION_SPACES)}, or declare one "
                         f"in a schema (an actions.yaml: docs/own-game.md)")
    return ACTION_SPACES[spec]()
