"""One place that checks a run's values before any work starts, for every tool: each checked key's type, range and
choices, as a typed rule (a pydantic type), refused in one line naming the key, the value and what it takes.

`check_config(tool, cfg)` checks a composed config; `check_before_run(tool, args)` composes conf/<tool>.yaml with
the command line first, so a refused run leaves nothing behind (no run folder, no log). `RULES` is the table (its
docs: docs/checked-keys.md, written from it by `python -m mcar.config_checks --markdown`). A key applies to every
tool whose config has it (`"*"`), or to one tool; `*` in a key stands for any one name (a reward term's)."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Annotated, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import AfterValidator, Field, TypeAdapter, ValidationError

MAX_FRAMES = 100_000  # longer rollouts run for days and their tokens and decoded frames outgrow memory: split them
# mcar.crafter.gen.POLICIES (a test keeps the two equal)
POLICIES = ("explorer", "forager", "hesitant", "random", "sweeper", "wanderer")
# the reward classes, by module: the generic terms and the Crafter wing's (a test keeps them equal)
REWARDS = {"mcar.train.rewards": ("ActionMatch", "NoInventedTiles", "TileAgreement", "TileMix"),
           "mcar.crafter.rewards": ("CreatureCount", "CreatureTolerantAgreement", "RevisitedTiles")}


@dataclass(frozen=True)
class Rule:
    takes: str  # what the key takes, in words: the refusal and the docs table say it
    adapter: TypeAdapter

    def refusal(self, value) -> str | None:
        """None when `value` fits the rule, else the line that says so: what the key takes, and why not where the
        rule's own check (not a type or a bound) refused it."""
        try:
            self.adapter.validate_python(value, strict=True)
        except ValidationError as e:
            first = e.errors()[0]
            why = str(first.get("ctx", {}).get("error", "")) if first["type"] == "value_error" else ""
            return self.takes + (f" ({why})" if why else "")
        return None


def _finite(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError("not a finite number")
    return x


def count(lo: int = 1, hi: int | None = None, optional: bool = False, note: str = "") -> Rule:
    t = Annotated[int, Field(ge=lo, le=hi)]
    span = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"
    return Rule(span + (" or null" if optional else "") + (f" ({note})" if note else ""),
                TypeAdapter(t | None if optional else t))


def real(ge: float | None = None, gt: float | None = None, le: float | None = None, optional: bool = False) -> Rule:
    t = Annotated[float, Field(ge=ge, gt=gt, le=le), AfterValidator(_finite)]
    bounds = [f">= {ge:g}" for _ in [ge] if ge is not None] + [f"> {gt:g}" for _ in [gt] if gt is not None] + \
        [f"<= {le:g}" for _ in [le] if le is not None]
    return Rule("a finite number" + (" " + " and ".join(bounds) if bounds else "") + (" or null" if optional else ""),
                TypeAdapter(t | None if optional else t))


def flag() -> Rule:
    return Rule("true or false", TypeAdapter(bool))


def choice(*options: str) -> Rule:
    return Rule("one of " + ", ".join(options), TypeAdapter(Literal[options]))


def lengths(lo: int, optional: bool = False, size: int | None = None) -> Rule:
    """A non-empty list of integers >= lo (`size` of them when given)."""
    t = Annotated[list[Annotated[int, Field(ge=lo)]], Field(min_length=size or 1, max_length=size)]
    what = f"a list of {size} integers >= {lo}" if size else f"a non-empty list of integers >= {lo}"
    return Rule(what + (" or null (the default)" if optional else ""), TypeAdapter(t | None if optional else t))


def _some_weight(mix: dict) -> dict:
    if not any(w > 0 for w in mix.values()):
        raise ValueError("every weight is 0: no policy would play")
    return mix


def policy_mix() -> Rule:
    weight = Annotated[float, Field(ge=0), AfterValidator(_finite)]
    t = Annotated[dict[Literal[POLICIES], weight], AfterValidator(_some_weight)]
    return Rule(f"a mapping of policies ({', '.join(POLICIES)}) to finite weights >= 0, one of them > 0",
                TypeAdapter(t))


def reward_target() -> Rule:
    names = tuple(f"{module}.{n}" for module, classes in REWARDS.items() for n in classes)
    return Rule("a reward class: " + ", ".join(names), TypeAdapter(Literal[names]))


PROBABILITY = real(ge=0, le=1)
RULES: dict[str, dict[str, Rule]] = {
    "*": {
        "optim.lr": real(gt=0), "optim.weight_decay": real(ge=0),
        "trainer.max_steps": count(-1, note="-1: max_epochs decides"), "trainer.accumulate_grad_batches": count(1),
        "model.arch.dim": count(1), "model.arch.n_layers": count(1), "model.arch.n_heads": count(1),
        "model.arch.mlp_dim": count(1), "far_copy_weight": real(ge=0), "retoken": flag(),
        "grow_layers": count(1, optional=True),
        "rope_base": real(gt=1, optional=True),
        "context_noise": PROBABILITY, "sampler.temperature": real(ge=0),
        "sampler.min_p": real(ge=0, le=1, optional=True),
        "posttrain.objective": choice("grpo", "supervised"), "posttrain.group": count(1),
        "posttrain.starts": count(1), "posttrain.rollout_frames": count(2, MAX_FRAMES),
        "posttrain.clip_eps": real(gt=0), "posttrain.kl_coef": real(ge=0), "posttrain.updates_per_batch": count(1),
        "posttrain.supervised_coef": real(ge=0), "posttrain.video_every_n_steps": count(0),
        "posttrain.rewards.*.weight": real(ge=0), "posttrain.rewards.*._target_": reward_target(),
        "starts.warmup": count(0), "starts.clips_per_world": count(1), "starts.policy_mix": policy_mix(),
        "data.policy_mix": policy_mix(), "table3.finetune.steps": count(1),
        "data.fps": real(gt=0, optional=True), "data.max_frame_tokens": count(1),
    },
    "record": {"episodes": count(1), "frames": count(2, MAX_FRAMES), "hold": real(gt=0), "seed": count(0),
               "lossless": flag()},
    "gametest": {"starts": count(1), "warmup": count(0), "rollout_frames": count(2, MAX_FRAMES), "hold": real(gt=0),
                 "seed_base": count(0), "windows": lengths(2, optional=True), "batch_size": count(1)},
    "generate": {"frames": count(2, MAX_FRAMES, optional=True), "fps": real(gt=0)},
    "evaluate": {"frames": count(2, MAX_FRAMES, optional=True)},
    "worldtest": {
        "rollout_frames": count(1, MAX_FRAMES), "windows": lengths(2, optional=True), "loop_lengths": lengths(1),
        "starts": count(1), "warmup": count(0), "batch_size": count(1), "p_bump": PROBABILITY,
        "max_moves": count(0), "fps": real(gt=0),
    },
    "crafter_gen": {
        "size": lengths(1, size=2), "episodes": count(1), "frames": count(1, MAX_FRAMES), "workers": count(1),
        "random": real(ge=0), "explorer": real(ge=0), "wanderer": real(ge=0),
    },
    "play": {"port": count(1, 65535), "idle_minutes": real(ge=0), "cache_seconds": count(0),
             "max_games": count(1, optional=True)},
}


class CheckedValueError(ValueError):
    """A value a checked key does not take (one line: the key, the value, what it takes)."""


_ABSENT = object()


def _value(cfg: DictConfig, key: str):
    """The key's value as plain data (containers too), _ABSENT when the config has no such key or it cannot be
    resolved before the run (an interpolation of Hydra's run-time values: the job checks it)."""
    try:
        node = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=True)
    except OmegaConfBaseException:
        return _ABSENT
    if isinstance(node, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException:
            return _ABSENT
    return node


def _keys(cfg: DictConfig, pattern: str) -> list[str]:
    """The config's keys matching `pattern` (`*`: any one name, where the config holds a mapping)."""
    if "*" not in pattern:
        return [pattern]
    head, tail = pattern.split("*", 1)
    parent = _value(cfg, head.rstrip("."))
    if not isinstance(parent, dict):
        return []
    return [k for name, v in parent.items() if isinstance(v, dict)
            for k in _keys(cfg, f"{head}{name}{tail}")]


def rules_for(tool: str) -> dict[str, Rule]:
    return {**RULES["*"], **RULES.get(tool, {})}


def check_config(tool: str, cfg: DictConfig) -> None:
    """Every checked key `cfg` has, against its rule; CheckedValueError (one line) at the first it breaks."""
    for pattern, rule in rules_for(tool).items():
        for key in _keys(cfg, pattern):
            value = _value(cfg, key)
            if value is _ABSENT or (value is None and key.endswith("._target_")):
                continue
            takes = rule.refusal(value)
            if takes is not None:
                raise CheckedValueError(f"mcar {tool}: {key}={_shown(value)}: {key} takes {takes}")


def _shown(value) -> str:
    if isinstance(value, str):
        return repr(value)
    return str(value).replace("\n", " ")


def check_before_run(tool: str, args: list[str] | None = None, cfg: DictConfig | None = None) -> None:
    """The run's config (`cfg`, or conf/<tool>.yaml composed with the command line's overrides `args`) checked
    (check_config) before Hydra makes the run folder; SystemExit with the one line on a refusal. A command line
    that does not compose here (a sweep, Hydra's own flags) is left to Hydra, which says what is wrong with it."""
    if cfg is None:
        cfg = _composed(tool, args or [])
    if cfg is None:
        return
    try:
        check_config(tool, cfg)
    except CheckedValueError as e:
        raise SystemExit(str(e)) from None


def _composed(tool: str, args: list[str]) -> DictConfig | None:
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException

    if any(a.startswith("-") for a in args):
        return None
    overrides = [a for a in args if not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        with initialize_config_module(version_base="1.3", config_module="mcar.conf"):
            return compose(tool, overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError):
        return None


def markdown() -> str:
    """The table of docs/checked-keys.md."""
    lines = ["| tool | key | takes |", "| --- | --- | --- |"]
    for tool, rules in RULES.items():
        lines += [f"| {'every tool that has it' if tool == '*' else tool} | `{key}` | {rule.takes} |"
                  for key, rule in rules.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown(), end="")
    else:
        raise SystemExit("usage: python -m mcar.config_checks --markdown")

