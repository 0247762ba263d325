"""The paper's MC-AR table 3 on Crafter: pre-train, evaluate NTP and DiagD without fine-tuning, fine-tune with
the DiagD mask (proxy slots), the paper's plain DiagD mask and the causal mask (the control), each once per seed
(table3.finetune.seeds), evaluate each on the same held-out clips with the sampler it was tuned for, and write the
table to outputs/table3/<name>/table3.md (and table3.json): every fine-tuned row pooled over its seeds, the share of
the NTP-DiagD gap each fine-tuning closes and each DiagD mask against the causal control, with 95% intervals over
seeds and clips (a two-level bootstrap: the clips paired across models).

    mcar table3 experiment=crafter_table3_cpu        # CPU pipeline check, ~1 h (RESULTS.md, table 3)
    mcar table3 experiment=crafter_table3            # GPU scale
    mcar table3 experiment=crafter_table3_cpu trainer.max_steps=50 table3.finetune.steps=10  # smoke

Every stage is one of the project's documented commands (mcar train, mcar idm, mcar finetune, mcar evaluate),
run as a subprocess, printed, and logged to outputs/table3/<name>/logs/. Finished
stages are recorded in outputs/table3/<name>/state.json and skipped on a re-run; an interrupted training stage
resumes from its last checkpoint. Extra overrides go to the training stages; data/vq/paths/logger/seed overrides
go to every stage. The experiment config's `table3` block lists the samplers, fine-tunings and evaluation settings.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from mcar.atomic import write_atomic
from mcar.config_checks import check_before_run
from mcar.data.common import build_datamodule
from mcar.eval import metric_registry as R
from mcar.eval import stats as S
from mcar.hydra_app import COMPOSE_ERRORS, override_error, register_resolvers

SHARED_PREFIXES = ("data.", "vq.", "vq=", "paths.", "logger", "seed=")  # forwarded to every stage
# the gap closed on each: the columns with a better way (not unchanged or dynamic_degree, whose aim is the real clips')
GAP_METRICS = ["token_acc", "loss_tf", "psnr", "ssim", "subject_consistency", "imaging_quality", "action_acc", "fvd",
               "action_f1"]
TABLE_COLUMNS = ["fvd", "token_acc", "psnr", "ssim", "subject_consistency", "dynamic_degree", "imaging_quality",
                 "unchanged", "action_f1", "loss_tf", "fps", "tp", "step"]


# ------------------------------------------------------------------------------------------------ config
def compose_experiment(overrides: list[str]) -> DictConfig:
    """The training config of `experiment=...` + overrides, with hydra's choices (which data option)."""
    from hydra import compose, initialize_config_module

    if not any(o.startswith("experiment=") for o in overrides):
        raise ValueError("experiment= is required, e.g. mcar table3 experiment=crafter_table3_cpu")
    register_resolvers()
    try:
        with initialize_config_module(config_module="mcar.conf", version_base="1.3"):
            cfg = compose("train", overrides, return_hydra_config=True)
    except COMPOSE_ERRORS as e:  # a bad override: one line naming it, as every tool says it (the training config's)
        raise SystemExit(override_error("train", overrides, e).replace("mcar train:", "mcar table3:", 1)) from None
    if "table3" not in cfg:
        raise ValueError(f"{[o for o in overrides if o.startswith('experiment=')][0]}: the experiment config has "
                         f"no `table3` block (see conf/experiment/crafter_table3_cpu.yaml)")
    t = cfg.table3
    for label, run in t.finetune.runs.items():
        missing = [s for s in run.samplers if s not in t.samplers]
        if missing:
            raise ValueError(f"table3.finetune.runs.{label}.samplers: {missing} are not in table3.samplers "
                             f"({list(t.samplers)})")
    from mcar.eval.scoring import REFERENCES

    bad = [k for k in t.get("references", []) if k not in REFERENCES]
    if bad:
        raise ValueError(f"table3.references: {bad} are not reference rows ({list(REFERENCES)})")
    for key in ("ntp", "diagd"):
        if t.gap[key] not in t.samplers:
            raise ValueError(f"table3.gap.{key}={t.gap[key]!r} is not in table3.samplers ({list(t.samplers)})")
    control = t.gap.get("control")
    if control is not None and t.gap.diagd not in t.finetune.runs.get(control, {}).get("samplers", []):
        raise ValueError(f"table3.gap.control={control!r}: name a fine-tuning of table3.finetune.runs "
                         f"({list(t.finetune.runs)}) evaluated with {t.gap.diagd}")
    if t.gap.get("primary", GAP_METRICS[0]) not in GAP_METRICS:
        raise ValueError(f"table3.gap.primary={t.gap.primary!r}: choose one of {GAP_METRICS}")
    for label, run in (t.get("scratch") or {}).items():
        missing = [x for x in run.samplers if x not in t.samplers]
        if missing or run.versus not in t.finetune.runs:
            raise ValueError(f"table3.scratch.{label}: samplers {list(run.samplers)} must be in table3.samplers and "
                             f"versus={run.versus!r} a fine-tuning of table3.finetune.runs ({list(t.finetune.runs)})")
    seeds = list(t.finetune.get("seeds") or [])
    if not seeds or not all(isinstance(s, int) for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"table3.finetune.seeds={seeds}: a list of distinct integers, e.g. [0, 1, 2]")
    return cfg


# ------------------------------------------------------------------------------------------------ stages
class Stages:
    """Runs commands once: state.json remembers finished stages (and their wall time) across re-runs."""

    def __init__(self, out: Path, dry_run: bool = False):
        self.out, self.dry_run = out, dry_run
        self.state_file = out / "state.json"
        self.state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}

    def done(self, key: str) -> bool:
        return key in self.state

    def run(self, key: str, cmd: list[str], resume_from: Path | None = None) -> None:
        """Run `cmd` unless `key` finished before; a training stage whose last.ckpt exists resumes from it."""
        if self.done(key):
            print(f"[table3] {key}: done before ({self.state[key]['seconds']:.0f} s), skipped", flush=True)
            return
        log = self.out / "logs" / (key.replace("/", "__") + ".log")
        if resume_from is not None and resume_from.exists():
            cmd = cmd + ["ckpt_path=last"]
        shown = " ".join(cmd[1:] if cmd[0] == sys.executable else cmd)
        print(f"[table3] {key}: python {shown}", flush=True)
        if self.dry_run:
            return
        log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(log, "ab") as f:
            f.write(f"\n$ {shown}\n".encode())
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            while chunk := p.stdout.read1(1 << 16):  # the stage's own progress bars, live, and into its log
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                f.write(chunk)
            rc = p.wait()
        if rc != 0:
            raise RuntimeError(f"table3 stage {key} failed (exit {rc}); its log: {log}. Fix and re-run: finished "
                               f"stages are skipped, a training stage resumes from its last checkpoint")
        self.state[key] = {"seconds": time.perf_counter() - t0, "finished": dt.datetime.now().isoformat("T", "seconds")}
        write_atomic(self.state_file, json.dumps(self.state, indent=2))


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def run_pipeline(overrides: list[str], dry_run: bool = False) -> Path:
    """All stages of the experiment, then the table; -> the table written (its run folder's table3.md)."""
    cfg = compose_experiment(overrides)
    check_before_run("table3", cfg=cfg)  # a bad value is said now, not after an hour's pre-training
    t = cfg.table3
    out = Path(cfg.paths.root_dir) / "outputs" / "table3" / t.name
    stages = Stages(out, dry_run)
    shared = [o for o in overrides if o.startswith(SHARED_PREFIXES)]
    data = [f"data={cfg.hydra.runtime.choices.data}", *(o for o in shared if not o.startswith("logger"))]
    if cfg.data.get("root"):  # where the data is read: the experiment's, said again (a checkpoint never says it)
        data.append(f"data.root={cfg.data.root}")
    pre_ckpt = Path(cfg.checkpoint.dir) / "last.ckpt"
    idm = Path(cfg.paths.checkpoint_root) / f"{t.name}-idm" / "idm.pt"

    stages.run("pretrain", python("-m", "mcar.cli", "train", *overrides, f"hydra.run.dir={out}/pretrain"),
               resume_from=pre_ckpt)
    stages.run("idm", python("-m", "mcar.cli", "idm", *data, *t.idm, f"out={idm}", f"hydra.run.dir={out}/idm"))

    logger = [o for o in shared if o.startswith("logger")]

    def evaluate(model: str, ckpt: Path, sampler: str, *extra: str) -> None:
        stages.run(f"eval/{model}/{sampler}", python(
            "-m", "mcar.cli", "evaluate", *data, *logger, f"ckpt={ckpt}", f"name={model}", f"idm={idm}", *t.evaluate,
            *t.samplers[sampler], *extra, f"run_name=eval-{t.name}-{model}-{sampler}",
            f"hydra.run.dir={out}/eval/{model}/{sampler}"))

    for sampler in t.samplers:  # the reference rows (no model: copy_last, noise) come with the NTP evaluation
        kinds = list(t.get("references", []))
        refs = [f"references=[{','.join(kinds)}]"] if sampler == t.gap.ntp and kinds else []
        evaluate("pretrained", pre_ckpt, sampler, *refs)
    for seed in seeds_of(t):  # every fine-tuning of one seed, then the next: a short budget still pairs them
        for label, ft in t.finetune.runs.items():
            run_name = f"{t.name}-ft-{label}-seed{seed}"
            ft_ckpt = Path(cfg.paths.checkpoint_root) / run_name / "last.ckpt"
            stages.run(f"finetune/{label}/seed{seed}", python(
                "-m", "mcar.cli", "finetune", *overrides, *t.finetune.overrides, *ft.overrides,
                f"init_from={pre_ckpt}", f"steps={t.finetune.steps}", f"seed={seed}", f"data.seed={seed}",
                f"run_name={run_name}",
                f"hydra.run.dir={out}/finetune/{label}/seed{seed}"), resume_from=ft_ckpt)
            for sampler in ft.samplers:
                evaluate(tuned_model(label, seed), ft_ckpt, sampler)
    for label, run in (t.get("scratch") or {}).items():  # the mask from the first step, at equal total steps
        run_name = f"{t.name}-scratch-{label}"
        ckpt = Path(cfg.paths.checkpoint_root) / run_name / "last.ckpt"
        stages.run(f"scratch/{label}", python(
            "-m", "mcar.cli", "train", *overrides, *run.overrides, f"trainer.max_steps={scratch_steps(cfg)}",
            f"run_name={run_name}", f"hydra.run.dir={out}/scratch/{label}"), resume_from=ckpt)
        for sampler in run.samplers:
            evaluate(f"scratch_{label}", ckpt, sampler)
    if dry_run:
        return out
    return write_results(cfg, out, stages.state, overrides)


def seeds_of(t: DictConfig) -> list[int]:
    """The fine-tuning seeds (table3.finetune.seeds): each fine-tuning runs once per seed from the one checkpoint,
    as `seed=` and `data.seed=` (the batch order is a pure function of data.seed: without it every seed trains on
    the same batches from the same weights, the same model)."""
    return [int(s) for s in t.finetune.seeds]


def scratch_steps(cfg: DictConfig) -> int:
    """A run trained from scratch gets the pre-training's steps plus one fine-tuning's: equal total steps."""
    return int(cfg.trainer.max_steps) + int(cfg.table3.finetune.steps)


def tuned_model(label: str, seed: int) -> str:
    return f"ft_{label}_seed{seed}"


# ------------------------------------------------------------------------------------------------ the table
def read_row(out: Path, model: str, sampler: str) -> dict:
    """The evaluation's own row, with its per-clip values under "per_clip" ({} from an older evaluation)."""
    res = json.loads((out / "eval" / model / sampler / "results.json").read_text())
    row = res["rows"][0]
    return row | {"per_clip": res.get("extra", {}).get(row["sampler"], {}).get("per_clip", {})}


def pool_of(key: str):
    """How a metric's per-clip values pool (the registry's; LOSS_TF's clips: their mean)."""
    return R.column(key).pool or R.mean_of


def pooled_row(rows: list[dict], draws: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """One fine-tuning's evaluations over seeds -> one row: each metric with per-clip values pooled over every
    seed's clips, its interval from `draws` (seeds and clips resampled: S.resample_seeds_and_clips); any other
    number the mean over seeds; `per_clip` the (seeds, clips) values."""
    seeds, clips = draws
    out = {k: v for k, v in rows[0].items() if k != "per_clip"} | {"seeds": len(rows)}
    for key, value in rows[0].items():
        numbers = [R.number(r.get(key)) for r in rows]
        if key != "per_clip" and value is not None and None not in numbers and not key.endswith(("_lo", "_hi")):
            same_int = all(isinstance(n, int) for n in numbers) and len(set(numbers)) == 1
            out[key] = numbers[0] if same_int else sum(numbers) / len(numbers)
    common = set.intersection(*(set(r["per_clip"]) for r in rows))
    out["per_clip"] = {k: torch.tensor([r["per_clip"][k] for r in rows], dtype=torch.float64) for k in common}
    for key, values in out["per_clip"].items():
        out[key] = float(pool_of(key)(values.flatten()))
        out[f"{key}_lo"], out[f"{key}_hi"] = S.central(S.pooled_draws(values, seeds, clips, pool_of(key)))
    return out


def read_references(out: Path, sampler: str, kinds) -> list[dict]:
    """The reference rows (copy_last, noise, ...) the pre-trained `sampler` evaluation scored beside its own."""
    res = json.loads((out / "eval" / "pretrained" / sampler / "results.json").read_text())
    by_label = {r["sampler"]: r for r in res["rows"]}
    missing = [k for k in kinds if k not in by_label]
    if missing:
        raise ValueError(f"{out}/eval/pretrained/{sampler}/results.json has no {missing} rows: that evaluation ran "
                         f"before table3.references listed them; delete its entry from state.json and re-run")
    return [by_label[k] for k in kinds]


def metric_draws(row: dict, draws, key: str) -> torch.Tensor | None:
    """(resamples,) values of `key` for a row (one model or several seeds) over the bootstrap `draws`; None where
    the row lacks per-clip values."""
    if key not in row.get("per_clip", {}):
        return None
    seeds, clips = draws
    values = torch.as_tensor(row["per_clip"][key], dtype=torch.float64)
    return S.pooled_draws(values.view(-1, values.shape[-1]), seeds, clips, pool_of(key))


def gap_draws(pre_ntp: dict, pre_diagd: dict, tuned: dict, key: str) -> torch.Tensor | None:
    """(resamples,) shares of the gap closed on `key`, each from one draw of clips (shared by the three rows) and
    of each row's seeds (its `draws`); None where a row lacks the per-clip values."""
    a, b, c = (metric_draws(r, r["draws"], key) for r in (pre_ntp, pre_diagd, tuned))
    return None if a is None or b is None or c is None else (c - b) / (a - b)


def better_sign(key: str) -> int:
    """+1 where higher is better, -1 where lower is (a difference times this: > 0 = better)."""
    return -1 if R.column(key).better == "lower" else 1


def gap_closed(pre_ntp: dict, pre_diagd: dict, tuned: dict) -> dict:
    """{metric: fraction of the pre-trained NTP-DiagD gap the tuned DiagD row closes} (None: no gap/metric).
    1 = tuned DiagD as good as pre-trained NTP; 0 = no better than untuned DiagD; < 0 = worse."""
    out = {}
    for m in GAP_METRICS:
        a, b, c = R.number(pre_ntp.get(m)), R.number(pre_diagd.get(m)), R.number(tuned.get(m))
        out[m] = None if None in (a, b, c) or a == b else (c - b) / (a - b)
    return out


def table_md(rows: list[dict]) -> list[str]:
    """The table3.md table: setting, sampler, then TABLE_COLUMNS as results.md writes them (headers, digits and
    bootstrap intervals from the metric registry); action F1 carries the IDM's ceiling in brackets."""
    head = ["setting", "sampler"] + [("action F1 (GT)" if k == "action_f1" else R.column(k).header)
                                     for k in TABLE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["setting"], r["sampler"]]
        for key in TABLE_COLUMNS:
            v = R.cell(r, key)
            if key == "action_f1" and R.number(r.get("action_f1_gt")) is not None:
                v += f" ({r['action_f1_gt']:.3f})"
            cells.append(v)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def facts(cfg: DictConfig) -> dict:
    """Model size, data size, steps and machine, for the table's header."""
    from mcar.checkpoint.io import load_checkpoint

    state = load_checkpoint(Path(cfg.checkpoint.dir) / "last.ckpt")
    arch = cfg.model.arch
    data = cfg.data
    try:
        dm = build_datamodule(data)
        dm.setup("fit")
        clips = f"{len(dm.train_source)} training / {len(dm.val_source)} held-out {data.clip_frames}-frame clips"
        tokens = getattr(dm, "tokens_dir", None)
    except Exception as e:  # the table is still written; the fact says why it is missing
        clips, tokens = f"clip counts unavailable: {e}", None
    episodes = (f"{data.episodes} episodes x {data.frames_per_episode} frames, the last {data.val_episodes} held "
                f"out; " if "episodes" in data else "")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"model": cfg.model.name, "params": sum(v.numel() for v in state["state_dict"].values()),
            "arch": f"dim {arch.dim}, {arch.n_layers} layers, {arch.n_heads} heads, MLP {arch.mlp_dim}, "
                    f"vocab {arch.vocab_size}",
            "data": f"{data.name}: {episodes}{clips}" + (f"; tokens `{Path(str(tokens)).name}`" if tokens else ""),
            "batch_size": data.batch_size, "pretrain_steps": cfg.trainer.max_steps,
            "finetune_steps": cfg.table3.finetune.steps,
            "machine": f"{gpu or 'CPU only'}; {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"
                       f"; torch {torch.__version__}",
            "date": dt.date.today().isoformat()}


def wall_times(state: dict) -> str:
    """'Wall time T min: pretrain ..., N evaluations ... (minutes).' from state.json's stages."""
    minutes = {k: v["seconds"] / 60 for k, v in state.items()}
    evals = [m for k, m in minutes.items() if k.startswith("eval/")]
    runs = ", ".join(f"{k} {m:.1f}" for k, m in minutes.items() if not k.startswith("eval/"))
    return (f"Wall time {sum(minutes.values()):.1f} min: {runs}, {len(evals)} evaluations {sum(evals):.1f} "
            f"(minutes).")


def model_rows(cfg: DictConfig, out: Path) -> list[dict]:
    """The table's rows: each pre-trained evaluation, each fine-tuning x sampler pooled over its seeds (intervals
    over seeds and clips), the references; each row's `key` (model, sampler) and `draws` (its bootstrap draws)."""
    t = cfg.table3
    n_seeds = len(seeds_of(t))
    first = read_row(out, "pretrained", t.gap.ntp)
    n_clips = len(next(iter(first["per_clip"].values()), [])) or 1
    (one, tuned), clips = S.resample_seeds_and_clips([1, n_seeds], n_clips, int(cfg.seed), R.CI_RESAMPLES)
    rows = []
    for sampler in t.samplers:
        rows.append({"setting": "pre-trained, no fine-tuning", "key": ("pretrained", sampler), "draws": (one, clips),
                     **pooled_row([read_row(out, "pretrained", sampler)], (one, clips))})
    for label, ft in t.finetune.runs.items():
        mask = " ".join(o for o in ft.overrides)
        for sampler in ft.samplers:
            evals = [read_row(out, tuned_model(label, seed), sampler) for seed in seeds_of(t)]
            rows.append({"setting": f"fine-tuned {t.finetune.steps} steps: {mask} ({n_seeds} seeds)",
                         "key": (f"ft_{label}", sampler), "draws": (tuned, clips),
                         **pooled_row(evals, (tuned, clips)), "model": f"ft_{label}"})
    for label, run in (t.get("scratch") or {}).items():
        mask = " ".join(o for o in run.overrides)
        for sampler in run.samplers:
            rows.append({"setting": f"trained from scratch {scratch_steps(cfg)} steps: {mask}",
                         "key": (f"scratch_{label}", sampler), "draws": (one, clips),
                         **pooled_row([read_row(out, f"scratch_{label}", sampler)], (one, clips))})
    for ref in read_references(out, t.gap.ntp, list(t.get("references", []))):  # no model: what the metrics read
        rows.append({"setting": "reference, no model", "key": ("reference", ref["sampler"]), **ref})
    return rows


def gap_table(t: DictConfig, by_key: dict) -> tuple[dict, dict, dict, list[str]]:
    """The pre-trained NTP-DiagD gap, the share of it each fine-tuning closes, and each DiagD-mask fine-tuning
    against the causal control (the difference of their values, > 0 = better), each with its 95% interval over
    seeds and clips (the clips paired) -> (gap, shares, versus, the markdown lines)."""
    pre_ntp, pre_diagd = by_key[("pretrained", t.gap.ntp)], by_key[("pretrained", t.gap.diagd)]
    diagd_rows = {label: by_key[(f"ft_{label}", t.gap.diagd)] for label, ft in t.finetune.runs.items()
                  if t.gap.diagd in ft.samplers}
    gap = {m: {"ntp": pre_ntp[m], "diagd": pre_diagd[m], **d} for m in GAP_METRICS
           if (d := difference(pre_ntp, pre_diagd, m)) is not None}
    shares = {}
    for label, tuned in diagd_rows.items():
        point = gap_closed(pre_ntp, pre_diagd, tuned)
        shares[label] = {}
        for m in GAP_METRICS:
            d = gap_draws(pre_ntp, pre_diagd, tuned, m) if point[m] is not None else None
            shares[label][m] = {"share": point[m], "interval": S.central(d) if d is not None else None}
    control = t.gap.get("control")
    versus = {label: {m: difference(tuned, diagd_rows[control], m) for m in GAP_METRICS}
              for label, tuned in diagd_rows.items() if control in diagd_rows and label != control}

    head = ["| | " + " | ".join(GAP_METRICS) + " |", "|" + " --- |" * (len(GAP_METRICS) + 1)]
    lines = [f"The gap without fine-tuning: pre-trained NTP ({t.gap.ntp}) minus DiagD ({t.gap.diagd}), signed so "
             f"that > 0 means NTP is better, 95% interval over clips:", "", *head,
             "| NTP - DiagD | " + " | ".join(signed_cell(gap.get(m), "difference") for m in GAP_METRICS) + " |", "",
             "Share of that gap each fine-tuning closes, 95% interval over seeds and clips (1 = as good as NTP, "
             "0 = no change, < 0 = worse; 'no gap' where the interval above does not put NTP ahead: there is "
             "nothing to close; the paper's fine-tuning closes 0.43 of its FVD gap):", "", *head]
    lines += [f"| {label} | " + " | ".join(share_cell(g[m], gap.get(m)) for m in GAP_METRICS) + " |"
              for label, g in shares.items()]
    primary = t.gap.get("primary", GAP_METRICS[0])
    lines += ["", verdict_gap(primary, gap.get(primary))]
    if versus:
        lines += ["", f"Each DiagD-mask fine-tuning against the causal control ({control}), both sampled with "
                      f"{t.gap.diagd}: the difference of their values, > 0 = better than the control, 95% interval "
                      f"over seeds and clips (the clips paired):", "", *head]
        lines += [f"| {label} - {control} | " + " | ".join(signed_cell(v[m], "difference") for m in GAP_METRICS) + " |"
                  for label, v in versus.items()]
        lines += [""] + [verdict(label, "the causal control", primary, v[primary]) for label, v in versus.items()]
    return gap, shares, versus, lines


def signed_cell(x: dict | None, key: str) -> str:
    """'+0.123 [+0.010, +0.200]' (x[key] and its interval), or 'n/a'."""
    if x is None or x[key] is None:
        return "n/a"
    lo_hi = f" [{x['interval'][0]:+.3f}, {x['interval'][1]:+.3f}]" if x["interval"] else ""
    return f"{x[key]:+.3f}{lo_hi}"


def share_cell(share: dict, gap: dict | None) -> str:
    """A share of the gap closed, or 'no gap' where the pre-trained NTP is not measurably ahead of DiagD."""
    if gap is not None and (gap["interval"][0] <= 0 if gap["interval"] else gap["difference"] <= 0):
        return "no gap"
    return signed_cell(share, "share")


def difference(row: dict, other: dict, key: str) -> dict | None:
    """row minus other on `key`, signed so that > 0 = row is better, with its 95% interval over each row's own
    seed draws and the shared clip draws; None where either lacks the value."""
    a, b = R.number(row.get(key)), R.number(other.get(key))
    if a is None or b is None:
        return None
    da, db = metric_draws(row, row["draws"], key), metric_draws(other, other["draws"], key)
    return {"difference": better_sign(key) * (a - b),
            "interval": S.central(better_sign(key) * (da - db)) if da is not None and db is not None else None}


def scratch_table(t: DictConfig, by_key: dict) -> tuple[dict, list[str]]:
    """Each run trained from scratch against the fine-tuning it answers (`versus`), with the same sampler."""
    found, lines = {}, []
    primary = t.gap.get("primary", GAP_METRICS[0])
    for label, run in (t.get("scratch") or {}).items():
        for sampler in run.samplers:
            if sampler not in t.finetune.runs[run.versus].samplers:
                continue
            mine, theirs = by_key[(f"scratch_{label}", sampler)], by_key[(f"ft_{run.versus}", sampler)]
            found[f"{label} - {run.versus}, {sampler}"] = d = {m: difference(mine, theirs, m) for m in GAP_METRICS}
            if not lines:
                lines = ["Trained from scratch with the fine-tuning's mask vs causal pre-training + that fine-tuning, "
                         "equal total steps, the same sampler: the difference of their values, > 0 = from scratch is "
                         "better, 95% interval over seeds and clips:", "",
                         "| | " + " | ".join(GAP_METRICS) + " |", "|" + " --- |" * (len(GAP_METRICS) + 1)]
            lines.append(f"| scratch {label} - {run.versus} ({sampler}) | "
                         + " | ".join(signed_cell(d[m], "difference") for m in GAP_METRICS) + " |")
            lines.append(verdict(f"trained from scratch ({label}, {sampler})", f"{run.versus} fine-tuned", primary,
                                 d[primary]))
    return found, lines + ([""] if lines else [])


def verdict_gap(metric: str, gap: dict | None) -> str:
    """One plain sentence: does DiagD without fine-tuning lose to NTP on the primary metric?"""
    if gap is None or gap["interval"] is None:
        return f"- Without fine-tuning, the gap on {metric} cannot be measured (no per-clip values)."
    lo, hi = gap["interval"]
    said = ("DiagD loses to NTP" if lo > 0 else "DiagD beats NTP: there is no gap to close" if hi < 0 else
            "DiagD and NTP are not distinguishable: no measurable gap to close")
    return f"- Without fine-tuning, on {metric}: {said} (NTP - DiagD {gap['difference']:+.3f}, [{lo:+.3f}, {hi:+.3f}])."


def verdict(subject: str, other: str, metric: str, versus: dict | None) -> str:
    """One plain sentence: is `subject` better than `other` on the primary metric, by its interval?"""
    if versus is None or versus["interval"] is None:
        return f"- {subject} vs {other} on {metric}: not measurable (no per-clip values)."
    lo, hi = versus["interval"]
    said = "beats" if lo > 0 else "does worse than" if hi < 0 else "is not distinguishable from"
    return f"- {subject} {said} {other} on {metric} ({versus['difference']:+.3f}, [{lo:+.3f}, {hi:+.3f}])."


def write_results(cfg: DictConfig, out: Path, state: dict, overrides: list[str]) -> Path:
    """table3.json and table3.md in the run folder `out` (a doc that quotes them is edited by hand)."""
    t = cfg.table3
    rows = model_rows(cfg, out)
    by_key = {r["key"]: r for r in rows}
    gap, shares, versus, gap_lines = gap_table(t, by_key)
    scratch, scratch_lines = scratch_table(t, by_key)
    info = facts(cfg)
    saved = [{k: v for k, v in r.items() if k not in ("key", "draws", "per_clip")} for r in rows]
    payload = {"rows": saved, "gap": gap, "gap_closed": shares, "versus_control": versus, "scratch": scratch,
               "seeds": seeds_of(t), "facts": info, "stages": state}
    write_atomic(out / "table3.json", json.dumps(payload, indent=2, default=str))

    lines = [f"## {t.name}: {t.label}", "",
             f"Command: `mcar table3 {' '.join(overrides)}`  ",
             f"Machine: {info['machine']}; {info['date']}. {wall_times(state)}", "",
             f"Model: `{info['model']}`, {info['params'] / 1e6:.2f}M parameters ({info['arch']}). "
             f"Data: {info['data']}. Pre-training "
             f"{info['pretrain_steps']} steps of batch {info['batch_size']} with the causal mask; each fine-tuning "
             f"{info['finetune_steps']} steps from that checkpoint, once per seed ({', '.join(map(str, seeds_of(t)))})"
             f". Evaluation: `{' '.join(t.evaluate)}` on the same held-out clips for every model, 1 prompt frame + "
             f"every action given.", "",
             *table_md(rows), "",
             R.glossary(TABLE_COLUMNS) + " (in brackets after action F1: the IDM on the real frames). "
             "[low, high]: 95% bootstrap interval over clips, and over seeds for the fine-tuned rows (their values "
             "pool every seed's clips; FVD, action F1, FPS, TP: the mean over seeds). Reference rows: ground_truth "
             "(the held-out clips themselves), copy_last (the last prompt frame repeated: nothing moves), noise "
             "(random tokens).", "", *gap_lines, "", *scratch_lines]
    section = "\n".join(lines).rstrip("\n") + "\n"
    write_atomic(out / "table3.md", section)
    print(section, flush=True)
    return out / "table3.md"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return
    dry = "--dry-run" in args
    run_pipeline([a for a in args if a != "--dry-run"], dry_run=dry)
