"""Crafter table 3 (mcar/tools/table3.py): the gap formula, the table (its run folder's table3.md), config checks,
and the whole pipeline (pre-train, IDM, evaluations, three fine-tunings, table) on a tiny synthetic setting,
re-run = no-op."""
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcar.tools.table3 import compose_experiment, gap_closed

from .conftest import SMALL_DATA, run_script

finite = st.floats(-100, 100, allow_nan=False)


@given(finite, finite, st.floats(0, 1))
def test_gap_closed_is_the_fraction_of_the_way_from_diagd_to_ntp(ntp, diagd, frac):
    tuned = diagd + frac * (ntp - diagd)
    g = gap_closed({"psnr": ntp}, {"psnr": diagd}, {"psnr": tuned})
    if ntp == diagd:
        assert g["psnr"] is None  # no gap: no fraction
    elif abs(ntp - diagd) > 1e-6:
        assert g["psnr"] == pytest.approx(frac, abs=1e-6)
    assert g["fvd"] is None  # a metric a row lacks


def test_gap_closed_signs():
    pre_ntp, pre_diagd = {"fvd": 210.0, "psnr": 20.0}, {"fvd": 247.0, "psnr": 18.0}
    g = gap_closed(pre_ntp, pre_diagd, {"fvd": 231.0, "psnr": 17.0})
    assert g["fvd"] == pytest.approx(16 / 37)  # the paper's table 3: 43% of the FVD gap
    assert g["psnr"] == pytest.approx(-0.5)  # worse than untuned DiagD


def fake_eval(level: float, clips: int, seed: int, spread: float = 0.01) -> dict:
    """One evaluation's row as read_row gives it: token_acc near `level` on each clip, LOSS_TF its mirror."""
    import torch

    g = torch.Generator().manual_seed(seed)
    acc = (level + spread * torch.randn(clips, generator=g)).tolist()
    return {"model": "m", "sampler": "s", "token_acc": sum(acc) / clips, "fps": 10.0 + seed, "fvd": None,
            "per_clip": {"token_acc": acc, "loss_tf": [1 - a for a in acc]}}


def test_shares_of_the_gap_come_with_intervals_over_seeds_and_clips_and_a_plain_verdict():
    """NTP 0.9, untuned DiagD 0.7 on 40 clips; a fine-tuning reaching 0.8 on 3 seeds closes half the gap (the
    interval holds 0.5 and neither 0 nor 1), the control reaching 0.72 a tenth; the difference is positive and the
    verdict says the DiagD mask beats the control; a fine-tuning no better than the control is called
    indistinguishable."""
    from omegaconf import OmegaConf

    from mcar.eval import stats as S
    from mcar.tools.table3 import gap_table, pooled_row

    (one, three), clips = S.resample_seeds_and_clips([1, 3], 40, seed=0, resamples=400)
    rows = {("pretrained", "ntp"): pooled_row([fake_eval(0.9, 40, 0)], (one, clips)) | {"draws": (one, clips)},
            ("pretrained", "diagd_k2"): pooled_row([fake_eval(0.7, 40, 1)], (one, clips)) | {"draws": (one, clips)}}
    for label, level in (("proxy", 0.8), ("causal", 0.72), ("same", 0.72)):
        rows[(f"ft_{label}", "diagd_k2")] = pooled_row([fake_eval(level, 40, 10 + s) for s in range(3)],
                                                       (three, clips)) | {"draws": (three, clips)}
    tuned = rows[("ft_proxy", "diagd_k2")]
    assert tuned["seeds"] == 3 and tuned["fps"] == 21.0 and tuned["fvd"] is None  # other numbers: seed means
    assert tuned["token_acc_lo"] < 0.8 < tuned["token_acc_hi"] and tuned["loss_tf"] == pytest.approx(0.2, abs=0.01)
    t = OmegaConf.create({"gap": {"ntp": "ntp", "diagd": "diagd_k2", "control": "causal", "primary": "token_acc"},
                          "finetune": {"runs": {k: {"samplers": ["diagd_k2"]} for k in ("proxy", "causal", "same")}}})
    gap, shares, versus, lines = gap_table(t, rows)
    assert gap["token_acc"]["difference"] == pytest.approx(0.2, abs=0.01) and gap["token_acc"]["interval"][0] > 0
    assert gap["loss_tf"]["difference"] == pytest.approx(0.2, abs=0.01)  # lower is better: signed so NTP leads
    share = shares["proxy"]["token_acc"]
    assert share["share"] == pytest.approx(0.5, abs=0.05) and 0 < share["interval"][0] < 0.5 < share["interval"][1] < 1
    assert shares["proxy"]["loss_tf"]["share"] == pytest.approx(share["share"])  # the same gap, read as a loss
    assert shares["causal"]["token_acc"]["share"] == pytest.approx(0.1, abs=0.05)
    assert versus["proxy"]["token_acc"]["interval"][0] > 0 and "causal" not in versus
    assert shares["proxy"]["fvd"] == {"share": None, "interval": None}  # no value: no share
    assert versus["proxy"]["loss_tf"]["difference"] == pytest.approx(0.08, abs=0.01)
    text = "\n".join(lines)
    assert "- Without fine-tuning, on token_acc: DiagD loses to NTP (NTP - DiagD +0.2" in text
    assert "| proxy | +0.5" in text and "| no gap |" not in text
    from mcar.tools.table3 import share_cell

    behind = {"difference": -0.08, "interval": (-0.14, -0.04)}  # DiagD ahead of NTP: nothing to close
    assert share_cell({"share": -0.7, "interval": (-1.7, -0.4)}, behind) == "no gap"
    assert "- proxy beats the causal control on token_acc" in text
    assert "- same is not distinguishable from the causal control on token_acc" in text


def test_a_run_from_scratch_gets_equal_total_steps_and_is_compared_with_its_fine_tuning(tmp_path, capsys):
    """table3.scratch: trained with the fine-tuning's mask from the first step for pre-training + fine-tuning steps
    (the dry run prints its command), evaluated with its samplers, and compared with the fine-tuning it names."""
    from omegaconf import OmegaConf

    from mcar.eval import stats as S
    from mcar.tools.table3 import pooled_row, run_pipeline, scratch_table

    run_pipeline(["experiment=crafter_tiles_table3", f"paths.root_dir={tmp_path}"], dry_run=True)
    printed = capsys.readouterr().out
    scratch = next(line for line in printed.splitlines() if line.startswith("[table3] scratch/diagd_proxy:"))
    assert "mask=diagd" in scratch and "trainer.max_steps=1150" in scratch
    tuned = next(line for line in printed.splitlines() if line.startswith("[table3] finetune/causal/seed2:"))
    assert "seed=2 data.seed=2" in tuned  # the batch order follows data.seed
    assert "[table3] eval/scratch_diagd_proxy/diagd_k2:" in printed

    (one, three), clips = S.resample_seeds_and_clips([1, 3], 40, seed=0, resamples=300)
    rows = {("scratch_diagd_proxy", "diagd_k2"): {**fake_eval(0.7, 40, 0), "draws": (one, clips)},
            ("ft_diagd_proxy", "diagd_k2"): {"draws": (three, clips)}}
    rows[("ft_diagd_proxy", "diagd_k2")] |= pooled_row([fake_eval(0.8, 40, s) for s in (1, 2, 3)], (three, clips))
    t = OmegaConf.create({"gap": {"primary": "token_acc"},
                          "scratch": {"diagd_proxy": {"samplers": ["diagd_k2"], "versus": "diagd_proxy"}},
                          "finetune": {"runs": {"diagd_proxy": {"samplers": ["diagd_k2"]}}}})
    found, lines = scratch_table(t, rows)
    d = found["diagd_proxy - diagd_proxy, diagd_k2"]["token_acc"]
    assert d["difference"] == pytest.approx(-0.1, abs=0.01) and d["interval"][1] < 0
    assert "- trained from scratch (diagd_proxy, diagd_k2) does worse than diagd_proxy fine-tuned on token_acc" \
        in "\n".join(lines)


def test_experiment_configs_compose_and_bad_blocks_name_the_field():
    cpu = compose_experiment(["experiment=crafter_table3_cpu"])
    gpu = compose_experiment(["experiment=crafter_table3"])
    assert cpu.model.name == "tiny" and gpu.model.name == "small" and gpu.data.clip_frames == 16
    assert cpu.hydra.runtime.choices.data == "crafter_table3" and cpu.data.episodes == 32
    assert set(cpu.table3.finetune.runs) == {"diagd_proxy", "diagd_plain", "causal"}
    with pytest.raises(ValueError, match="experiment= is required"):
        compose_experiment(["model=tiny"])
    with pytest.raises(ValueError, match=r"table3.finetune.runs.causal.samplers: \['ntp'\]"):
        compose_experiment(["experiment=crafter_table3_cpu", "~table3.samplers.ntp", "table3.gap.ntp=diagd_k1"])
    with pytest.raises(ValueError, match="table3.gap.diagd='nope'"):
        compose_experiment(["experiment=crafter_table3_cpu", "table3.gap.diagd=nope"])
    with pytest.raises(ValueError, match=r"table3.references: \['still'\]"):
        compose_experiment(["experiment=crafter_table3_cpu", "table3.references=[copy_last,still]"])
    assert list(cpu.table3.references) == ["ground_truth", "copy_last", "noise"]
    with pytest.raises(ValueError, match="table3.gap.control='diagd_plain'.*evaluated with diagd_k2"):
        compose_experiment(["experiment=crafter_table3_cpu", "table3.gap.control=diagd_plain",
                            "table3.finetune.runs.diagd_plain.samplers=[ntp]"])
    with pytest.raises(ValueError, match=r"table3.finetune.seeds=\[0, 0\]: a list of distinct integers"):
        compose_experiment(["experiment=crafter_table3_cpu", "table3.finetune.seeds=[0,0]"])
    with pytest.raises(SystemExit, match="dry_run=true: conf/train.yaml has no key dry_run"):
        compose_experiment(["experiment=crafter_table3_cpu", "dry_run=true"])
    with pytest.raises(ValueError, match="table3.gap.primary='speed'"):
        compose_experiment(["experiment=crafter_table3_cpu", "table3.gap.primary=speed"])


TINY = [*SMALL_DATA, "trainer.max_steps=4", "trainer.val_check_interval=2", "checkpoint.every_n_steps=2",
        "val_dashboard.n_clips=0", "logger=none", "table3.finetune.steps=2",
        "table3.finetune.overrides=['trainer.val_check_interval=2','checkpoint.every_n_steps=2']",
        "table3.idm=['steps=4','eval_every=2','batch_size=8']",
        "table3.evaluate=['n_clips=2','batch_size=2','videos=1','logger=none']",
        "~table3.samplers.diagd_k1", "~table3.samplers.diagd_k4", "~table3.finetune.runs.diagd_plain",
        "table3.finetune.seeds=[0,1]", "table3.finetune.runs.causal.samplers=[diagd_k2]",
        "table3.samplers.diagd_k2_d28=['sampler=diagd','schedule.k=2','schedule.d=5']"]


@pytest.mark.slow
def test_pipeline_writes_results_and_a_rerun_skips_every_stage(tmp_path):
    args = ["-m mcar.cli table3", "experiment=crafter_table3_cpu", f"paths.root_dir={tmp_path}", *TINY]
    run_script(*args, timeout=1200)
    out = tmp_path / "outputs" / "table3" / "crafter_table3_cpu"
    state = json.loads((out / "state.json").read_text())
    tuned = {f"finetune/{label}/seed{seed}" for label in ("diagd_proxy", "causal") for seed in (0, 1)}
    assert set(state) == {"pretrain", "idm", "eval/pretrained/ntp", "eval/pretrained/diagd_k2",
                          "eval/pretrained/diagd_k2_d28", *tuned,
                          *(f"eval/ft_diagd_proxy_seed{s}/diagd_k2" for s in (0, 1)),
                          *(f"eval/ft_causal_seed{s}/diagd_k2" for s in (0, 1))}
    res = json.loads((out / "table3.json").read_text())
    rows = {(r["model"], r["sampler"]): r for r in res["rows"]}
    assert set(rows) == {("pretrained", "ntp"), ("pretrained", "diagd k=2"), ("pretrained", "diagd k=2 d=5"),
                         ("ft_diagd_proxy", "diagd k=2"), ("ft_causal", "diagd k=2"),
                         ("pretrained", "ground_truth"), ("pretrained", "copy_last"), ("pretrained", "noise")}
    assert rows[("ft_causal", "diagd k=2")]["seeds"] == 2 and res["seeds"] == [0, 1]
    losses = [json.loads((out / "eval" / f"ft_causal_seed{s}" / "diagd_k2" / "results.json").read_text())
              ["extra"]["diagd k=2"]["per_clip"]["loss_tf"] for s in (0, 1)]
    assert losses[0] != losses[1]  # each seed its own batches: two models, not one twice
    for r in rows.values():  # model rows: intervals over seeds and clips, LOSS_TF's included
        if r["sampler"] not in ("ground_truth", "copy_last", "noise"):
            assert r["token_acc_lo"] <= r["token_acc"] <= r["token_acc_hi"]
            assert r["loss_tf_lo"] <= r["loss_tf"] <= r["loss_tf_hi"]
    for r in rows.values():
        for col in ("psnr", "ssim", "action_f1", "loss_tf", "fps", "tp"):
            if r["sampler"] in ("ground_truth", "copy_last", "noise") and col in ("loss_tf", "fps", "tp"):
                assert r[col] is None
            elif r["sampler"] in ("ground_truth", "copy_last") and col == "psnr":  # inf where equal to the clips
                assert r[col] > 0
            else:
                assert math.isfinite(r[col]), (r["model"], r["sampler"], col)
        assert 0 <= r["unchanged"] <= 1
    assert rows[("pretrained", "copy_last")]["unchanged"] == 1.0
    # passes: NTP (T-P)hw = 24; DiagD (T-2)d + s_spa with s_spa = (h-1)k + w = 8
    assert rows[("pretrained", "ntp")]["step"] == 24 and rows[("pretrained", "diagd k=2")]["step"] == 16
    assert rows[("pretrained", "diagd k=2 d=5")]["step"] == 13
    assert set(res["gap"]) >= {"token_acc", "loss_tf"}
    assert set(res["gap_closed"]) == {"diagd_proxy", "causal"} and set(res["versus_control"]) == {"diagd_proxy"}
    assert res["facts"]["params"] > 0 and res["facts"]["pretrain_steps"] == 4
    text = (out / "table3.md").read_text()
    assert not (tmp_path / "RESULTS.md").exists()  # the table is the run's: a doc quoting it is edited by hand
    assert text.startswith("## crafter_table3_cpu: ") and "| ft_" not in text
    assert "fine-tuned 2 steps: mask=diagd (2 seeds) | diagd k=2 |" in text
    assert "against the causal control (causal)" in text and "- diagd_proxy " in text
    assert "| reference, no model | copy_last | n/a |" in text and "| 1.000 |" in text

    again = run_script(*args, timeout=600)  # every stage done: nothing re-runs, the same table is written again
    assert again.stdout.count("skipped") == len(state)
    assert (out / "table3.md").read_text() == text
