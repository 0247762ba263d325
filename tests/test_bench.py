"""`mcar bench` prints one JSON line with consistent fields (values only, no timing assertions)."""
import json
import statistics

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.bench import speed
from mcar.bench.speed import fit_pass_costs
from mcar.core.layout import Layout
from mcar.core.model import ModelConfig, Transformer
from mcar.core.sampler import ScheduleSampler
from mcar.train.module import build_optimizer
from mcar.train.task import build_module
from tests.conftest import REPO, compose, run_in_process, run_script

ADAMW = yaml.safe_load((REPO / "mcar" / "conf" / "optim" / "adamw.yaml").read_text())  # the configured AdamW

TINY = ["model=tiny", "data.h=3", "data.w=4", "data.n_a=2", "data.clip_frames=3", "data.codebook_size=32",
        "data.action_vocab_size=8", "bench.repeats=1", "bench.warmup=0"]
SAMPLER_FIELDS = {"model", "params", "device", "dtype", "sampler", "k", "d", "batch_size", "frames_generated",
                  "passes", "tokens_generated", "seconds", "fps", "tokens_per_s", "ms_per_pass",
                  "bare_forward_ms_per_pass", "fps_per_stream", "fps_total", "bytes_per_pass", "bandwidth",
                  "floor_ms_per_pass", "bandwidth_fraction", "rows_per_pass", "padded_rows_per_pass",
                  "visible_cols_per_pass",
                  "cache_cols_per_pass", "buckets", "pass_costs"}
PASS_COST_FIELDS = {"prefill_ms", "prefill_rows", "fixed_ms", "ms_per_row", "us_per_col", "r2", "ms_by_rows",
                    "mean_ms"}


def last_json(tmp_path, capsys, *overrides) -> tuple[dict, dict]:
    """`mcar bench` in this process (test_bench_train runs the command): its printed and its saved JSON."""
    from mcar.cli import main as mcar

    capsys.readouterr()
    run_in_process(mcar, "bench", *overrides, *TINY, f"hydra.run.dir={tmp_path}")
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return printed, json.loads(next(tmp_path.glob("bench_*.json")).read_text())


def test_bench_sampler_compare(tmp_path, capsys):
    out, saved = last_json(tmp_path, capsys, "sampler", "sampler=diagd", "schedule.k=2", "bench.compare=true",
                           "bench.batch_size=2", "bench.pass_costs=true")
    assert out == saved and SAMPLER_FIELDS <= out.keys() and SAMPLER_FIELDS <= out["ntp"].keys()
    h, w, T, P, k = 3, 4, 3, 1, 2
    s_spa = (h - 1) * k + w
    assert out["passes"] == (T - P - 1) * s_spa + s_spa and out["ntp"]["passes"] == (T - P) * h * w
    assert out["tokens_generated"] == out["ntp"]["tokens_generated"] == (T - P) * h * w * 2
    assert out["speedup"] == pytest.approx(out["ntp_seconds"] / out["diagd_seconds"], rel=2e-3, abs=1e-3)
    assert out["pass_ratio"] == round(out["ntp"]["passes"] / out["passes"], 3)
    assert out["ms_per_pass"] == pytest.approx(1000 * out["seconds"] / out["passes"], rel=2e-3, abs=1e-3)
    assert out["frames_generated"] == T - P and out["batch_size"] == 2 and out["sampler"] == "diagd"
    assert out["bare_speedup_over_pass_ratio"] == pytest.approx(
        out["ntp"]["bare_forward_ms_per_pass"] / out["bare_forward_ms_per_pass"], rel=2e-3, abs=1e-3)
    # per-pass costs: the prefill feeds the prompt frame (h*w + n_a slots); DiagD k=2 passes are 1 to 3 rows wide
    # (k + n_a on a frame's last pass), NTP's 1 (a token) or 1 + n_a (a frame's last token and its actions)
    for r, widths in ((out, {"1", "2", "3", "4"}), (out["ntp"], {"1", "3"})):
        costs = r["pass_costs"]
        assert costs.keys() == PASS_COST_FIELDS and costs["prefill_rows"] == 3 * 4 + 2
        assert set(costs["ms_by_rows"]) <= widths and "1" in costs["ms_by_rows"]
        assert costs["prefill_ms"] > 0 and costs["mean_ms"] > 0 and costs["us_per_col"] is not None
    for r in (out, out["ntp"]):  # fps keeps its meaning: frames over the whole batch per second
        assert r["fps"] == r["fps_total"] == pytest.approx(2 * r["fps_per_stream"], rel=2e-3, abs=2e-3)
        assert r["bandwidth"] is None and r["bandwidth_fraction"] is None  # no peak bandwidth known for a CPU
        assert not r["static"] and not r["compile"] and r["buckets"] is None  # compile: auto is eager on CPU
        assert r["padded_rows_per_pass"] == r["rows_per_pass"]
        assert r["cache_cols_per_pass"] == r["visible_cols_per_pass"]


def test_bench_sampler_static_reports_buckets_and_bytes(tmp_path, capsys):
    out, _ = last_json(tmp_path, capsys, "sampler", "sampler=diagd", "schedule.k=2", "sampler.static=true",
                       "bench.batch_size=2", "bench.bandwidth=1e10")
    assert out["static"] and not out["compile"] and out["buckets"] >= 2
    assert out["padded_rows_per_pass"] >= out["rows_per_pass"]
    assert out["cache_cols_per_pass"] >= out["visible_cols_per_pass"]
    # model=tiny: 4 layers, 4 KV heads of 32, float32, batch 2: 8,192 bytes of K and V per visible slot
    model = Transformer(ModelConfig(vocab_size=32 + 8, dim=128, n_layers=4, n_heads=4, mlp_dim=512))
    assert out["params"] == model.num_params()
    weights = 4 * (model.num_params() - model.tok_embeddings.weight.numel())
    kv = 4 * 2 * 4 * 32 * 4 * 2
    assert out["bytes_per_pass"] == pytest.approx(weights + kv * out["visible_cols_per_pass"], rel=1e-3)
    assert out["bandwidth"] == 1e10 and out["pass_costs"] is None  # bench.pass_costs is off by default
    achieved = out["bytes_per_pass"] / (out["ms_per_pass"] / 1000)
    assert out["bandwidth_fraction"] == pytest.approx(achieved / 1e10, rel=2e-2)
    assert out["floor_ms_per_pass"] == pytest.approx(1000 * out["bytes_per_pass"] / 1e10, rel=1e-3)


def test_bench_train(tmp_path):
    """The command as a user runs it: the last line it prints is the JSON it saves."""
    p = run_script("-m mcar.cli bench", "train", "mask=diagd", *TINY, f"hydra.run.dir={tmp_path}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == json.loads(next(tmp_path.glob("bench_*.json")).read_text())
    assert out["mask"] == "diagd" and out["seq_len"] == 3 * 14 + 2 * 2  # + (h-1) proxy rows per generated frame
    assert out["ms_per_step"] > 0 and out["tokens_per_s"] > 0 and out["peak_memory_mb"] > 0
    assert out["mfu"] is None  # no peak FLOP/s known for a CPU
    assert out["data_ms_per_step"] > 0 and out["data_workers"] >= 0 and out["data_clips"] == 256  # synthetic.yaml


def test_bench_train_steps_the_training_optimizer(monkeypatch):
    """`mcar bench train` steps the optimiser training builds (conf/optim's values, weight decay on 2-D
    weights only, the same fused rule), not one of its own."""
    made = []
    init = torch.optim.AdamW.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(torch.optim.AdamW, "__init__", record)
    monkeypatch.setattr(speed, "bench_data", lambda cfg: {})  # the data loader is not under test
    speed.run_train(compose("bench", [*TINY, "bench.mode=train"]))
    module = build_module(compose("train", [o for o in TINY if not o.startswith("bench.")]))
    bench, train = made[0], module.build_optimizer()

    def groups(opt):
        return [({k: v for k, v in g.items() if k != "params"}, [p.shape for p in g["params"]])
                for g in opt.param_groups]

    assert groups(bench) == groups(train)
    assert [g["weight_decay"] for g in bench.param_groups] == [ADAMW["weight_decay"], 0.0]
    assert [g["betas"] for g in bench.param_groups] == [tuple(ADAMW["betas"])] * 2


@pytest.mark.parametrize("key", ["lr", "betas", "eps", "weight_decay"])
def test_an_optimizer_setting_missing_from_the_config_is_an_error_naming_it(key):
    """No optimiser hyperparameter falls back to a default in code (torch's AdamW betas are (0.9, 0.999), not
    conf/optim/adamw.yaml's): a key the optimiser takes but the config leaves out names itself."""
    model = Transformer(ModelConfig(vocab_size=40, dim=32, n_layers=1, n_heads=4, mlp_dim=64))
    optim = {k: v for k, v in ADAMW.items() if k != key}
    with pytest.raises(ValueError, match=rf"optim\.{key} is missing \(conf/optim/\): AdamW takes it"):
        build_optimizer(model, optim)


def test_static_padded_sampler_generates_the_same_tokens():
    """The GPU path's padded passes (one shape for all) change nothing: same greedy tokens, same pass count."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64,
                                    init_std=0.2)).eval()
    for layout, k, d in [(Layout(3, 4, 2), 2, 3), (Layout(3, 4, 0), 1, None), (Layout(3, 4, 2), 6, None)]:
        clip = torch.randint(0, 32, (2, layout.n_slots(4)))
        eager, static = (ScheduleSampler(layout, 4, 1, k=k, d=d, temperature=0, static=s) for s in (False, True))
        (a, sa), (b, sb) = eager.generate(model, clip), static.generate(model, clip)
        assert torch.equal(a, b) and sa.passes == sb.passes
        assert torch.equal(static.generate(model, clip, setup_cache=False)[0], a)  # reused cache, zeroed


@settings(max_examples=50, deadline=None)
@given(fixed=st.floats(0.1, 50), per_row=st.floats(0, 5), per_col=st.floats(0, 0.05),
       passes=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 6000)), min_size=4, max_size=60),
       prefill=st.floats(1, 1e4))
def test_fit_pass_costs_recovers_a_linear_cost(fixed, per_row, per_col, passes, prefill):
    """Pass times that are exactly linear in rows and cache columns give back the coefficients; the first pass
    (the prefill) is left out of the fit; a term whose input never varies is not fitted (None)."""
    rows, cols = [500] + [p[0] for p in passes], [0] + [p[1] for p in passes]
    ms = [prefill] + [fixed + per_row * r + per_col * c for r, c in passes]
    out = fit_pass_costs(ms, rows, cols)
    assert out["prefill_ms"] == round(prefill, 3) and out["prefill_rows"] == 500
    assert out["mean_ms"] == pytest.approx(sum(ms) / len(ms), abs=1e-3)
    assert set(out["ms_by_rows"]) == {str(r) for r, _ in passes}
    vary_rows, vary_cols = len({r for r, _ in passes}) > 1, len({c for _, c in passes}) > 1
    assert (out["ms_per_row"] is None) == (not vary_rows) and (out["us_per_col"] is None) == (not vary_cols)
    collinear = vary_rows and vary_cols and torch.linalg.matrix_rank(
        torch.tensor([[1.0, r, c] for r, c in passes], dtype=torch.float64)) < 3
    if not collinear:  # a unique least-squares solution: the exact one
        predicted = [out["fixed_ms"] + (out["ms_per_row"] or 0) * r + (out["us_per_col"] or 0) / 1000 * c
                     for r, c in passes]
        assert predicted == pytest.approx(ms[1:], abs=5e-3 + 1e-6 * max(cols))
        if vary_rows:
            assert out["ms_per_row"] == pytest.approx(per_row, abs=1e-3)
    for r, _ in passes:
        assert out["ms_by_rows"][str(r)] == pytest.approx(
            statistics.median(m for (w, _), m in zip(passes, ms[1:]) if w == r), abs=1e-3)


def test_bench_defaults_are_cpu_sized_and_each_run_shows_progress(capsys):
    """The README's `mcar bench sampler ... bench.compare=true` ran 16-frame NTP on CPU for minutes, silently: the
    default clip is CPU-sized, the paper's length comes with experiment=paper, and every timed run prints a line."""
    assert compose("bench").data.clip_frames == 4
    assert compose("bench", ["experiment=paper"]).data.clip_frames == 16
    seconds, result = speed.timed(lambda: 7, torch.device("cpu"), warmup=1, repeats=2, label="sampler diagd")
    assert result == 7 and seconds >= 0
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" took ")[0] for line in lines] == [
        "bench sampler diagd: warm-up 1/1", "bench sampler diagd: run 1/2", "bench sampler diagd: run 2/2"]
