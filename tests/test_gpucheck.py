"""The memory planner against measured peaks, and the GPU check command at tiny sizes on CPU."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from mcar.core.model import ModelConfig, Transformer
from mcar.train.memory import count_params, fit_activations, measure_step_peak, plan

from .conftest import REPO, compose, script_env

TINY = ["model=tiny", "data.h=3", "data.w=4", "data.n_a=2", "data.clip_frames=3", "data.codebook_size=32",
        "data.action_vocab_size=8"]


def test_count_params_is_the_models():
    for cfg in (ModelConfig(vocab_size=50, dim=48, n_layers=3, n_heads=6, n_kv_heads=2, mlp_dim=80),
                ModelConfig(vocab_size=8263, dim=64, n_layers=1, n_heads=4, mlp_dim=256)):
        assert count_params(cfg) == Transformer(cfg).num_params()


def test_fake_tensors_measure_the_same_peak_as_real_ones():
    cfg = ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, mlp_dim=256)
    for ac in (False, True):
        assert measure_step_peak(cfg, 2, 128, None, ac, fake=True) == measure_step_peak(cfg, 2, 128, None, ac,
                                                                                        fake=False)


@pytest.mark.parametrize("autocast, ac, batch, residual", [(None, False, 3, None), (torch.bfloat16, False, 2, None),
                                                           (None, True, 3, None), (torch.bfloat16, True, 4, None),
                                                           (torch.bfloat16, True, 4, torch.bfloat16)])
def test_plan_from_one_and_two_layers_predicts_the_measured_peak_of_a_deeper_model(autocast, ac, batch, residual):
    """Planned from 1- and 2-layer measurements, checked against a real (not fake) step of a 6-layer model."""
    cfg = ModelConfig(vocab_size=1088, dim=64, n_layers=6, n_heads=4, mlp_dim=256)
    fit = fit_activations(cfg, 256, batch, autocast, ac, residual_dtype=residual)
    predicted = plan(cfg, batch, 256, fit, autocast_dtype=autocast)["peak_bytes"]
    measured = measure_step_peak(cfg, batch, 256, autocast, ac, fake=False, residual_dtype=residual)
    assert predicted == pytest.approx(measured, rel=0.01)
    if ac:  # with checkpointing each layer keeps only its input: the residual stream (fp32, or bf16 by choice)
        assert fit["per_token_per_layer"] == pytest.approx((2 if residual else 4) * cfg.dim, rel=0.01)


def test_fsdp_shards_the_state_and_adds_gathered_blocks():
    cfg = ModelConfig(vocab_size=100, dim=512, n_layers=4, n_heads=4, mlp_dim=2048)
    fit = {"c0": 0.0, "per_token": 0.0, "per_layer": 0.0, "per_token_per_layer": 0.0}
    one, four = plan(cfg, 1, 10, fit), plan(cfg, 1, 10, fit, fsdp_devices=4)
    assert four["weights_and_adamw_gib"] == pytest.approx(one["weights_and_adamw_gib"] / 4, abs=2e-3)
    assert four["fsdp_gathered_gib"] > 0 and four["peak_bytes"] < one["peak_bytes"]


# a sitecustomize on PYTHONPATH runs in every Python process the script starts: as on the GPU machine, which has
# torch and lightning (and the wheelhouse's hydra/omegaconf) but none of these
BLOCK_HEAVY_IMPORTS = """
import importlib.abc, sys
BLOCKED = {"wandb", "av", "diffusers", "crafter"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed on this GPU machine")
sys.meta_path.insert(0, Block())
"""


def gpu_check(out, *args):
    site = out.parent / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK_HEAVY_IMPORTS)
    env = script_env()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    env["PYTHON"] = sys.executable
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--tiny", "--out", str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


# one sampler length (--tiny runs two): each stage is a process start (~4-10 s on 2 cores), and a second length
# checks nothing the first does not
ONE_LENGTH = "bench.gpu.sampler_frames=[4]"
SPLIT = "sampler.kv_splits=2"  # split-KV on CPU too (auto is 1 there): play_more times the split counts unsplit
STAGES = ["train_causal", "train_diagd", "train_causal_noac", "flex", "sampler_ntp_4f", "sampler_diagd_4f", "play",
          "play_more", "memory"]  # --tiny drops the diagd_tma variant (flex's USE_TMA: nothing on CPU) and
# causal_noac_bf16res (a process start for what test_bf16_residual_stream_under_autocast checks; its overrides: the
# test below)


@pytest.mark.slow
def test_staged_gpu_check_runs_every_stage_on_cpu_resumes_and_reports_timeouts(tmp_path):
    """`bash scripts/gpu_check.sh --tiny`: every stage in its own process (wandb, av, diffusers, crafter
    unimportable), one JSON each, merged into bench_gpu.{json,md}; a timed-out stage is reported and listed as
    missing, and the next run redoes only that stage."""
    out = tmp_path / "gc"
    p = gpu_check(out, ONE_LENGTH, SPLIT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert all((out / f"{s}.json").exists() for s in STAGES)
    r = json.loads((out / "bench_gpu.json").read_text())
    assert r["missing"] == [] and list(r["stage_seconds"]) == STAGES
    for mask, rows in (("causal", 3 * 14), ("diagd", 3 * 14 + 2 * 2)):  # diagd: + (h-1) proxy rows per frame
        t = r["train"][mask]
        assert t["timed_steps"] == 2 and t["seq_len"] == rows and t["ms_per_step"] > 0 and t["tokens_per_s"] > 0
        assert t["precision"] == "bf16-mixed" and t["activation_checkpointing"] and t["batch_size"] == 8
        assert r["memory"][mask]["seq_len"] == rows and r["memory"][mask]["planned_peak_gib"] > 0
    assert r["flex_vs_dense"]["ok"] and r["flex_vs_dense"]["seq_len"] == 46
    for name, passes in (("ntp_4f", 3 * 12), ("diagd_4f", 3 * 8)):  # NTP: a pass per token; DiagD: (T-2)*d + s_spa
        assert r["sampler"][name]["passes"] == passes and r["sampler"][name]["fps"] > 0
    assert r["diagd_over_causal_step"] > 0
    noac = r["train"]["causal_noac"]  # a variant: train.py's overrides on the causal mask
    assert not noac["activation_checkpointing"] and noac["batch_size"] == 2 and noac["accumulate_grad_batches"] == 4
    play = r["play"]["sessions"]
    assert list(play) == ["1", "2", "3"]  # play's [1, 2] and play_more's [3], joined
    assert all(p["fps_total"] > 0 and p["p99_ms"] >= p["p95_ms"] >= p["p50_ms"] > 0 for p in play.values())
    assert all(0 <= p["deadline_attainment"] <= 1 for p in play.values())  # docs/speed.md, at bench.play's rate
    assert play["2"]["fps_total"] == pytest.approx(2 * play["2"]["fps_per_session"], rel=1e-3)
    assert all(p["kv_splits"] == 2 and p["ms_per_tick_unsplit"] > 0 for p in play.values())
    assert {t["target"] for t in r["targets"]} >= {"training MFU, diagd", "DiagD step / causal step",
                                                   "DiagD frames/s at 4 frames"}
    md = (out / "bench_gpu.md").read_text()
    assert "| causal | bf16-mixed |" in md and "| diagd | bf16-mixed |" in md and "| diagd k=2 | 4 | 24 |" in md
    assert "| play: sessions (context 3, k=2, d=8) |" in md
    assert md in p.stdout

    flex = json.loads((out / "flex.json").read_text())
    assert flex["fingerprint"]["tiny"] and flex["fingerprint"]["model"] == "tiny"
    assert flex["fingerprint"]["device"] == "cpu" and "model=tiny" in flex["fingerprint"]["overrides"]
    assert json.loads((out / "sampler_ntp_4f.json").read_text())["result"]["bare_forward"] == "timed"  # eager
    flex["fingerprint"] |= {"model": "700m", "tiny": False}  # as if another run had measured flex here
    (out / "flex.json").write_text(json.dumps(flex))
    p = gpu_check(out, "--timeout", "1", ONE_LENGTH, SPLIT)  # no Python starts in 1 s: flex times out, no other reruns
    assert p.returncode == 1 and "== flex: measured by another run" in p.stdout, p.stdout
    assert "== flex (at most 1s" in p.stdout and "timed out after 1s" in p.stdout
    assert p.stdout.count("done before, skipped") == len(STAGES) - 1
    assert (out / "flex.json.stale").exists() and not (out / "flex.json").exists()
    assert "Missing stages (failed, timed out or not run): flex" in (out / "bench_gpu.md").read_text()
    p = gpu_check(out, ONE_LENGTH, SPLIT)
    assert p.returncode == 0 and "every stage done" in p.stdout
    assert json.loads((out / "bench_gpu.json").read_text())["flex_vs_dense"]["ok"]


@pytest.mark.slow
def test_bench_memory_plans_the_configured_training_step(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mcar.cli", "bench", "memory", *TINY,
                        "model.activation_checkpointing=true",
                        "bench.memory.budget_gib=0.02", f"hydra.run.dir={tmp_path}"],
                       cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["activation_checkpointing"] and r["seq_len"] == 3 * 14 and r["batch_size"] == 2
    assert r["direct_fake_peak_gib"] == pytest.approx(r["peak_gib"], rel=0.02)
    assert 1 <= r["max_batch_without_checkpointing"] <= r["max_batch_with_checkpointing"]
    fit = fit_activations(ModelConfig(vocab_size=40, dim=128, n_layers=4, n_heads=4, mlp_dim=512), 42, 2, None, True)
    assert r["activation_bytes_per_token_per_layer"] == round(fit["per_token_per_layer"])


@pytest.mark.slow
def test_gpu_check_runs_every_stage_in_one_process_by_default(tmp_path):
    """`mcar bench gpu ...` without bench.gpu.stage (stage=all): every stage in this process, then the
    merge; its printed JSON is bench_gpu.json."""
    p = subprocess.run([sys.executable, "-m", "mcar.cli", "bench", "gpu", "experiment=paper", *TINY, "data=synthetic",
                        "logger=csv", "trainer.accelerator=cpu", "bench.gpu.steps=2", "bench.gpu.warmup_steps=1",
                        "bench.repeats=1", "bench.warmup=0", "bench.gpu.sampler_frames=[3]", "~bench.gpu.variants",
                        "bench.memory.direct=false", f"hydra.run.dir={tmp_path}"],
                       cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r == json.loads((tmp_path / "bench_gpu.json").read_text())
    assert r["missing"] == [] and set(r["train"]) == {"causal", "diagd"} and set(r["sampler"]) == {"ntp_3f", "diagd_3f"}
    assert (tmp_path / "bench_gpu.md").exists()


# ---- the stage fingerprint, resuming and the time budget --------------------------------------------------------
def stage_json(out, stage, fp, result=None):
    (out / f"{stage}.json").write_text(json.dumps({"stage": stage, "device": fp["device"], "date": "2026-11-25",
                                                   "model": fp["model"], "torch": fp["torch"], "fingerprint": fp,
                                                   "seconds": 1.0, "result": result}))


FLEX = {"dtype": "float32", "seq_len": 46, "max_rel_err": 1e-7, "argmax_agreement": 1.0, "tolerance": 1e-4, "ok": True,
        "compiled_graphs": 0}


def test_a_stage_is_done_only_for_the_run_that_measured_it_and_merge_refuses_mixed_runs(tmp_path):
    """A tiny CPU run's stage JSON never stands in for the 700m run's: the fingerprint (model, overrides, tiny,
    torch, device) tells them apart, and merge refuses a folder holding both, naming the stage files."""
    from mcar.bench.gpu_check import fingerprint, merge, stage_states

    cfg = compose("bench", TINY)
    tiny = fingerprint(cfg, ["bench.gpu.stage=flex", f"bench.gpu.dir={tmp_path}", "model=tiny",
                             "bench.gpu.targets.mfu=0.5"])
    assert tiny == {"model": "tiny", "tiny": True, "overrides": ["model=tiny"], "torch": torch.__version__,
                    "device": "cpu"}  # where it writes and the targets measure nothing
    real = fingerprint(compose("bench", ["model=700m"]), ["model=700m"])
    assert real["model"] == "700m" and not real["tiny"]

    stage_json(tmp_path, "flex", tiny, FLEX)
    stage_json(tmp_path, "memory", real, {})
    (tmp_path / "train_causal.json").write_text(json.dumps({"stage": "train_causal", "result": {}}))  # no fingerprint
    assert stage_states(tmp_path, ["flex", "memory", "train_causal", "train_diagd"], real) == {
        "flex": "stale", "memory": "done", "train_causal": "stale", "train_diagd": "missing"}

    (tmp_path / "train_causal.json").unlink()
    with pytest.raises(ValueError, match="different runs") as e:
        merge(cfg, tmp_path)
    assert "flex.json" in str(e.value) and "memory.json" in str(e.value) and str(tmp_path) in str(e.value)
    assert not (tmp_path / "bench_gpu.json").exists()
    stage_json(tmp_path, "memory", tiny, {})
    r = merge(cfg, tmp_path)
    assert r["fingerprint"] == tiny and r["flex_vs_dense"]["ok"] and "train_causal" in r["missing"]


def play_row(n, splits, ms):
    return {"sessions": n, "ms_per_tick": ms, "fps_per_session": 1, "fps_total": n, "p50_ms": ms, "p95_ms": ms,
            "floor_fps_total": None, "of_floor": None, "kv_splits": splits, "ms_per_tick_unsplit": None}


def test_merge_joins_the_play_stages_and_reads_mfu_off_the_fastest_causal_configuration(tmp_path):
    """play (the goals' session counts) and play_more (the rest, and the split counts timed unsplit) make one play
    table, each split count with its unsplit time beside it; the training-speed goal reads the best MFU of the
    causal stages, variants included."""
    from mcar.bench.gpu_check import merge

    cfg = compose("bench", TINY)
    fp = {"model": "tiny", "tiny": True, "overrides": [], "torch": torch.__version__, "device": "cpu"}
    base = {"context": 16, "k": 2, "d": 25, "in_flight": 1, "compile": True, "passes_per_tick": 25}
    stage_json(tmp_path, "play", fp, base | {"sessions": {"1": play_row(1, 4, 20.0), "16": play_row(16, 1, 60.0)},
                                             "unsplit_ms_per_tick": {}})
    stage_json(tmp_path, "play_more", fp, base | {"sessions": {"4": play_row(4, 1, 30.0)},
                                                  "unsplit_ms_per_tick": {"1": 26.5}})
    train = {"precision": "bf16-mixed", "compile": True, "activation_checkpointing": True, "batch_size": 8,
             "seq_len": 42, "ms_per_step": 1.0, "tokens_per_s": 1.0, "tflops_per_s": 1.0, "host_syncs_per_step": 0,
             "peak_allocated_gib": 1, "peak_reserved_gib": 1}
    for stage, mask, mfu in (("train_causal", "causal", 0.41), ("train_causal_noac", "causal", 0.46),
                             ("train_diagd", "diagd", 0.5)):
        stage_json(tmp_path, stage, fp, train | {"mask": mask, "mfu": mfu})
    r = merge(cfg, tmp_path)
    rows = r["play"]["sessions"]
    assert list(rows) == ["1", "4", "16"] and rows["1"]["ms_per_tick_unsplit"] == 26.5
    assert rows["4"]["ms_per_tick_unsplit"] is None and rows["16"]["ms_per_tick_unsplit"] is None
    assert "| 1 | 20.0 |" in (tmp_path / "bench_gpu.md").read_text() and "| 4 (26.5) |" in \
        (tmp_path / "bench_gpu.md").read_text()
    fastest = [t for t in r["targets"] if t["target"].startswith("causal training MFU, the fastest")]
    assert fastest == [{"target": "causal training MFU, the fastest configuration (causal_noac)", "value": 0.46,
                        "goal": ">= 0.45", "met": True}]


FAKE_BENCH = """#!{python}
# `python -m mcar.cli bench gpu bench.gpu.stage=list|<stage>|merge` as scripts/gpu_check.sh calls them, without
# mcar or torch: the stages are FAKE_STAGES, each sleeps FAKE_SLEEP[stage] seconds; any other use of the
# interpreter is the real one
import json, os, sys, time
from pathlib import Path

args = sys.argv[1:]
if args[:4] != ["-m", "mcar.cli", "bench", "gpu"]:
    os.execv(sys.executable, [sys.executable, *args])
kv = dict(a.split("=", 1) for a in args if "=" in a)
out, stage = Path(kv["bench.gpu.dir"]), kv["bench.gpu.stage"]
names = json.loads(os.environ["FAKE_STAGES"])
if stage == "list":
    def state(s):
        p = out / f"{{s}}.json"
        return "missing" if not p.exists() else "done" if json.loads(p.read_text())["fingerprint"] == "fp" else "stale"
    print(json.dumps({{"stages": names, "state": {{s: state(s) for s in names}}}}))
elif stage == "merge":
    (out / "bench_gpu.md").write_text("merged: " + " ".join(s for s in names if (out / f"{{s}}.json").exists()) + "\\n")
else:
    time.sleep(json.loads(os.environ.get("FAKE_SLEEP", "{{}}")).get(stage, 0))
    (out / f"{{stage}}.json").write_text(json.dumps({{"fingerprint": "fp"}}))
    print(stage, "measured")
"""


def fake_gpu_check(root, *args, estimates, sleep=None, env=()):
    """scripts/gpu_check.sh in `root` with `estimates` as its scripts/gpu_estimates.yaml (merge's and each stage's)."""
    (root / "scripts" / "gpu_estimates.yaml").write_text(
        "".join(f"{name}: {seconds}\n" for name, seconds in estimates.items()) + "unlisted: 300\n")
    stages = [s for s in estimates if s != "merge"]
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=root, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHON=str(root / "python"),
                                                FAKE_STAGES=json.dumps(stages),
                                                FAKE_SLEEP=json.dumps(sleep or {}), **dict(env)))


def test_gpu_check_script_skips_what_does_not_fit_its_budget_and_never_resumes_another_runs_stage(tmp_path):
    """scripts/gpu_check.sh's own logic (a fake `mcar bench gpu`, no torch, seconds): --tiny writes its own folder;
    with --budget a stage whose estimate does not fit the time left (less merge's) is skipped for budget, later
    ones that fit still run; a stage of another run is moved aside and run again, not merged; a started stage's
    timeout is cut to the time left; --stages picks."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "gpu_check.sh", tmp_path / "scripts")
    (tmp_path / "python").write_text(FAKE_BENCH.format(python=sys.executable))
    (tmp_path / "python").chmod(0o755)
    est = {"train_causal": 1, "sampler_ntp_16f": 1000, "flex": 1, "memory": 1, "sampler_diagd_16f": 2000, "merge": 5}

    tiny = tmp_path / "outputs" / "gpu_check_tiny"
    tiny.mkdir(parents=True)
    (tiny / "memory.json").write_text(json.dumps({"fingerprint": "fp"}))  # done by this run before
    (tiny / "sampler_diagd_16f.json").write_text(json.dumps({"fingerprint": "another run"}))
    p = fake_gpu_check(tmp_path, "--tiny", estimates=est, env={"GPU_CHECK_BUDGET": "60"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert not (tmp_path / "outputs" / "gpu_check").exists()  # the real run's folder is untouched
    assert "== sampler_ntp_16f: skipped for budget (estimate 1000s" in p.stdout
    assert "== sampler_diagd_16f: measured by another run" in p.stdout
    assert "== sampler_diagd_16f: skipped for budget (estimate 2000s" in p.stdout
    assert "== memory: done before, skipped" in p.stdout
    for stage in ("train_causal", "flex"):
        assert f"== {stage} (at most " in p.stdout and (tiny / f"{stage}.json").exists()
    assert (tiny / "sampler_diagd_16f.json.stale").exists() and not (tiny / "sampler_diagd_16f.json").exists()
    assert (tiny / "bench_gpu.md").read_text() == "merged: train_causal flex memory\n"
    assert "not run yet: sampler_ntp_16f sampler_diagd_16f (skipped for budget: sampler_ntp_16f sampler_diagd_16f)" \
        in p.stdout and "every stage done" not in p.stdout

    p = fake_gpu_check(tmp_path, "--tiny", "--budget", "10m", estimates=est)
    assert p.returncode == 2 and "--budget (or GPU_CHECK_BUDGET) takes whole seconds" in p.stdout
    p = fake_gpu_check(tmp_path, "--tiny", "--budget", "8", "--stages", "sampler_ntp_16f",
                       estimates=est | {"sampler_ntp_16f": 1}, sleep={"sampler_ntp_16f": 60})
    assert p.returncode == 1 and "timed out after" in p.stdout, p.stdout + p.stderr
    limit = int(p.stdout.split("== sampler_ntp_16f (at most ")[1].split("s")[0])
    assert 1 <= limit <= 3 and "train_causal" not in p.stdout.split("== sampler_ntp_16f")[0]
    p = fake_gpu_check(tmp_path, "--tiny", "--stages", "sampler_ntp_16f sampler_diagd_16f", estimates=est)
    assert p.returncode == 0 and "every stage done" in p.stdout, p.stdout + p.stderr
    p = fake_gpu_check(tmp_path, "--tiny", "--stages", "nope", estimates=est)
    assert p.returncode == 2 and "--stages: no stage 'nope'" in p.stdout


def test_the_shipped_estimates_name_every_700m_stage_and_bench_gpu_lists_their_states(tmp_path, capsys):
    """scripts/gpu_estimates.yaml has an estimate for every stage of the 700m check (none falls back to
    `unlisted`), each at most a stage's default timeout (480 s); `bench.gpu.stage=list` gives every stage's state
    for this run's fingerprint and runs nothing."""
    from omegaconf import OmegaConf

    from mcar.bench.gpu_check import stages
    from mcar.tools.bench import main as bench
    from tests.conftest import run_in_process

    overrides = ["experiment=paper", "model=700m"]
    e = OmegaConf.load(REPO / "scripts" / "gpu_estimates.yaml")
    names = stages(compose("bench", overrides))
    assert not [s for s in names if s not in e] and all(0 < e[s] <= 480 for s in names) and e.merge > 0
    run_in_process(bench, "gpu", "bench.gpu.stage=list", *overrides, f"bench.gpu.dir={tmp_path}",
                   f"hydra.run.dir={tmp_path}")
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["stages"] == names and set(r["state"].values()) == {"missing"} and r["fingerprint"]["model"] == "700m"
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["bench_gpu.json"]  # bench.out: the listing alone


# on the GPU machine hydra, omegaconf and antlr4 exist only as the wheelhouse's wheels installed into .site
ONLY_FROM_THE_WHEELHOUSE = BLOCK_HEAVY_IMPORTS + """
import importlib.machinery, os
WHEELED = {"hydra", "omegaconf", "antlr4"}
class FromSiteOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in WHEELED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [os.environ["MCAR_TEST_SITE"]])
        if spec is None:
            raise ImportError(f"{name} is not in the wheelhouse's .site")
        with open(os.environ["MCAR_TEST_IMPORTS"], "a") as f:
            f.write(f"{name} {spec.origin}\\n")
        return spec
sys.meta_path.insert(0, FromSiteOnly())
"""


@pytest.mark.slow
def test_gpu_check_runs_with_only_the_wheelhouse_beside_torch_and_lightning(tmp_path):
    """The GPU machine has torch and lightning but no hydra, omegaconf, antlr4, wandb, diffusers, av or crafter:
    `bash scripts/wheelhouse.sh DIR` builds the wheels (from the package index) and `gpu_check.sh --wheels DIR`
    installs them into .site and runs a stage with nothing else."""
    site = REPO / ".site"
    if site.exists():
        pytest.skip(f"{site} exists (a developer's wheel install): not overwritten by a test")
    wheels = tmp_path / "whl"
    env = script_env() | {"PYTHON_VERSION": f"{sys.version_info.major}.{sys.version_info.minor}"}
    p = subprocess.run(["bash", "scripts/wheelhouse.sh", str(wheels)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert {w.name.split("-")[0] for w in wheels.glob("*.whl")} >= {"hydra_core", "omegaconf",
                                                                    "antlr4_python3_runtime"}
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(ONLY_FROM_THE_WHEELHOUSE)
    imports = tmp_path / "imports.txt"
    env = script_env() | {"MCAR_TEST_SITE": str(site), "MCAR_TEST_IMPORTS": str(imports), "PYTHON": sys.executable}
    env["PYTHONPATH"] = f"{hooks}:{env['PYTHONPATH']}"
    out = tmp_path / "gc"
    try:
        p = subprocess.run(["bash", "scripts/gpu_check.sh", "--tiny", "--out", str(out), "--wheels", str(wheels),
                            "--stages", "flex"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(site, ignore_errors=True)
    assert json.loads((out / "flex.json").read_text())["result"]["ok"], p.stdout[-3000:] + p.stderr[-3000:]
    loaded = imports.read_text().split()
    assert {"hydra", "omegaconf", "antlr4"} <= set(loaded[::2]) and all(o.startswith(str(site)) for o in loaded[1::2])


# ---- what a sampler stage compiles ------------------------------------------------------------------------------
def test_a_compiled_sampler_stage_compiles_the_generation_step_alone(monkeypatch):
    """A sampler stage with the sampler compiled (CUDA's path; forced on CPU here, dynamo with a counting backend,
    no inductor) compiles only generate's step: the bare forwards (another function, so other whole-model graphs,
    ~1 min each for 700m on an H100 host) are skipped and the JSON says so; bench.bare_forward=true adds them."""
    from mcar.bench.gpu_check import sampler_check
    from mcar.core import compiling
    from mcar.core import sampler as sampler_module

    graphs, real_compiled = [], compiling.compiled

    def counting_compiled(fn, device):  # the sampler's own compiled(), its options' backend counting each graph
        def backend(gm, example_inputs):
            graphs.append(fn.__name__)
            return gm.forward

        monkeypatch.setattr(compiling, "CPU_COMPILE_OPTIONS", dict(dynamic=True, backend=backend))
        return real_compiled(fn, device)

    monkeypatch.setattr(sampler_module, "compiled", counting_compiled)
    # one layer: dynamo's trace time grows with the layers; one thread: two fight over a loaded 2-core machine
    base = [*TINY, "model.arch.n_layers=1", "sampler.compile=true", "bench.device=cpu", "bench.repeats=1",
            "bench.warmup=1", "bench.threads=1"]
    threads = torch.get_num_threads()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # compiled_graphs counts this process's graphs, as a stage's process has
    try:
        r = sampler_check(compose("bench", base), "diagd", 3)
        assert r["compile"] and r["bare_forward"].startswith("skipped: the sampler's step is compiled")
        assert r["bare_forward_ms_per_pass"] is None and r["overhead"] is None
        assert set(graphs) == {"_sample_pass"} and 1 <= len(graphs) <= 2  # a general graph (+ its size-1 one)
        assert r["compiled_graphs"] == len(graphs)
        step_graphs = len(graphs)

        graphs.clear()
        torch._dynamo.reset()
        r = sampler_check(compose("bench", [*base, "bench.bare_forward=true"]), "diagd", 3)
        assert r["bare_forward"] == "timed" and r["bare_forward_ms_per_pass"] > 0
        assert graphs.count("_sample_pass") == step_graphs and "forward_rows" in graphs  # what auto saves
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()


def test_every_training_variant_composes_with_train_py():
    """The variants the GPU check times (bench.gpu.variants) are train.py overrides that compose and mean what they say;
    --tiny skips some, so a typo there would otherwise surface only on the GPU."""
    from .conftest import compose

    variants = compose("bench", []).bench.gpu.variants
    assert {"causal_noac", "diagd_tma", "causal_noac_bf16res"} <= set(variants)
    for name, v in variants.items():
        cfg = compose("train", [f"mask={v.mask}", *v.overrides])
        assert cfg.mask.name == v.mask, name
    bf16 = compose("train", list(variants.causal_noac_bf16res.overrides))
    assert bf16.residual_dtype == "bfloat16" and bf16.module.residual_dtype == "bfloat16"
    assert not bf16.model.activation_checkpointing and bf16.trainer.accumulate_grad_batches == 4
