"""End-to-end: a tiny model trained by train.py (W&B offline), its training dashboard, `mcar evaluate`
as a multirun over samplers (table columns, reference rows, W&B run dirs), `mcar.generate` and the IDM job."""
import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch

from .conftest import SMALL_DATA, compose, job_overrides, run_script
from .test_metrics import FakeI3D, FakeLPIPS

RUN = "train-tiny-synthetic-causal"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("evaluate")
    run_script("train.py", *SMALL_DATA, *job_overrides(tmp, "train"), "trainer.max_steps=4",
               "trainer.val_check_interval=2", "val_dashboard.min_steps=0")  # logger=wandb (offline), the default
    return tmp


def offline_run(run_dir: Path) -> Path:
    runs = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(runs) == 1, f"expected one offline W&B run under {run_dir}, found {runs}"
    return runs[0] / "files" / "media"


@pytest.mark.slow
def test_training_dashboard_lands_in_the_offline_wandb_run_and_the_output_dir(trained):
    media = offline_run(trained / "train")
    assert list(media.glob("videos/val/video_*.gif")), "no validation video in the W&B run"
    masks = {p.name.split("_")[0] for p in media.glob("images/masks/*.png")}
    assert {"train", "sampler"} <= masks, f"mask images missing: {masks}"
    assert list(media.glob("table/val/speed_*.table.json"))
    dash = trained / "train" / "dashboard"
    assert {"mask_train.png", "mask_sampler_diagd.png", "val_step0000004.mp4", "val_step0000004.gif",
            "val_speed.csv"} <= {p.name for p in dash.iterdir()}
    rows = list(csv.DictReader(open(dash / "val_speed.csv")))
    assert [r["sampler"] for r in rows] == ["ntp", "diagd k=2"] * 2
    assert int(rows[0]["passes"]) == 2 * 3 * 4 and int(rows[1]["passes"]) == (3 - 1 - 1) * 8 + 8  # (T-P)hw vs DiagD


def train_tiny_idm(tmp: Path) -> Path:
    from mcar.train.idm_training import train_idm

    cfg = compose("idm", [*SMALL_DATA, f"out={tmp}/idm/idm.pt", "steps=20", "eval_every=10", "batch_size=16",
                          f"paths.output_dir={tmp}/idm"])
    report = train_idm(cfg)
    saved = json.loads((tmp / "idm" / "metrics.json").read_text())
    assert saved["val_accuracy"] == report["val_accuracy"] == report["history"][-1]["val_accuracy"]  # step 20 = final
    right = report["val_accuracy"] * report["val_pairs"]  # a fraction of the held-out pairs
    assert right == pytest.approx(round(right), abs=1e-9) and 0 <= round(right) <= report["val_pairs"]
    return tmp / "idm" / "idm.pt"


@pytest.mark.slow
def test_evaluate_multirun_writes_the_results_table(trained):
    tmp = trained
    torch.jit.script(FakeI3D()).save(str(tmp / "i3d.pt"))
    torch.jit.script(FakeLPIPS()).save(str(tmp / "lpips.pt"))
    idm = train_tiny_idm(tmp)
    run_script("-m mcar.cli evaluate", "-m", *SMALL_DATA, *job_overrides(tmp, "eval"), f"ckpt={tmp}/ckpt/{RUN}",
               "sampler=ntp,diagd", "references=[ground_truth,noise]", "n_clips=2", "batch_size=2",
               f"fvd.i3d={tmp}/i3d.pt", f"lpips={tmp}/lpips.pt", f"trust_code=[{tmp}/i3d.pt,{tmp}/lpips.pt]",
               f"idm={idm}")
    from mcar.eval.metric_registry import csv_keys

    table = list(csv.DictReader(open(tmp / "multi" / "results.csv")))
    assert list(table[0].keys()) == csv_keys()
    rows = {r["sampler"]: r for r in table}
    assert sorted(rows) == ["diagd k=2", "ground_truth", "noise", "ntp"]  # references once, not once per job
    for name in ("ntp", "diagd k=2"):
        r = rows[name]
        for col in ("fvd", "psnr", "ssim", "lpips", "action_f1", "action_acc", "loss_tf", "fps", "tp", "step"):
            assert math.isfinite(float(r[col])), (name, col, r[col])
        assert r["model"] == RUN and r["clips"] == "2" and r["frames"] == "3"
        assert not re.search(r"\b(fvd|psnr|ssim|lpips|action_f1|action_acc)[,:]", r["notes"]), r["notes"]
    assert rows["ntp"]["step"] == str(2 * 3 * 4) and rows["diagd k=2"]["step"] == str((3 - 1 - 1) * 8 + 8)
    gt, noise = rows["ground_truth"], rows["noise"]
    assert float(gt["psnr"]) == math.inf and float(gt["ssim"]) == pytest.approx(1)
    assert float(gt["fvd"]) == pytest.approx(0, abs=1e-6) and float(gt["lpips"]) == 0
    assert float(noise["psnr"]) < 20 and float(noise["fvd"]) > 0
    assert gt["loss_tf"] == "" and 0 < float(rows["ntp"]["loss_tf"]) < 2 * math.log(40)
    assert gt["action_f1"] == gt["action_f1_gt"]  # the IDM on ground truth is the reference
    assert "| FVD | PSNR | SSIM | LPIPS |" in (tmp / "multi" / "results.md").read_text()
    assert "| action_f1_gt | loss_tf |" in (tmp / "multi" / "results.md").read_text()
    assert not [k for k in gt if k.startswith(("prec_", "rec_"))]  # synthetic data: no movement actions, no columns

    for job in ("0", "1"):  # each job: its own output dir with everything W&B shows, and its own W&B run
        out = tmp / "multi" / job
        assert {"results.csv", "results.md", "results.json", "per_frame.csv"} <= {p.name for p in out.iterdir()}
        assert list((out / "videos").glob("clip0.mp4")) and list(out.glob("mask_*.png"))
        media = offline_run(out)
        assert list(media.glob("table/eval/results_*.table.json")) and list(media.glob("videos/eval/*.gif"))
        assert list(media.glob("images/eval/mask_*.png"))
    frames = list(csv.DictReader(open(tmp / "multi" / "0" / "per_frame.csv")))
    assert [int(r["frame"]) for r in frames if r["row"] == "ntp"] == [1, 2]  # generated frames only


def test_evaluate_and_generate_bad_input_name_the_field(tmp_path):
    from mcar.checkpoint.load import resolve_ckpt
    from mcar.sampling.held_out import pick_clips

    with pytest.raises(FileNotFoundError, match="ckpt: checkpoint not found: .*nope"):
        resolve_ckpt(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="ckpt is required"):
        resolve_ckpt(None)
    with pytest.raises(ValueError, match=r"clips=\[0, 9\]: ids \[9\] out of range.*3 clips"):
        pick_clips(range(3), 2, [0, 9])
    assert pick_clips(range(10), 3) == [0, 4, 9]  # round(4.5) == 4: evenly spaced, ends included
    assert pick_clips(range(10), 20) == list(range(10)) and pick_clips(range(10), 1) == [0]


class ConstantIDM:
    """An IDM that always predicts action `a` (n_a = 1)."""

    def __init__(self, a: int):
        self.a = a

    def predict(self, x, y):
        return torch.full((len(x), 1), self.a)


def test_score_reference_rows_and_action_f1_exactly():
    """ground truth scores PSNR inf and SSIM 1, noise far lower; a constant IDM gets the F1 worked out by hand;
    missing nets become notes naming the columns."""
    from mcar.core.layout import Layout
    from mcar.eval import networks as N
    from mcar.eval.scoring import Scorer, reference_clips, score, score_rows
    from mcar.tokenizer.clips import join_clip

    from .test_data_vpt import tiny_vq

    layout, cb, T, P = Layout(2, 3, 1), 16, 5, 1
    g = torch.Generator().manual_seed(0)
    acts = torch.tensor([[0], [1], [0], [1], [0]])  # pairs t = 0..3 end in a generated frame: actions 0, 1, 0, 1
    gt = torch.stack([join_clip(torch.randint(0, cb, (T, 2, 3), generator=g), acts, cb) for _ in range(2)])
    missing = N.Unavailable("no weights")
    scorer = Scorer(layout=layout, codebook_size=cb, prompt_frames=P, vq=tiny_vq(),
                    nets={"i3d": missing, "lpips": missing, "dino": missing, "raft": missing, "musiq": missing,
                          "idm": ConstantIDM(0)},
                    names={0: "noop", 1: "move_left"},
                    moves=("move_left", "move_right", "move_up", "move_down"))  # Crafter's: the data's own moves
    row, curves, extra = score(gt.clone(), gt, scorer=scorer)
    assert row["psnr"] == math.inf and row["ssim"] == pytest.approx(1, abs=1e-6)
    assert curves["psnr"] == [math.inf] * (T - P) and "lpips" not in curves
    # always 0 on targets 0, 1, 0, 1: action 0 precision 1/2, recall 1, F1 2/3; action 1 F1 0; macro F1 1/3
    assert row["action_f1"] == pytest.approx(1 / 3) and row["action_acc"] == 0.5
    assert row["action_f1_gt"] == row["action_f1"]
    assert extra["per_action"]["noop"] == {"precision": 0.5, "recall": 1.0, "f1": pytest.approx(2 / 3), "support": 4}
    # move_left is never predicted (precision undefined) and never found; the other moves are not in the clips
    assert (row["prec_move_left"], row["rec_move_left"], row["prec_move_up"], row["rec_move_up"]) == (None, 0.0,
                                                                                                     None, None)
    assert row["notes"] == "lpips, fvd, subject_consistency, dynamic_degree, imaging_quality: no weights"

    noise = reference_clips("noise", gt, layout, P, cb, seed=0)
    assert torch.equal(noise[:, :layout.frame_len], gt[:, :layout.frame_len])  # the prompt frame is kept
    rows, _, _ = score_rows({"ground_truth": (gt.clone(), {}), "noise": (noise, {})}, gt, scorer=scorer,
                            common={"model": "m"})
    by = {r["sampler"]: r for r in rows}
    assert by["ground_truth"]["psnr"] == math.inf and math.isfinite(by["noise"]["psnr"])
    assert by["noise"]["psnr"] < 25 and by["noise"]["ssim"] < 0.8  # tiny VQ: 20.1 dB, 0.73



def test_a_registry_entry_drives_its_column_everywhere(tmp_path, monkeypatch):
    """A metric is one entry of metric_registry: with a token metric added there, scoring computes it per clip with
    its bootstrap interval, and results.json, results.csv, results.md and the terminal table carry it. token_acc
    of the reference rows: ground_truth 1, copy_last the real share of tokens that stay, noise about 1/codebook."""
    from mcar.core.layout import Layout
    from mcar.eval import metric_registry as R
    from mcar.eval import networks as N
    from mcar.eval.reporting import terminal_table, write_results_json, write_table
    from mcar.eval.scoring import Scorer, reference_clips, score_rows
    from mcar.tokenizer.clips import join_clip

    layout, cb, T, P = Layout(2, 3, 1), 4, 5, 1
    g = torch.Generator().manual_seed(0)
    gt = torch.stack([join_clip(torch.randint(0, cb, (T, 2, 3), generator=g), torch.zeros(T, 1, dtype=torch.long),
                                cb) for _ in range(6)])
    last_same = lambda gen, real, layout, cb, P: (gen[:, -2] == real[:, -2]).double()  # last image token
    new = R.Column("last_token_same", "LAST", digits=3, better="higher", pool=R.mean_of, tokens=last_same,
                   terminal=True, means="the last image token is the real one")
    monkeypatch.setattr(R, "COLUMNS", (*R.COLUMNS, new))
    missing = N.Unavailable("no weights")
    scorer = Scorer(layout=layout, codebook_size=cb, prompt_frames=P, vq=missing,
                    nets={"i3d": missing, "lpips": missing, "dino": missing, "raft": missing, "musiq": missing,
                          "idm": missing}, names={}, seed=3)
    outputs = {kind: (reference_clips(kind, gt, layout, P, cb, seed=0), {})
               for kind in ("ground_truth", "copy_last", "noise")}
    rows, curves, extras = score_rows(outputs, gt, scorer=scorer, common={"model": "m", "clips": len(gt)})
    by = {r["sampler"]: r for r in rows}
    assert by["ground_truth"]["token_acc"] == 1.0 and by["ground_truth"]["last_token_same"] == 1.0
    images = gt.view(6, T, -1)[:, :, :6]  # frame_len 7: 6 image tokens, 1 action
    assert by["copy_last"]["token_acc"] == pytest.approx(float((images[:, P:] == images[:, P - 1:P]).double().mean()))
    assert 0 < by["noise"]["token_acc"] < 0.5
    for r in rows:
        for key in ("token_acc", "last_token_same", "unchanged"):
            assert r[f"{key}_lo"] <= r[key] <= r[f"{key}_hi"], (r["sampler"], key)

    write_results_json(tmp_path, rows, curves, list(range(6)), {}, extras)
    saved = json.loads((tmp_path / "results.json").read_text())
    keys = list(saved["rows"][0])
    assert keys.index("last_token_same") + 2 == keys.index("last_token_same_hi")  # in the registry's order
    assert saved["rows"][1]["last_token_same"] == by["copy_last"]["last_token_same"]
    assert saved["intervals"]["resamples"] == R.CI_RESAMPLES
    for r in rows:  # each clip's values, for intervals pooled over evaluations: their pool is the row's value
        per_clip = saved["extra"][r["sampler"]]["per_clip"]
        assert len(per_clip["last_token_same"]) == len(gt)
        assert R.mean_of(torch.tensor(per_clip["token_acc"])) == pytest.approx(r["token_acc"])
    write_table(rows, tmp_path)
    assert "last_token_same_lo" in (tmp_path / "results.csv").read_text().splitlines()[0]
    assert "| LAST |" in (tmp_path / "results.md").read_text()
    shown = terminal_table(rows).splitlines()
    assert shown[0].split() == ["sampler", "token_acc", "PSNR", "action_f1", "FPS", "LAST"]
    noise = next(line for line in shown if line.startswith("noise"))
    lo, hi = by["noise"]["token_acc_lo"], by["noise"]["token_acc_hi"]
    assert f"{by['noise']['token_acc']:.3f} [{lo:.3f}, {hi:.3f}]" in noise and "n/a" in noise
    assert shown[-1].startswith("token_acc ↑: share of generated image tokens") and "LAST ↑: the last" in shown[-1]


@pytest.mark.parametrize("P", [1, 2])
def test_copy_last_reference_repeats_the_last_prompt_frame(P):
    """copy_last: every generated frame's image is the last prompt frame's, exactly; the prompt frames and every
    action token stay the ground truth's (the schedule's own gen_slots, as mcar.evaluate passes them)."""
    from mcar.core.layout import Layout
    from mcar.eval.scoring import reference_clips
    from mcar.tokenizer.clips import join_clip, split_clip

    layout, cb, T = Layout(2, 3, 2), 16, 5
    g = torch.Generator().manual_seed(P)
    gt = torch.stack([join_clip(torch.randint(0, cb, (T, 2, 3), generator=g), torch.randint(0, 4, (T, 2), generator=g),
                                cb) for _ in range(3)])
    out = reference_clips("copy_last", gt, layout, P, cb)
    assert out.shape == gt.shape and not torch.equal(out, gt)
    ids, acts = split_clip(out, layout, cb)
    gt_ids, gt_acts = split_clip(gt, layout, cb)
    assert torch.equal(ids[:, :P], gt_ids[:, :P])  # prompt untouched
    assert torch.equal(acts, gt_acts)  # every action is the ground truth's
    for t in range(P, T):
        assert torch.equal(ids[:, t], gt_ids[:, P - 1])  # nothing moves
    assert torch.equal(gt, reference_clips("ground_truth", gt, layout, P, cb))  # the input is not modified
    with pytest.raises(ValueError, match="copy_last"):
        reference_clips("nope", gt, layout, P, cb)


@pytest.mark.parametrize("P", [1, 2])
def test_unchanged_counts_tokens_equal_to_the_frame_before(P):
    """unchanged: over the generated frames, the share of image tokens equal to the same place one frame earlier,
    counted here token by token from the flat clip (no split_clip); copy_last scores 1, and the row carries it."""
    from mcar.core.layout import Layout
    from mcar.eval.metrics import unchanged_per_clip
    from mcar.eval.scoring import reference_clips
    from mcar.tokenizer.clips import join_clip

    layout, cb, T = Layout(2, 3, 2), 4, 5  # 4 codes: many tokens repeat by chance
    g = torch.Generator().manual_seed(P)
    clips = torch.stack([join_clip(torch.randint(0, cb, (T, 2, 3), generator=g),
                                   torch.randint(0, 3, (T, 2), generator=g), cb) for _ in range(3)])
    same = total = 0
    flen, ftok = layout.frame_len, layout.frame_tokens
    for clip in clips.tolist():
        for t in range(P, T):
            for j in range(ftok):
                same += clip[t * flen + j] == clip[(t - 1) * flen + j]
                total += 1
    assert float(unchanged_per_clip(clips, layout, cb, P).mean()) == pytest.approx(same / total)
    assert 0 < same < total
    still = reference_clips("copy_last", clips, layout, P, cb)
    assert unchanged_per_clip(still, layout, cb, P).tolist() == [1.0] * 3


@pytest.mark.slow
def test_generate_writes_mp4_and_gif_next_to_ground_truth(trained):
    from mcar.tools.generate import generate

    out = trained / "gen"
    cfg = compose("generate", [*SMALL_DATA, f"ckpt={trained}/ckpt/{RUN}/last.ckpt", "sampler=diagd", "schedule.k=2",
                               "prompt=1", "frames=3", f"paths.output_dir={out}"])
    res = generate(cfg)
    assert res["mp4"].stat().st_size > 0 and res["gif"].stat().st_size > 0 and res["passes"] == (3 - 1 - 1) * 8 + 8
    saved = torch.load(out / "clip1_diagd.pt")
    assert saved["has_ground_truth"] and saved["generated"].shape == (1, 3 * (12 + 2))
    bad = compose("generate", [*SMALL_DATA, f"ckpt={trained}/ckpt/{RUN}", "prompt=99", f"paths.output_dir={out}"])
    with pytest.raises(ValueError, match="prompt=99: the held-out set has 2 clips"):
        generate(bad)
