"""The GPU check split over short borrowed device calls: what scripts/gpu_check.sh needs beyond `mcar bench gpu`
(mcar/bench/gpu_check.py), which a user with a GPU of their own runs as one command.

    python scripts/gpu_calls.py list [overrides]                # each stage: done, stale or missing; its estimate
    python scripts/gpu_calls.py plan --budget 540 --left 900 [overrides]   # the calls and sittings still needed
    python scripts/gpu_calls.py stage NAME [overrides]          # one stage, inductor's artifacts carried

Overrides are `mcar bench gpu`'s (mcar/conf/bench.yaml), bench.gpu.dir among them: the folder of the stage JSONs.
A stage JSON counts as done for a run only if its fingerprint is this run's. Estimates: scripts/gpu_estimates.yaml
(each stage's upper time = start-up + graphs compiled x compile_s + work). `stage` loads the inductor artifacts
earlier stages saved (compile_cache.zip beside the JSONs, one member per stage) and saves its own at its end, a
timeout's SIGTERM included: a fresh machine handed that file back compiles from cache. The last line printed is
one JSON object.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import zipfile
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from mcar.atomic import write_atomic, write_json
from mcar.bench.gpu_check import fingerprint, run_stage, stages
from mcar.hydra_app import register_resolvers
from mcar.stopping import stop_signals_end

ESTIMATES = Path(__file__).with_name("gpu_estimates.yaml")


def stage_states(out: Path, names: list[str], fp: dict) -> dict[str, str]:
    """Each stage: done (its JSON has this fingerprint), stale (a JSON of another fingerprint, or of none) or
    missing."""
    states = {}
    for name in names:
        path = out / f"{name}.json"
        states[name] = "missing" if not path.exists() else \
            "done" if json.loads(path.read_text()).get("fingerprint") == fp else "stale"
    return states


def stage_estimate(e: DictConfig, name: str, cached: bool = False) -> tuple[int, str]:
    """A stage's upper time in seconds and its arithmetic: start-up + each graph it compiles x its kind's compile_s
    (x cached_compile_fraction where compile_cache.zip holds the stage's artifacts) + its work (gpu_estimates.yaml;
    a stage not listed there: unlisted_s)."""
    if name not in e.stages:
        return int(e.unlisted_s), f"{int(e.unlisted_s)} (not under stages in gpu_estimates.yaml)"
    stage, scale = e.stages[name], float(e.cached_compile_fraction) if cached else 1.0
    for kind in stage.graphs:
        if kind not in e.compile_s:
            raise ValueError(f"{ESTIMATES}: stages.{name}.graphs.{kind}: no such graph kind; choose one of "
                             f"{sorted(e.compile_s)} (compile_s)")
    compile_ = sum(int(n) * float(e.compile_s[kind]) * scale for kind, n in stage.graphs.items())
    seconds = round(float(e.startup_s) + compile_ + float(stage.work_s))
    graphs = [f"{int(n)} {kind} x {float(e.compile_s[kind]) * scale:g}" for kind, n in stage.graphs.items() if int(n)]
    return seconds, " + ".join([f"{int(e.startup_s)} start-up", *graphs, f"{stage.work_s:g} work"]) + \
        (" (compile cached)" if cached else "")


def stage_estimates(e: DictConfig, names: list[str], cached: set[str] = frozenset()) -> dict[str, int]:
    """Each stage's upper time estimate in seconds (stage_estimate; `cached`: stages whose compile artifacts were
    saved), and merge's."""
    return {name: stage_estimate(e, name, name in cached)[0] for name in names} | {"merge": int(e.merge_s)}


def pack_call(todo: list[str], estimates: dict[str, int], budget: int, call_s: int) -> dict:
    """One device call as scripts/gpu_check.sh --budget runs it: call_s of set-up, then in order every stage of
    `todo` whose estimate fits what is left less merge's, then merge."""
    merge, used, packed = estimates["merge"], call_s, {}
    for stage in todo:
        if used + estimates[stage] + merge <= budget:
            packed[stage] = estimates[stage]
            used += estimates[stage]
    return {"budget_s": budget, "stages": packed, "estimate_s": used + merge}


def plan_calls(estimates: dict[str, int], budget: int, call_s: int, left: int, sitting: dict) -> dict:
    """Pack the stages (in order; `estimates` as stage_estimates gives them, merge's included) into device calls of
    at most `budget` seconds, and the calls into sittings of device time: the first has `left` seconds (the device
    tool's budget_left_s), each later one sitting["sitting_s"]. A sitting starts a machine (machine_start_s of its
    time; none with under min_start_s left), then runs calls back to back (gap_s between), each with the budget the
    sitting has left if that is less than `budget`. A stage that fits no call of a whole sitting is reported, never
    packed."""
    merge, todo = estimates["merge"], [s for s in estimates if s != "merge"]
    start, gap = int(sitting["machine_start_s"]), int(sitting["gap_s"])
    widest = min(budget, int(sitting["sitting_s"]) - start)
    too_long = [s for s in todo if call_s + estimates[s] + merge > widest]
    todo = [s for s in todo if s not in too_long]
    sittings, time_left = [], left
    while todo:
        calls, spare = [], time_left - start if time_left >= int(sitting["min_start_s"]) else 0
        while todo:
            call = pack_call(todo, estimates, min(budget, spare), call_s)
            if not call["stages"]:
                break
            calls.append(call)
            todo = [s for s in todo if s not in call["stages"]]
            spare -= call["estimate_s"] + gap
        sittings.append({"left_s": time_left, "calls": calls, "spare_s": max(spare + gap, 0) if calls else time_left})
        time_left = int(sitting["sitting_s"])
    calls = [call for s in sittings for call in s["calls"]]
    return {"budget_s": budget, "call_s": call_s, "merge_s": merge, "left_s": left, "sitting": dict(sitting),
            "sittings": sittings, "calls": calls, "total_s": sum(c["estimate_s"] for c in calls),
            "too_long": {s: estimates[s] for s in too_long}}


def plan_text(plan: dict, arithmetic: dict[str, str], done: list[str]) -> str:
    """The plan as scripts/gpu_check.sh --plan prints it."""
    calls, budget, sitting = plan["calls"], plan["budget_s"], plan["sitting"]
    lines = [f"gpu_check plan for --left {plan['left_s']} (device time left) and --budget {budget} (a call): "
             f"{len(calls)} call(s) in {len(plan['sittings'])} sitting(s); a sitting's machine start "
             f"~{sitting['machine_start_s']} s, calls back to back ({sitting['gap_s']} s apart), each "
             f"{plan['call_s']} s set-up + its stages + merge {plan['merge_s']} s"]
    if done:
        lines.append(f"  done before, not planned: {' '.join(done)}")
    n = 0
    for i, s in enumerate(plan["sittings"], 1):
        lines.append(f"  sitting {i}, {s['left_s']} s of device time" + (" (--left)" if i == 1 else
                                                                        " (sitting_s, a whole sitting)") + ":")
        if not s["calls"]:
            lines.append(f"    nothing fits (a machine start ~{sitting['machine_start_s']} s, none under "
                         f"{sitting['min_start_s']} s left)")
        for call in s["calls"]:
            n += 1
            packed = ", ".join(f"{stage} {seconds}" for stage, seconds in call["stages"].items())
            lines.append(f"    call {n}, --budget {call['budget_s']}, ~{call['estimate_s']} s: {packed}")
        if s["calls"]:
            lines.append(f"    ~{s['spare_s']} s to spare")
    starts = sum(bool(s["calls"]) for s in plan["sittings"])
    lines.append(f"  total ~{plan['total_s']} s ({plan['total_s'] / 60:.1f} min) of commands, plus {starts} machine "
                 f"start(s)")
    for stage, seconds in plan["too_long"].items():
        lines.append(f"  {stage}: {seconds} s does not fit one call even alone ({plan['call_s']} s set-up and "
                     f"merge's {plan['merge_s']} s, within --budget {budget} and a sitting of "
                     f"{sitting['sitting_s']} s less its machine start): lower the estimates")
    width = max(map(len, arithmetic), default=0)
    lines.append("stage estimates (gpu_estimates.yaml: start-up + graphs compiled x compile_s + work):")
    lines += [f"  {stage:<{width}} {how}" for stage, how in arithmetic.items()]
    return "\n".join(lines)


def in_order(cfg: DictConfig, e: DictConfig) -> list[str]:
    """The stages, those under `first` in gpu_estimates.yaml first (the goals' numbers), then the rest in order."""
    names = stages(cfg)
    first = [s for s in e.get("first", []) if s in names]
    return first + [s for s in names if s not in first]


def run_plan(cfg: DictConfig, e: DictConfig, out: Path, overrides: list[str], budget: int,
             left: int | None = None) -> dict:
    """The stages not done in `out`, packed into calls of `budget` seconds and sittings, the first of `left` seconds
    of device time (a whole sitting, e.sitting.sitting_s, if None)."""
    names, fp = in_order(cfg, e), fingerprint(cfg, overrides)
    states, cached = stage_states(out, names, fp), cached_stages(out)
    todo = [n for n in names if states[n] != "done"]
    arithmetic = {}
    for name in todo:
        seconds, how = stage_estimate(e, name, name in cached)
        arithmetic[name] = f"{seconds} = {how}"
    sitting = OmegaConf.to_container(e.sitting)
    plan = plan_calls(stage_estimates(e, todo, cached), budget, int(e.call_s),
                      int(sitting["sitting_s"]) if left is None else left, sitting)
    done = [n for n in names if states[n] == "done"]
    return plan | {"done": done, "arithmetic": arithmetic, "text": plan_text(plan, arithmetic, done)}


# ---- inductor's artifacts carried between calls -----------------------------------------------------------------
COMPILE_CACHE = "compile_cache.zip"  # beside the stage JSONs: one member per stage (save_cache_artifacts)


def cached_stages(out: Path) -> set[str]:
    """Stages whose compile artifacts compile_cache.zip holds."""
    try:
        with zipfile.ZipFile(out / COMPILE_CACHE) as z:
            return {n.removesuffix(".bin") for n in z.namelist()}
    except (OSError, zipfile.BadZipFile):
        return set()


def load_compile_cache(out: Path) -> str:
    """Hot-load every stage's saved artifacts into inductor's caches (torch.compiler.load_cache_artifacts);
    -> what happened, one line for the stage JSON. A missing, damaged or foreign file only means compiling cold:
    the cache only saves time, so no error of it fails a stage."""
    if not hasattr(torch.compiler, "load_cache_artifacts"):
        return f"torch {torch.__version__} has no torch.compiler.load_cache_artifacts: compiled cold"
    path = out / COMPILE_CACHE
    if not path.exists():
        return f"no {COMPILE_CACHE} yet: compiled cold"
    try:
        with zipfile.ZipFile(path) as z:
            members = z.namelist()
            loaded = sum(torch.compiler.load_cache_artifacts(z.read(m)) is not None for m in members)
    except Exception as e:
        return f"{COMPILE_CACHE} unreadable ({type(e).__name__}: {e}): compiled cold"
    return f"loaded {loaded} of {len(members)} stages' artifacts ({path.stat().st_size / 2**20:.1f} MiB)"


def save_compile_cache(out: Path, stage: str) -> str:
    """Add this process's new artifacts (torch.compiler.save_cache_artifacts) to compile_cache.zip as the stage's
    member (replacing an older one); -> what happened, one line."""
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        return f"torch {torch.__version__} has no torch.compiler.save_cache_artifacts: nothing saved"
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return "nothing compiled: nothing saved"
        return write_compile_cache(out, stage, saved[0])
    except Exception as e:  # the cache only saves time: never fails a stage
        return f"not saved ({type(e).__name__}: {e})"


def write_compile_cache(out: Path, stage: str, artifacts: bytes) -> str:
    """compile_cache.zip with `artifacts` as the stage's member, the other stages' kept (a damaged file: dropped)."""
    path = out / COMPILE_CACHE
    kept = {}
    with contextlib.suppress(OSError, zipfile.BadZipFile), zipfile.ZipFile(path) as z:
        kept = {m: z.read(m) for m in z.namelist() if m != f"{stage}.bin"}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in (kept | {f"{stage}.bin": artifacts}).items():
            z.writestr(member, data)
    write_atomic(path, buffer.getvalue())  # whole or not at all, as the stage JSONs
    return f"saved {len(artifacts) / 2**20:.1f} MiB of artifacts ({path.stat().st_size / 2**20:.1f} MiB compressed, " \
        f"{len(kept) + 1} stages)"


@contextlib.contextmanager
def bench_config(overrides: list[str]):
    """conf/bench.yaml composed with `overrides`, inside Hydra's context (a training stage composes train.yaml)."""
    from hydra import compose, initialize_config_module

    register_resolvers()
    with initialize_config_module(config_module="mcar.conf", version_base="1.3"):
        yield compose("bench", overrides)


def cached_stage(cfg: DictConfig, stage: str, out: Path, overrides: list[str]) -> dict:
    """run_stage with the artifacts of earlier stages loaded first and its own saved at its end (a stop included);
    the stage JSON says what the cache did."""
    cache = {"loaded": load_compile_cache(out)}
    try:
        result = run_stage(cfg, stage, out, overrides)
    finally:
        cache["saved"] = save_compile_cache(out, stage)
        print(f"compile cache: {cache['loaded']}; {cache['saved']}", flush=True)
    result["compile_cache"] = cache
    write_json(out / f"{stage}.json", result)
    return result


def main(argv: list[str]) -> dict:
    usage = "usage: python scripts/gpu_calls.py list|plan [--budget S] [--left S]|stage NAME [mcar bench gpu " \
        "overrides]"
    if not argv or argv[0] not in ("list", "plan", "stage") or (argv[0] == "stage" and len(argv) < 2):
        raise SystemExit(usage)
    mode, args = argv[0], argv[1:]
    budget, left = 540, None
    while mode == "plan" and args[:1] in (["--budget"], ["--left"]):
        if args[0] == "--budget":
            budget = int(args[1])
        else:
            left = int(args[1])
        args = args[2:]
    stage = args.pop(0) if mode == "stage" else None
    overrides = [a for a in args if not a.startswith("bench.gpu.stage=")]
    e = OmegaConf.load(ESTIMATES)
    with bench_config([*overrides, f"bench.gpu.stage={stage or 'all'}"]) as cfg:
        out = Path(cfg.bench.gpu.dir)
        out.mkdir(parents=True, exist_ok=True)
        if mode == "list":
            names, fp = in_order(cfg, e), fingerprint(cfg, overrides)
            return {"stages": names, "state": stage_states(out, names, fp),
                    "estimate_s": stage_estimates(e, names, cached_stages(out)), "fingerprint": fp}
        if mode == "plan":
            return run_plan(cfg, e, out, overrides, budget, left)
        with stop_signals_end("gpu_calls"):
            return cached_stage(cfg, stage, out, overrides)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
