"""The Crafter world tests' report: world_tests.md's tables (memory walks, refused moves by what refused them,
rollouts, what memory buys, creatures, margins over the baselines) and the W&B summary.
"""
from __future__ import annotations

from omegaconf import DictConfig

from mcar.crafter.map_tokens import CREATURE_EVENTS
from mcar.eval.world_tests import baseline_margins, ci_cell, window_gains
from mcar.wandb_run import log_media, log_table, open_run


def type_rows(by_type: dict) -> list[tuple[str, dict]]:
    """by_type's rows in table order: the wander's types by n (most first), then the placed obstacles."""
    return sorted(by_type.items(), key=lambda kv: (bool(kv[1].get("placed")), -kv[1]["n"], kv[0]))


def _memory_cells(v: dict, far: bool = False) -> str:
    return (f"{ci_cell(v['recall'])} | " + (f"{ci_cell(v.get('recall_far'))} | " if far else "") +
            f"{ci_cell(v['loop_acc'])} | {ci_cell(v.get('inventory'))} | {ci_cell(v.get('invented'))} |")


def markdown(res: dict) -> str:
    """world_tests.md: what was checked, then one section per policy (policy_markdown)."""
    seeds = res.get("seeds", {})
    checked = [f"the {seeds['training_worlds']} worlds its {seeds['training_episodes']} training episodes can have"] \
        if "training_worlds" in seeds else []
    if "posttrain_worlds" in seeds:
        checked.append("post-training worlds {}..{}".format(*seeds["posttrain_worlds"]))
    lines = [f"World tests of {len(res['policies'])} policies on fresh Crafter worlds (seeds {seeds['worlds'][0]}.."
             f"{seeds['worlds'][1]}, none of them {' or '.join(checked) or 'a world the checkpoint names'}), model "
             f"context {res['context']} frames, sampler {res['sampler']}; 95% bootstrap intervals over starts. A "
             f"policy the checkpoint's data and post-training never played is `unseen`.", ""]
    lines += summary_lines(res)
    for name, per in res["policies"].items():
        lines += ["", f"## {name} ({'seen in training' if per['seen'] else 'unseen'})", "",
                  policy_markdown({**res, **per})]
    return "\n".join(lines)


def summary_lines(res: dict) -> list[str]:
    """One row per policy: the model on its context against nothing moves (rollouts), the share of refused moves
    kept, what memory buys over the 2-frame window on each walk, creatures drawn against the real frames'."""
    row, seed = f"model context={res['context']}", int(res.get("seed", 0))
    cell = lambda d: f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" if d and d.get("lo") is not None else ""
    def gains_of(per: dict) -> dict:  # walk (teacher-forced apart) -> the model's gain over the 2-frame window
        return {g["walk"] + (" teacher-forced" if g["row"].endswith("teacher-forced") else ""): g
                for g in window_gains({**res, **per}, seed) if g["row"] in (row, row + " teacher-forced")}

    walks = list(dict.fromkeys(w for per in res["policies"].values() for w in gains_of(per)))
    header = ["policy", "rollout minus nothing moves", "refused moves kept",
              *(f"{w}: recall minus the 2-frame window" for w in walks), "creatures per frame (real)"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for name, per in res["policies"].items():
        margin = next((m.get("mean") for m in baseline_margins(per.get("rollout", {}), seed)
                       if m["row"] == row and m["baseline"] == "copy_last"), None)
        refused = per.get("blocked", {}).get("blocked", {})
        gains = gains_of(per)
        creatures = per.get("creatures", {}).get("rows", {})
        drawn = f"{creatures[row]['creatures']['mean']:.3f} ({creatures['real']['creatures']['mean']:.3f})" \
            if row in creatures else ""
        kept = ci_cell(refused.get("stayed")) if refused.get("n") else ""
        cells = [f"{name}{'' if per['seen'] else ' (unseen)'}", cell(margin), kept,
                 *(cell(gains.get(w)) for w in walks), drawn]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def policy_markdown(res: dict) -> str:
    """One policy's tables: loops, shapes, refused moves, rollouts, what memory buys, creatures, margins."""
    tried = res.get("worlds_tried", res["starts"])
    lines = [f"{res['starts']} starts from {tried} worlds. inventory: its rows' agreement, every "
             f"frame; invented: share of tiles whose type is in neither the real frame nor the prompt.", "",
             "| loop n | row | recall (re-revealed tiles) | loop_acc (map, every frame) | inventory | invented |",
             "|---|---|---|---|---|---|"]
    for n, rows in res["loops"].items():
        lines += [f"| {n} | {name} | {_memory_cells(v)}" for name, v in rows.items()]
    if res.get("shapes"):
        lines += _shape_lines(res["shapes"])
    lines += _blocked_lines(res["blocked"])
    lines += _rollout_lines(res["rollout"])
    gains = window_gains(res, int(res.get("seed", 0)))
    if gains:
        lines += ["", "| memory: recall minus the 2-frame window's, start by start | row | difference |",
                  "|---|---|---|"]
        lines += [f"| {g['walk']} | {g['row']} | {g['mean']:+.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}] |" for g in gains]
    lines += creature_markdown(res.get("creatures"))
    lines += _margin_lines(baseline_margins(res.get("rollout", {}), int(res.get("seed", 0))))
    return "\n".join(lines) + "\n"


def _shape_lines(shapes: dict) -> list[str]:
    """The walk-shape table: a row per shape and model row, or why a shape was skipped or never made."""
    lines = ["", "| shape | frames | made / starts | row | recall (tiles the walk hid) | recall_far (hidden "
                 "in both frames before the last: beyond a copy from 2 frames back) | loop_acc (map) | "
                 "inventory | invented |", "|---|---|---|---|---|---|---|---|---|"]
    for name, v in shapes.items():
        if "skipped" in v:
            lines.append(f"| {name} | {v['frames']} | skipped: {v['skipped']} (shapes_beyond_context=true runs "
                         f"it) | | | | | | |")
            continue
        mark = " (beyond context: a control)" if v.get("beyond_context") else ""
        made = f"{v['made']} / {v['starts']}{mark}"
        if not v.get("rows"):
            lines.append(f"| {name} | {v['frames']} | {made} | | | | | | |")
        lines += [f"| {name} | {v['frames']} | {made} | {row} | {_memory_cells(r, far=True)}"
                  for row, r in v.get("rows", {}).items()]
    return lines


def _blocked_lines(b: dict | None) -> list[str]:
    """The blocked / free moves table, then the refused moves by what refused them (when counted)."""
    lines = ["", "| moves | n | model | real frames | map_acc |", "|---|---|---|---|---|"]
    for kind, key in (("blocked", "stayed"), ("free", "moved")) if b else ():
        v = b[kind]
        lines.append(f"| {kind} ({key}) | {v['n']} | {ci_cell(v.get(key, {}))} | {ci_cell(v.get('real_' + key, {}))} | "
                     f"{ci_cell(v.get('map_acc', {}))} |")
    if b and b.get("blocked", {}).get("by_type"):
        lines += ["", "Refused moves by what refused them (the share whose map stayed put; 95% bootstrap interval "
                      "over starts; placed: put there by Crafter's place action, then walked into):", "",
                  "| refused by | n | starts | model stayed | real frames | map_acc |", "|---|---|---|---|---|---|"]
        for name, v in type_rows(b["blocked"]["by_type"]):
            starts = f"{v.get('starts', 0)} of {v['tried']} worlds" if v.get("placed") else v.get("starts", 0)
            lines.append(f"| {name} | {v['n']} | {starts} | {ci_cell(v.get('stayed'))} | "
                         f"{ci_cell(v.get('real_stayed'))} | {ci_cell(v.get('map_acc'))} |")
    return lines


def _rollout_lines(rollout: dict) -> list[str]:
    lines = ["", "| rollout row | token agreement, mean over steps | at the last step | map | inventory | "
                 "invented, mean | at the last step | tile-mix distance (tv), mean | at the last step |",
             "|---|---|---|---|---|---|---|---|---|"]
    return lines + [f"| {name} | {ci_cell(v['mean'])} | {ci_cell(v['last'])} | {ci_cell(v.get('map_mean'))} | "
                    f"{ci_cell(v.get('inventory_mean'))} | {ci_cell(v.get('invented_mean'))} | "
                    f"{ci_cell(v.get('invented_last'))} | {ci_cell(v['tv_mean'])} | {ci_cell(v['tv_last'])} |"
                    for name, v in rollout.items()]


def _margin_lines(margins: list[dict]) -> list[str]:
    """Model rows minus the baselines, start by start (none: no lines)."""
    if not margins:
        return []
    lines = ["", "| rollout: model row minus baseline, start by start | token agreement, mean | map | "
                 "inventory |", "|---|---|---|---|"]
    return lines + [f"| {m['row']} - {m['baseline']} | " + " | ".join(
        f"{m[k]['mean']:+.3f} [{m[k]['lo']:+.3f}, {m[k]['hi']:+.3f}]" if m.get(k) else "" for k in
        ("mean", "map_mean", "inventory_mean")) + " |" for m in margins]


def creature_markdown(creatures: dict | None) -> list[str]:
    """The rollouts' creatures table: per row, each event per frame and its difference from the real frames'."""
    if not creatures:
        return []
    hidden = f"; not told from the ground by this VQ, so uncounted: {', '.join(creatures['hidden'])}" \
        if creatures["hidden"] else ""
    lines = ["", f"Creatures in the rollouts, per frame (cow, zombie, skeleton: {len(creatures['codes'])} codes"
                 f"{hidden}); entered / left: at the view's edge, popped: appeared or vanished inside it; (model - "
                 f"real): paired by start.", "",
             "| rollout row | " + " | ".join(CREATURE_EVENTS) + " | " +
             " | ".join(f"{k} - real" for k in CREATURE_EVENTS) + " |", "|---" * (1 + 2 * len(CREATURE_EVENTS)) + "|"]
    for name, v in creatures["rows"].items():
        diffs = [v.get(f"{k}_minus_real") for k in CREATURE_EVENTS]
        lines.append(f"| {name} | " + " | ".join(ci_cell(v[k]) for k in CREATURE_EVENTS) + " | " + " | ".join(
            f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" if d and d.get("lo") is not None else "" for d in
            diffs) + " |")
    return lines


def log_wandb(cfg: DictConfig, res: dict, columns: list[str], table: list[list], media: dict) -> None:
    """The curve, the summary numbers and the loop videos to the configured W&B run (as mcar evaluate logs)."""
    run = open_run(cfg)
    if run is None:
        return
    log_table(run, "world/rollout_agreement", columns, table,
              curve=("step", "agreement", "row", "token agreement per rollout step"))
    log_media(run, media)
    for policy, per in res["policies"].items():
        summarise(run.summary, per, f"{policy}/")


def summarise(summary, res: dict, prefix: str) -> None:
    """One policy's summary numbers into the W&B run summary, each key under `prefix`."""
    for n, rows in res["loops"].items():
        for name, v in rows.items():
            summary[f"{prefix}loop{n}/{name}/recall"] = v["recall"]["mean"]
    for shape, entry in res["shapes"].items():
        for name, v in entry.get("rows", {}).items():
            summary[f"{prefix}{shape}/{name}/recall"] = v["recall"]["mean"]
            if "recall_far" in v:
                summary[f"{prefix}{shape}/{name}/recall_far"] = v["recall_far"]["mean"]
    for kind, v in res["blocked"].items():
        for key in ("stayed", "moved"):
            if key in v:
                summary[f"{prefix}{kind}/{key}"] = v[key]["mean"]
    for name, v in res["blocked"].get("blocked", {}).get("by_type", {}).items():
        summary[f"{prefix}blocked/{name}/n"] = v["n"]
        if "stayed" in v:
            summary[f"{prefix}blocked/{name}/stayed"] = v["stayed"]["mean"]
