"""The paper's MC-AR table 3 on Crafter: pre-train, evaluate NTP and DiagD without fine-tuning, fine-tune with
the DiagD mask (proxy slots), the paper's plain DiagD mask and the causal mask (the control), evaluate each with
the sampler it was tuned for, and write the table to RESULTS.md.

    mcar table3 experiment=crafter_table3_cpu        # CPU pipeline check, ~1 h (RESULTS.md)
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

from mcar.data.common import build_datamodule
from mcar.data.files import write_atomic
from mcar.eval import metric_registry as R
from mcar.eval.metrics import fmt
from mcar.hydra_app import register_resolvers

SHARED_PREFIXES = ("data.", "vq.", "vq=", "paths.", "logger", "seed=")  # forwarded to every stage
GAP_METRICS = ["fvd", "psnr", "ssim", "token_acc", "action_f1", "loss_tf"]  # the gap each fine-tuning closes
TABLE_COLUMNS = ["fvd", "token_acc", "psnr", "ssim", "unchanged", "action_f1", "loss_tf", "fps", "tp", "step"]


# ------------------------------------------------------------------------------------------------ config
def compose_experiment(overrides: list[str]) -> DictConfig:
    """The training config of `experiment=...` + overrides, with hydra's choices (which data option)."""
    from hydra import compose, initialize_config_module

    if not any(o.startswith("experiment=") for o in overrides):
        raise ValueError("experiment= is required, e.g. mcar table3 experiment=crafter_table3_cpu")
    register_resolvers()
    with initialize_config_module(config_module="mcar.conf", version_base="1.3"):
        cfg = compose("train", overrides, return_hydra_config=True)
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
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        tmp.replace(self.state_file)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def run_pipeline(overrides: list[str], dry_run: bool = False) -> Path:
    """All stages of the experiment, then the table; -> the RESULTS file written."""
    cfg = compose_experiment(overrides)
    t = cfg.table3
    out = Path(cfg.paths.root_dir) / "outputs" / "table3" / t.name
    stages = Stages(out, dry_run)
    shared = [o for o in overrides if o.startswith(SHARED_PREFIXES)]
    data = [f"data={cfg.hydra.runtime.choices.data}", *(o for o in shared if not o.startswith("logger"))]
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
    for label, ft in t.finetune.runs.items():
        run_name = f"{t.name}-ft-{label}"
        ft_ckpt = Path(cfg.paths.checkpoint_root) / run_name / "last.ckpt"
        stages.run(f"finetune/{label}", python(
            "-m", "mcar.cli", "finetune", *overrides, *t.finetune.overrides, *ft.overrides, f"init_from={pre_ckpt}",
            f"steps={t.finetune.steps}", f"run_name={run_name}", f"hydra.run.dir={out}/finetune/{label}"),
            resume_from=ft_ckpt)
        for sampler in ft.samplers:
            evaluate(f"ft_{label}", ft_ckpt, sampler)
    if dry_run:
        return out
    return write_results(cfg, out, stages.state, Path(cfg.paths.root_dir) / "RESULTS.md")


# ------------------------------------------------------------------------------------------------ the table
def read_row(out: Path, model: str, sampler: str) -> dict:
    res = json.loads((out / "eval" / model / sampler / "results.json").read_text())
    return res["rows"][0]


def read_references(out: Path, sampler: str, kinds) -> list[dict]:
    """The reference rows (copy_last, noise, ...) the pre-trained `sampler` evaluation scored beside its own."""
    res = json.loads((out / "eval" / "pretrained" / sampler / "results.json").read_text())
    by_label = {r["sampler"]: r for r in res["rows"]}
    missing = [k for k in kinds if k not in by_label]
    if missing:
        raise ValueError(f"{out}/eval/pretrained/{sampler}/results.json has no {missing} rows: that evaluation ran "
                         f"before table3.references listed them; delete its entry from state.json and re-run")
    return [by_label[k] for k in kinds]


def gap_closed(pre_ntp: dict, pre_diagd: dict, tuned: dict) -> dict:
    """{metric: fraction of the pre-trained NTP-DiagD gap the tuned DiagD row closes} (None: no gap/metric).
    1 = tuned DiagD as good as pre-trained NTP; 0 = no better than untuned DiagD; < 0 = worse."""
    out = {}
    for m in GAP_METRICS:
        a, b, c = R.number(pre_ntp.get(m)), R.number(pre_diagd.get(m)), R.number(tuned.get(m))
        out[m] = None if None in (a, b, c) or a == b else (c - b) / (a - b)
    return out


def table_md(rows: list[dict]) -> list[str]:
    """The RESULTS.md table: setting, sampler, then TABLE_COLUMNS as results.md writes them (headers, digits and
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
    """Model size, data size, steps and machine, for the RESULTS section."""
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


def write_results(cfg: DictConfig, out: Path, state: dict, results_md: Path) -> Path:
    t = cfg.table3
    rows = []
    for sampler in t.samplers:
        rows.append({"setting": "pre-trained, no fine-tuning", "key": ("pretrained", sampler),
                     **read_row(out, "pretrained", sampler)})
    for label, ft in t.finetune.runs.items():
        mask = " ".join(o for o in ft.overrides)
        for sampler in ft.samplers:
            rows.append({"setting": f"fine-tuned {t.finetune.steps} steps: {mask}", "key": (f"ft_{label}", sampler),
                         **read_row(out, f"ft_{label}", sampler)})
    # no model: what the metrics read against
    for ref in read_references(out, t.gap.ntp, list(t.get("references", []))):
        rows.append({"setting": "reference, no model", "key": ("reference", ref["sampler"]), **ref})
    by_key = {r["key"]: r for r in rows}
    pre_ntp, pre_diagd = by_key[("pretrained", t.gap.ntp)], by_key[("pretrained", t.gap.diagd)]
    gaps = {label: gap_closed(pre_ntp, pre_diagd, by_key[(f"ft_{label}", t.gap.diagd)])
            for label, ft in t.finetune.runs.items() if t.gap.diagd in ft.samplers}
    info = facts(cfg)
    payload = {"rows": [{k: v for k, v in r.items() if k != "key"} for r in rows], "gap_closed": gaps,
               "facts": info, "stages": state}
    write_atomic(out / "table3.json", json.dumps(payload, indent=2, default=str))

    lines = [f"<!-- table3:{t.name} start (written by mcar table3; do not edit by hand) -->",
             f"## {t.name}: {t.label}", "",
             f"Command: `mcar table3 {' '.join(sys.argv[1:]) or 'experiment=' + t.name}`  ",
             f"Machine: {info['machine']}; {info['date']}. {wall_times(state)}", "",
             f"Model: `{info['model']}`, {info['params'] / 1e6:.2f}M parameters ({info['arch']}). "
             f"Data: {info['data']}. Pre-training "
             f"{info['pretrain_steps']} steps of batch {info['batch_size']} with the causal mask; each fine-tuning "
             f"{info['finetune_steps']} steps from that checkpoint. Evaluation: `{' '.join(t.evaluate)}` on held-out "
             f"clips, 1 prompt frame + every action given.", "",
             *table_md(rows), "",
             R.glossary(TABLE_COLUMNS) + " (in brackets after action F1: the IDM on the real frames). "
             + R.ci_note() + ". Reference rows: ground_truth (the held-out clips themselves), copy_last (the last "
             "prompt frame repeated: nothing moves), noise (random tokens).", "",
             f"Fraction of the pre-trained NTP ({t.gap.ntp}) - DiagD ({t.gap.diagd}) gap each fine-tuning closes "
             f"(1 = as good as NTP, 0 = no change, < 0 = worse; the paper's fine-tuning closes 0.43 of its FVD "
             f"gap):", "",
             "| fine-tuning | " + " | ".join(GAP_METRICS) + " |", "|" + " --- |" * (len(GAP_METRICS) + 1)]
    lines += [f"| {label} | " + " | ".join(fmt(g[m]) for m in GAP_METRICS) + " |" for label, g in gaps.items()]
    gap_row = {m: (R.number(pre_ntp.get(m)), R.number(pre_diagd.get(m))) for m in GAP_METRICS}
    lines += ["", "Pre-trained NTP vs DiagD values behind the fractions: " + "; ".join(
        f"{m} {fmt(a, 3)} vs {fmt(b, 3)}" for m, (a, b) in gap_row.items() if a is not None), "",
        f"<!-- table3:{t.name} end -->"]
    section = "\n".join(lines) + "\n"
    (out / "table3.md").write_text(section)
    update_section(results_md, t.name, section)
    print(section, flush=True)
    return results_md


def update_section(path: Path, name: str, section: str) -> None:
    """Replace this experiment's marked section of RESULTS.md (or append it); the rest is left as written."""
    start, end = f"<!-- table3:{name} start", f"<!-- table3:{name} end -->"
    text = path.read_text() if path.exists() else "# Results\n\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return
    dry = "--dry-run" in args
    run_pipeline([a for a in args if a != "--dry-run"], dry_run=dry)
