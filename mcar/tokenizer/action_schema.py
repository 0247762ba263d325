"""An action space declared in a schema, not in code: a game's per-frame action record -> `n_a` token ids.

A schema is a mapping (the `actions.yaml` beside a folder of recordings, or a data config's `actions` node):

    actions:                                   # one entry per part of the action; each owns a range of ids
      - {name: keys, type: keys, keys: [w, a, s, d, space]}            # one binary token per key
      - {name: arrows, type: keys, keys: [left, right], mode: one}    # one token: none, left or right
      - {name: buttons, type: keys, keys: [fire, jump], mode: packed} # one token, 2^n ids: any set pressed
      - {name: action, type: choice, choices: [noop, fire, up, down]} # one of a game's named actions
      - {name: mouse_x, type: axis, range: [-20, 20], bins: 11, scale: mu_law}  # binned, uniform or mu-law
      - {name: bos, type: constant}                                    # a fixed token (MineWorld's bos / eos)
    moves: [up, down]                          # optional: the choices that move the player (IDM, play's arrows)
    play_keys: [[ArrowUp, up], [" ", fire]]    # optional: the play page's keys (KeyboardEvent.key, action name)
    fps: 15                                    # optional: the recordings' frame rate

A record is one JSON object per frame. `field` (default: `name`) says where an entry reads it; `a.b` and `a[0]`
reach into nested values (VPT's `camera[0]`). Keys read a list of pressed names or a {name: 0/1} mapping at
`field`; `field: "*"`: each key is its own top-level field (VPT's `forward: 1`). A missing field is the entry's
rest value (no key, the first choice, an axis at 0 clamped into its range). An axis value outside its range is
clamped and counted (`Encoded.clamped`); a value that is no key, no choice or not a number makes the record bad
(a `RecordError` naming the field), which readers skip and count.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
MAX_PACKED_KEYS = 12  # 4,096 ids in one token
MU_DEFAULT = 11.4887  # VPT's camera quantiser


class ActionSpace:
    """What every action space says about its ids beyond encode/decode, so that the tools (labels under frames,
    actions by name in prompts and play, the IDM's table) ask the space instead of testing its name.

    names: the name of each id when one token is one named action (Crafter), else None: ids are then given as
    n_a numbers. moves: the names of the movement actions (the IDM's precision/recall columns, play's arrows)."""

    n_a: int
    vocab_size: int
    names: tuple[str, ...] | None = None
    moves: tuple[str, ...] = ()
    play_keys: dict[str, str] = {}  # the play page's keyboard: KeyboardEvent.key -> action name

    def encode(self, action: dict) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> dict:
        raise NotImplementedError

    def encode_name(self, name: str) -> list[int]:
        """An action by its name -> its n_a ids (a ValueError when this space has no names or not this one)."""
        if self.names is None:
            raise ValueError(f"{type(self).__name__} has no action names: give actions as {self.n_a} ids")
        if name not in self.names:
            raise ValueError(f"unknown action {name!r}; the actions: {', '.join(self.names)}")
        return [self.names.index(name)]

    def label(self, ids) -> str:
        """A short label of one frame's ids for people (under a video frame); a ValueError when they are not ids
        of this space."""
        ids = [int(i) for i in ids]
        if self.names is None or len(ids) != 1 or not 0 <= ids[0] < len(self.names):
            raise ValueError(f"{ids} is not one action id of {type(self).__name__}")
        return self.names[ids[0]]


class SchemaError(ValueError):
    """A schema that cannot be used; the message names the field and the fix."""


class RecordError(ValueError):
    """One frame's record that the schema cannot encode; the message names the field."""


@dataclass
class Encoded:
    ids: list[int]
    clamped: list[str] = field(default_factory=list)  # the axes whose value was outside their range


def read_path(record, path: str):
    """`camera[0]` of {"camera": [3, 4]} -> 3; a missing part -> KeyError."""
    node = record
    for name, index in PATH_PART.findall(path):
        if index:
            if not isinstance(node, (list, tuple)) or int(index) >= len(node):
                raise KeyError(path)
            node = node[int(index)]
        else:
            if not isinstance(node, dict) or name not in node:
                raise KeyError(path)
            node = node[name]
    return node


def write_path(out: dict, path: str, value) -> None:
    """The inverse of read_path into nested dicts and lists (lists grown as needed)."""
    parts = [(name, int(index) if index else None) for name, index in PATH_PART.findall(path)]
    node = out
    for (name, index), nxt in zip(parts, parts[1:] + [None]):
        key = index if name == "" else name
        child = [] if nxt is not None and nxt[1] is not None else {}
        if nxt is None:
            _put(node, key, value)
            return
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            node[key] = child if node[key] is None else node[key]
            node = node[key]
        else:
            node = node.setdefault(key, child)


def _put(node, key, value) -> None:
    if isinstance(node, list):
        while len(node) <= key:
            node.append(None)
    node[key] = value


class Part:
    """One schema entry: it reads its field of a record and owns `size` ids per token, `tokens` tokens."""

    name: str
    field: str
    tokens: int = 1
    size: int = 1

    def local(self, record: dict, clamped: list[str]) -> list[int]:
        raise NotImplementedError

    def restore(self, local: list[int], out: dict) -> None:
        raise NotImplementedError

    def label(self, local: list[int]) -> str:
        return ""


class Constant(Part):
    def __init__(self, name: str, spec: dict):
        self.name, self.field = name, spec.get("field", name)

    def local(self, record, clamped):
        return [0]

    def restore(self, local, out):
        pass


class Keys(Part):
    MODES = ("each", "one", "packed")

    def __init__(self, name: str, spec: dict):
        self.name, self.field = name, spec.get("field", name)
        self.top_level = self.field == "*"
        self.keys = [str(k) for k in spec.get("keys") or []]
        self.mode = spec.get("mode", "each")
        where = f"actions.{name}"
        if not self.keys or len(set(self.keys)) != len(self.keys):
            raise SchemaError(f"{where}.keys: a list of distinct key names (got {spec.get('keys')!r})")
        if self.mode not in self.MODES:
            raise SchemaError(f"{where}.mode={self.mode!r}: each (a token per key), one (none or one key) or packed")
        if self.mode == "packed" and len(self.keys) > MAX_PACKED_KEYS:
            raise SchemaError(f"{where}: {len(self.keys)} packed keys are {2 ** len(self.keys)} ids; at most "
                              f"{MAX_PACKED_KEYS} keys (or mode: each)")
        self.tokens = len(self.keys) if self.mode == "each" else 1
        self.size = {"each": 2, "one": len(self.keys) + 1, "packed": 2 ** len(self.keys)}[self.mode]

    def pressed(self, record: dict) -> set[str]:
        if self.top_level:
            value = {k: record[k] for k in self.keys if k in record}
        else:
            try:
                value = read_path(record, self.field)
            except KeyError:
                value = []
        if isinstance(value, dict):
            bad = [k for k, v in value.items() if v not in (0, 1, True, False)]
            if bad:
                raise RecordError(f"{self.field}.{bad[0]}={value[bad[0]]!r}: a key is 0 or 1")
            value = [k for k, v in value.items() if v]
        if not isinstance(value, (list, tuple)):
            raise RecordError(f"{self.field}={value!r}: a list of pressed keys or a {{key: 0/1}} mapping")
        unknown = [k for k in value if k not in self.keys]
        if unknown:
            raise RecordError(f"{self.field}: unknown key {unknown[0]!r}; the keys: {', '.join(self.keys)}")
        return set(value)

    def local(self, record, clamped):
        down = self.pressed(record)
        if self.mode == "each":
            return [int(k in down) for k in self.keys]
        if self.mode == "one":  # several at once cancel out (VPT's forward + back)
            return [self.keys.index(next(iter(down))) + 1 if len(down) == 1 else 0]
        return [sum(1 << i for i, k in enumerate(self.keys) if k in down)]

    def down_of(self, local: list[int]) -> list[str]:
        if self.mode == "each":
            return [k for k, v in zip(self.keys, local) if v]
        if self.mode == "one":
            return [self.keys[local[0] - 1]] if local[0] else []
        return [k for i, k in enumerate(self.keys) if local[0] >> i & 1]

    def restore(self, local, out):
        down = set(self.down_of(local))
        if self.top_level:
            for k in self.keys:
                out[k] = int(k in down)
        else:
            write_path(out, self.field, sorted(down, key=self.keys.index))

    def label(self, local):
        return " ".join(self.down_of(local))


class Choice(Part):
    def __init__(self, name: str, spec: dict):
        self.name, self.field = name, spec.get("field", name)
        self.choices = list(spec.get("choices") or [])
        if not self.choices or len({str(c) for c in self.choices}) != len(self.choices):
            raise SchemaError(f"actions.{name}.choices: a list of distinct names (got {spec.get('choices')!r})")
        self.size = len(self.choices)

    def local(self, record, clamped):
        try:
            value = read_path(record, self.field)
        except KeyError:
            return [0]
        for i, c in enumerate(self.choices):
            if value == c and type(value) is not bool or str(value) == str(c):
                return [i]
        raise RecordError(f"{self.field}={value!r} is not a choice; the choices: "
                          f"{', '.join(map(str, self.choices[:20]))}{' ...' if len(self.choices) > 20 else ''}")

    def restore(self, local, out):
        write_path(out, self.field, self.choices[local[0]])

    def label(self, local):
        return str(self.choices[local[0]])


class Axis(Part):
    def __init__(self, name: str, spec: dict):
        self.name, self.field = name, spec.get("field", name)
        where = f"actions.{name}"
        rng = spec.get("range")
        if not (isinstance(rng, (list, tuple)) and len(rng) == 2 and all(_finite(v) for v in rng)
                and float(rng[0]) < float(rng[1])):
            raise SchemaError(f"{where}.range={rng!r}: [low, high], two finite numbers, low < high")
        self.lo, self.hi = float(rng[0]), float(rng[1])
        self.size = spec.get("bins", 21)
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 2 <= self.size <= 4096:
            raise SchemaError(f"{where}.bins={self.size!r}: a whole number of bins in 2..4096")
        self.scale = spec.get("scale", "uniform")
        if self.scale not in ("uniform", "mu_law"):
            raise SchemaError(f"{where}.scale={self.scale!r}: uniform or mu_law")
        self.mu = spec.get("mu", MU_DEFAULT)
        if not _finite(self.mu) or float(self.mu) <= 0:
            raise SchemaError(f"{where}.mu={self.mu!r}: a number > 0 (VPT's camera: {MU_DEFAULT})")
        self.mu = float(self.mu)

    # VPT's CameraQuantizer's arithmetic, operation for operation: its bins and centres come out bit-identical
    @property
    def half(self) -> float:
        return (self.hi - self.lo) / 2

    @property
    def step(self) -> float:
        return (self.hi - self.lo) / (self.size - 1)

    def unit(self, v: float) -> float:
        """A value in range -> [-1, 1], mu-law compressed when asked (fine bins near the centre)."""
        u = (v - (self.lo + self.hi) / 2) / self.half
        if self.scale == "mu_law":
            u = np.sign(u) * np.log1p(self.mu * abs(u)) / np.log1p(self.mu)
        return float(u)

    def local(self, record, clamped):
        try:
            value = read_path(record, self.field)
        except KeyError:
            value = 0.0
        if isinstance(value, bool) or not _finite(value):
            raise RecordError(f"{self.field}={value!r}: a finite number in [{self.lo:g}, {self.hi:g}]")
        v = float(value)
        if not self.lo <= v <= self.hi:
            clamped.append(self.field)
            v = min(max(v, self.lo), self.hi)
        return [int(np.round((self.unit(v) * self.half + self.half) / self.step))]

    def centre(self, b: int) -> float:
        u = (b * self.step - self.half) / self.half
        if self.scale == "mu_law":
            return (self.lo + self.hi) / 2 + float(np.sign(u) * ((1 + self.mu) ** abs(u) - 1) / self.mu * self.half)
        return (self.lo + self.hi) / 2 + u * self.half

    def restore(self, local, out):
        write_path(out, self.field, self.centre(local[0]))

    def label(self, local):
        v = self.centre(local[0])
        return f"{self.name}{v:+.3g}" if abs(v) > 1e-9 else ""


def _finite(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


PART_TYPES = {"keys": Keys, "choice": Choice, "axis": Axis, "constant": Constant}


def plain(node):
    """Mappings and sequences (a config's DictConfig and ListConfig among them) -> dicts and lists."""
    if isinstance(node, Mapping):
        return {k: plain(v) for k, v in node.items()}
    if isinstance(node, Sequence) and not isinstance(node, str):
        return [plain(v) for v in node]
    return node


def schema_parts(schema: dict) -> list[Part]:
    if not isinstance(schema, dict) or not isinstance(schema.get("actions"), (list, tuple)) \
            or not schema["actions"]:
        raise SchemaError("actions: a list of entries ({name, type: keys|choice|axis|constant, ...})")
    parts, names = [], set()
    for i, spec in enumerate(schema["actions"]):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise SchemaError(f"actions[{i}]: each entry is a mapping with a name")
        name = spec["name"]
        if name in names:
            raise SchemaError(f"actions[{i}].name={name!r} is used twice: names are distinct")
        if spec.get("type") not in PART_TYPES:
            raise SchemaError(f"actions.{name}.type={spec.get('type')!r}: one of {', '.join(PART_TYPES)}")
        names.add(name)
        parts.append(PART_TYPES[spec["type"]](name, spec))
    return parts


class SchemaActions(ActionSpace):
    """The ActionSpace a schema declares: each part's tokens own a contiguous id range, in schema order, so a token
    id alone says what it is. A schema of one choice names its actions (`names`: prompts, play's buttons)."""

    def __init__(self, schema: dict):
        self.schema = schema = plain(schema)
        self.parts = schema_parts(schema)
        self.slots = [(p, t) for p in self.parts for t in range(p.tokens)]
        self.offsets = np.cumsum([0] + [p.size for p, _ in self.slots])[:-1].tolist()
        self.n_a, self.vocab_size = len(self.slots), int(sum(p.size for p, _ in self.slots))
        only = self.parts[0] if len(self.parts) == 1 else None
        self.names = tuple(map(str, only.choices)) if isinstance(only, Choice) else None
        self.moves = tuple(schema.get("moves") or ())
        unknown = [m for m in self.moves if self.names is None or m not in self.names]
        if unknown:
            raise SchemaError(f"moves: {unknown[0]!r} is not an action of a one-choice schema")
        self.play_keys = self.checked_play_keys(schema.get("play_keys") or [])

    def checked_play_keys(self, pairs) -> dict[str, str]:
        """play_keys [[key, action name], ...] -> {key: action name}, each action one of `names`."""
        if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                                           for p in pairs):
            raise SchemaError(f"play_keys={pairs!r}: a list of [key, action name] pairs")
        bad = [a for _, a in pairs if self.names is None or a not in self.names]
        if bad:
            raise SchemaError(f"play_keys: {bad[0]!r} is not an action of a one-choice schema")
        return {str(k): str(a) for k, a in pairs}

    def encode_counted(self, record: dict) -> Encoded:
        if not isinstance(record, dict):
            raise RecordError(f"a record is a JSON object, not {type(record).__name__}")
        out = Encoded([])
        for p in self.parts:
            out.ids.extend(p.local(record, out.clamped))
        out.ids = [off + v for off, v in zip(self.offsets, out.ids)]
        return out

    def encode(self, action: dict) -> list[int]:
        return self.encode_counted(action).ids

    def locals_of(self, ids) -> list[list[int]]:
        ids = [int(i) for i in ids]
        if len(ids) != self.n_a:
            raise ValueError(f"{ids} are not {self.n_a} action ids")
        local = [i - off for i, off in zip(ids, self.offsets)]
        for (p, _), v, i in zip(self.slots, local, ids):
            if not 0 <= v < p.size:
                raise ValueError(f"action token {i} is not a {p.name} token")
        out, k = [], 0
        for p in self.parts:
            out.append(local[k:k + p.tokens])
            k += p.tokens
        return out

    def decode(self, ids) -> dict:
        out: dict = {}
        for p, local in zip(self.parts, self.locals_of(ids)):
            p.restore(local, out)
        return out

    def encode_name(self, name: str) -> list[int]:
        ids = super().encode_name(name)
        return [self.offsets[0] + ids[0]]

    def label(self, ids) -> str:
        if self.names is not None:
            return super().label([int(ids[0]) - self.offsets[0]] if len(ids) == 1 else ids)
        words = [p.label(local) for p, local in zip(self.parts, self.locals_of(ids))]
        return " ".join(w for w in words if w) or "noop"
