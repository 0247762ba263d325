"""VPT (OpenAI Video-Pre-Training) recordings: <name>.mp4 (640x360, 20 Hz) + <name>.jsonl, one record per frame.

A record has mouse{x, y, dx, dy, buttons, newButtons, dwheel, ...}, keyboard{keys, newKeys, chars}, isGuiOpen,
hotbar (0..8), yaw, pitch, ... `parse_vpt` turns a file's records into the action dicts of
mcar.tokenizer.actions.VPTActions and a keep mask, following VPT's own loader (data_loader.py,
run_inverse_dynamics_model.py) except where noted:

- camera degrees = (dy, dx) * 360 / 2400 (pitch, yaw), kept as floats. VPT's loader writes them into an int64
  array and truncates them to whole degrees; we do not. While a GUI is open the mouse moves a cursor, not the
  camera: camera is 0 there.
- "stuck attack": when the first record's newButtons is [0], attack is held from before the recording started;
  button 0 is removed until attack is pressed again.
- the scroll wheel changes `hotbar` without a key press: a change of `hotbar` becomes the key hotbar.N. The first
  record sets the reference (VPT starts from slot 0 and invents a hotbar key on frame 0 when the recording
  starts elsewhere), and a scroll is an action, so such a frame is not null.
- null frames (no known key, no mouse motion, no button, no hotbar change) and GUI-open frames are dropped by
  default, as VPT and MineWorld do (`drop_null`, `drop_gui`).
- key names not in KEY_MAP are ignored and reported (one warning per file, naming the keys).
"""
from __future__ import annotations

import numpy as np

CAMERA_SCALE = 360.0 / 2400.0  # degrees per mouse count (MineRL's sensitivity)

KEY_MAP = {
    "key.keyboard.w": "forward", "key.keyboard.s": "back", "key.keyboard.a": "left", "key.keyboard.d": "right",
    "key.keyboard.space": "jump", "key.keyboard.left.shift": "sneak", "key.keyboard.left.control": "sprint",
    "key.keyboard.q": "drop", "key.keyboard.e": "inventory", "key.keyboard.escape": "ESC",
    "key.keyboard.f": "swapHands", **{f"key.keyboard.{i}": f"hotbar.{i}" for i in range(1, 10)},
}
MOUSE_BUTTONS = {0: "attack", 1: "use", 2: "pickItem"}


def _valid(r) -> bool:
    return (isinstance(r, dict) and isinstance(r.get("mouse"), dict) and isinstance(r.get("keyboard"), dict)
            and isinstance(r["keyboard"].get("keys", []), list) and isinstance(r["mouse"].get("buttons", []), list))


def parse_vpt(records: list, drop_null: bool = True, drop_gui: bool = True):
    """records: parsed jsonl lines (None for a malformed line).

    -> (actions: list of action dicts or None, keep: list[bool], notes: list[str]). `actions[i]` belongs to frame i.
    """
    actions, keep, unknown, invalid = [], [], set(), 0
    bad_hotbar, bad_camera, no_camera = {}, {}, []  # jsonl line -> value
    stuck_attack, last_hotbar = False, None
    for i, r in enumerate(records):
        problem = _bad_field(r) if _valid(r) else None
        if problem is not None:
            field, value = problem
            (bad_hotbar if field == "hotbar" else bad_camera)[i + 1] = value
        if not _valid(r) or problem is not None:
            invalid += r is not None and not _valid(r)  # malformed json lines are counted by the jsonl reader
            actions.append(None)
            keep.append(False)
            continue
        mouse = r["mouse"]
        new_buttons = mouse.get("newButtons", [])
        if last_hotbar is None:  # the first valid record of the file
            stuck_attack = new_buttons == [0]
        elif stuck_attack and 0 in new_buttons:
            stuck_attack = False  # attack pressed for real
        buttons = [b for b in mouse.get("buttons", []) if not (stuck_attack and b == 0)]
        act, pressed = _pressed_action(r["keyboard"].get("keys", []), buttons, unknown)
        gui = bool(r.get("isGuiOpen", False))
        if "dx" not in mouse or "dy" not in mouse:
            no_camera.append(i + 1)
        dx, dy = float(mouse.get("dx", 0) or 0), float(mouse.get("dy", 0) or 0)
        act["camera"] = (0.0, 0.0) if gui else (dy * CAMERA_SCALE, dx * CAMERA_SCALE)
        scrolled, last_hotbar = _set_hotbar(act, r.get("hotbar"), last_hotbar)
        null = not pressed and dx == 0 and dy == 0 and not scrolled
        actions.append(act)
        keep.append(not (drop_null and null) and not (drop_gui and gui))
    return actions, keep, _parse_notes(unknown, invalid, bad_hotbar, bad_camera, no_camera)


def _bad_field(r: dict):
    """("hotbar" | "camera", value) for a valid record whose field would become a wrong action; else None."""
    hotbar, mouse = r.get("hotbar"), r["mouse"]
    if hotbar is not None and (isinstance(hotbar, bool) or not isinstance(hotbar, int) or not 0 <= hotbar <= 8):
        return "hotbar", hotbar  # VPT's hotbar is a slot 0..8: anything else would become a wrong id
    if not all(np.isfinite(_number(mouse.get(k, 0))) for k in ("dx", "dy")):
        return "camera", (mouse.get("dy"), mouse.get("dx"))
    return None


def _pressed_action(keys: list, buttons: list, unknown: set):
    """-> (action dict with every key and button 0/1, whether any known one is pressed); collects unknown keys."""
    act = {name: 0 for name in KEY_MAP.values()}
    act.update({name: 0 for name in MOUSE_BUTTONS.values()})
    pressed = False
    for k in keys:
        if k in KEY_MAP:
            act[KEY_MAP[k]], pressed = 1, True
        else:
            unknown.add(k)
    for b in buttons:
        if b in MOUSE_BUTTONS:
            act[MOUSE_BUTTONS[b]], pressed = 1, True
    return act, pressed


def _set_hotbar(act: dict, hotbar, last_hotbar):
    """Sets act["hotbar"]: a scroll (change of `hotbar`) wins over keys. -> (scrolled, the new last hotbar)."""
    scrolled = last_hotbar is not None and hotbar is not None and hotbar != last_hotbar
    keyed = [n for n in range(1, 10) if act[f"hotbar.{n}"]]
    act["hotbar"] = hotbar + 1 if scrolled else (keyed[-1] if keyed else 0)
    if hotbar is not None:
        last_hotbar = hotbar
    elif last_hotbar is None:
        last_hotbar = -1  # no hotbar field: only keys count
    return scrolled, last_hotbar


def _parse_notes(unknown: set, invalid: int, bad_hotbar: dict, bad_camera: dict, no_camera: list) -> list:
    notes = []
    if unknown:
        notes.append(f"ignored unknown key names {sorted(unknown)}")
    if invalid:
        notes.append(f"{invalid} records without mouse/keyboard dicts dropped")
    if bad_hotbar:
        notes.append(f"{len(bad_hotbar)} records with hotbar outside 0..8 dropped (jsonl line: value "
                     f"{_first(bad_hotbar)})")
    if bad_camera:
        notes.append(f"{len(bad_camera)} records with a non-numeric or infinite mouse dx/dy dropped (jsonl line: "
                     f"(dy, dx) {_first(bad_camera)})")
    if no_camera:
        notes.append(f"{len(no_camera)} records without mouse dx/dy read as no camera motion (jsonl lines "
                     f"{no_camera[:5]}{' ...' if len(no_camera) > 5 else ''})")
    return notes


def _number(v) -> float:
    try:
        return float(v or 0)
    except (TypeError, ValueError):
        return float("nan")


def _first(d: dict, n: int = 5) -> str:
    return ", ".join(f"{k}: {v!r}" for k, v in list(d.items())[:n]) + (" ..." if len(d) > n else "")

