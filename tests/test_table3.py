"""Crafter table 3 (mcar/tools/table3.py): the gap formula, the RESULTS.md section, config checks, and the whole
pipeline (pre-train, IDM, evaluations, three fine-tunings, table) on a tiny synthetic setting, re-run = no-op."""
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcar.tools.table3 import compose_experiment, gap_closed, update_section

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


def test_update_section_replaces_only_its_own_section(tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n\nhand-written intro\n")
    sec = lambda name, body: f"<!-- table3:{name} start -->\n{body}\n<!-- table3:{name} end -->\n"
    update_section(md, "a", sec("a", "one"))
    update_section(md, "b", sec("b", "two"))
    update_section(md, "a", sec("a", "three"))
    text = md.read_text()
    assert text.startswith("# Results\n\nhand-written intro\n") and text.count("table3:a start") == 1
    assert "three" in text and "one" not in text and text.index("three") < text.index("two")


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


TINY = [*SMALL_DATA, "trainer.max_steps=4", "trainer.val_check_interval=2", "checkpoint.every_n_steps=2",
        "val_dashboard.n_clips=0", "logger=none", "table3.finetune.steps=2",
        "table3.finetune.overrides=['trainer.val_check_interval=2','checkpoint.every_n_steps=2']",
        "table3.idm=['steps=4','eval_every=2','batch_size=8']",
        "table3.evaluate=['n_clips=2','batch_size=2','videos=1','logger=none']",
        "~table3.samplers.diagd_k1", "~table3.samplers.diagd_k4",
        "table3.samplers.diagd_k2_d28=['sampler=diagd','schedule.k=2','schedule.d=5']"]


@pytest.mark.slow
def test_pipeline_writes_results_and_a_rerun_skips_every_stage(tmp_path):
    args = ["-m mcar.cli table3", "experiment=crafter_table3_cpu", f"paths.root_dir={tmp_path}", *TINY]
    run_script(*args, timeout=1200)
    out = tmp_path / "outputs" / "table3" / "crafter_table3_cpu"
    state = json.loads((out / "state.json").read_text())
    assert set(state) == {"pretrain", "idm", "eval/pretrained/ntp", "eval/pretrained/diagd_k2",
                          "eval/pretrained/diagd_k2_d28", "finetune/diagd_proxy", "eval/ft_diagd_proxy/diagd_k2",
                          "finetune/diagd_plain", "eval/ft_diagd_plain/diagd_k2", "finetune/causal",
                          "eval/ft_causal/ntp", "eval/ft_causal/diagd_k2"}
    res = json.loads((out / "table3.json").read_text())
    rows = {(r["model"], r["sampler"]): r for r in res["rows"]}
    assert set(rows) == {("pretrained", "ntp"), ("pretrained", "diagd k=2"), ("pretrained", "diagd k=2 d=5"),
                         ("ft_diagd_proxy", "diagd k=2"), ("ft_diagd_plain", "diagd k=2"), ("ft_causal", "ntp"),
                         ("ft_causal", "diagd k=2"), ("pretrained", "ground_truth"), ("pretrained", "copy_last"),
                         ("pretrained", "noise")}
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
    assert set(res["gap_closed"]) == {"diagd_proxy", "diagd_plain", "causal"}
    assert res["facts"]["params"] > 0 and res["facts"]["pretrain_steps"] == 4
    text = (tmp_path / "RESULTS.md").read_text()
    assert text.count("<!-- table3:crafter_table3_cpu start") == 1 and "| ft_" not in text
    assert "fine-tuned 2 steps: mask=diagd mask.proxy_slots=false | diagd k=2 |" in text
    assert "| reference, no model | copy_last | n/a |" in text and "| 1.000 |" in text

    again = run_script(*args, timeout=600)  # every stage done: nothing re-runs, the section is rewritten once
    assert again.stdout.count("skipped") == len(state)
    assert (tmp_path / "RESULTS.md").read_text().count("<!-- table3:crafter_table3_cpu start") == 1
