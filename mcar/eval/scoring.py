"""Scoring generated clips against the ground truth: PSNR / SSIM / LPIPS per frame, FVD per clip (frames decoded
by the VQ) and the inverse-dynamics model's action-following scores (on tokens: the IDM looks them up in its saved
copy of the VQ codebook): macro F1, accuracy, and precision / recall of each of the data's movement actions
(Crafter's `prec_move_left`, ...,
from the IDM's predictions on generated pairs against the conditioning actions; on the ground_truth reference row,
the IDM on ground-truth pairs: the ceiling), and a bootstrap interval over clips for each metric with per-clip
values. The columns themselves: metric_registry."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mcar.core.agreement import nothing_moves
from mcar.core.layout import Layout
from mcar.eval import metric_registry as R
from mcar.eval import metrics as M
from mcar.eval import networks as N
from mcar.eval import stats as S
from mcar.idm.scores import action_pr, action_scores, frame_pairs, pr_keys
from mcar.tokenizer.clips import split_clip
from mcar.tokenizer.pictures import decode_frames, invalid_image_tokens


@dataclass(frozen=True)
class Scorer:
    """What scoring needs besides the clips: the layout, the codebook size, P prompt frames (not scored), the VQ
    (or N.Unavailable), the nets {i3d, lpips, dino, raft, musiq, idm} (each a net or N.Unavailable) and the IDM's
    action names."""

    layout: Layout
    codebook_size: int
    prompt_frames: int
    vq: object
    nets: dict
    names: dict
    seed: int = 0  # of the bootstrap intervals
    moves: tuple[str, ...] = ()  # the data's movement actions: their precision/recall columns (idm.data_moves)


def _pixels(scorer: Scorer, gen: torch.Tensor, gt: torch.Tensor):
    """Both clips decoded, (n, T, 3, H, W) each, or one N.Unavailable for both."""
    if isinstance(scorer.vq, N.Unavailable):
        return scorer.vq, scorer.vq
    try:
        return tuple(decode_frames(scorer.vq, split_clip(x.cpu(), scorer.layout, scorer.codebook_size)[0])
                     for x in (gen, gt))
    except ValueError as e:
        return (N.Unavailable(str(e)),) * 2


def score(gen: torch.Tensor, gt: torch.Tensor, *, scorer: Scorer) -> tuple[dict, dict, dict]:
    """-> (row metrics, per-frame curves {psnr, ssim, lpips: [T-P]}, extra {per_action, per_action_gt, per_clip}) for
    generated vs gt. Row keys: the columns of metric_registry (token_acc, unchanged, psnr, ssim, lpips, fvd,
    action_f1, action_acc, action_f1_gt, prec_<move>, rec_<move>: None where undefined, the action never predicted
    / never taken, or not in the data's actions), notes, and <key>_lo / <key>_hi, the bootstrap interval over
    clips of each column with per-clip values (the row value is the same pool of the same values); extra's per_clip
    holds those values ({key: [n]}; psnr's are each clip's MSE), for intervals pooled over several evaluations."""
    layout, cb, P = scorer.layout, scorer.codebook_size, scorer.prompt_frames
    row, curves, extra = {}, {}, {}
    per_clip = {c.key: c.tokens(gen.cpu(), gt.cpu(), layout, cb, P) for c in R.COLUMNS if c.tokens is not None}
    pix_gen, pix_gt = _pixels(scorer, gen, gt)
    if isinstance(pix_gen, N.Unavailable):
        for k in ("psnr", "ssim", "lpips", "fvd", "subject_consistency", "dynamic_degree", "imaging_quality"):
            row[k] = pix_gen
    else:
        _score_pixels(scorer, pix_gen, pix_gt, row, curves, per_clip)
    _score_actions(scorer, gen, gt, row, per_clip, extra)
    extra["per_clip"] = {key: values.double().cpu().tolist() for key, values in per_clip.items()}
    for key, values in per_clip.items():
        pool = R.column(key).pool
        row[key] = float(pool(values.double().cpu()))
        row[f"{key}_lo"], row[f"{key}_hi"] = S.bootstrap_ci(values, pool, scorer.seed, R.CI_RESAMPLES, R.CI_LEVEL)
    row["notes"] = _unavailable_notes(row)
    return row, curves, extra


def _score_pixels(scorer: Scorer, pix_gen: torch.Tensor, pix_gt: torch.Tensor, row: dict, curves: dict,
                  per_clip: dict) -> None:
    """The pixel columns (PSNR, SSIM, LPIPS, FVD, VBench's) into row / curves / per_clip, each column's values or
    the reason there are none."""
    P, nets = scorer.prompt_frames, scorer.nets
    g, t = pix_gen[:, P:], pix_gt[:, P:]  # generated frames only
    ssim = M.ssim_per_frame(g, t)  # PSNR from the MSE pooled over clips (and frames): see M.psnr_pooled
    curves["psnr"], curves["ssim"] = M.psnr_pooled(g, t, dim=0).tolist(), M.mean_over_clips(ssim)
    per_clip["psnr"], per_clip["ssim"] = M.mse_per_clip(g, t), ssim.double().mean(1)
    lp = M.lpips_per_frame(nets["lpips"], g, t)
    if isinstance(lp, N.Unavailable):
        row["lpips"] = lp
    else:
        per_clip["lpips"], curves["lpips"] = lp.double().mean(1), M.mean_over_clips(lp)
    row["fvd"] = M.fvd(nets["i3d"], pix_gen, pix_gt)  # whole clips, as MineWorld
    # VBench's columns, each clip's values or the reason there are none: subject consistency and dynamic degree
    # from the last prompt frame on (the generated video and its start), imaging quality of the generated frames
    vbench = {"subject_consistency": M.subject_consistency_per_clip(nets["dino"], pix_gen[:, P - 1:]),
              "dynamic_degree": M.dynamic_degree_per_clip(nets["raft"], pix_gen[:, P - 1:]),
              "imaging_quality": M.imaging_quality_per_clip(nets["musiq"], g)}
    for key, values in vbench.items():
        (row if isinstance(values, N.Unavailable) else per_clip)[key] = values


def _score_actions(scorer: Scorer, gen: torch.Tensor, gt: torch.Tensor, row: dict, per_clip: dict,
                   extra: dict) -> None:
    """The IDM's columns (action F1 / accuracy / precision and recall per move) into row / per_clip / extra: the
    actions the IDM reads off the generated frames against those taken, and off the true frames as the ceiling."""
    layout, cb, P, idm = scorer.layout, scorer.codebook_size, scorer.prompt_frames, scorer.nets["idm"]
    if isinstance(idm, N.Unavailable):
        row["action_f1"] = row["action_acc"] = row["action_f1_gt"] = idm
        row.update(dict.fromkeys(pr_keys(scorer.moves)))  # n/a; the reason is noted once, under action_f1
        return
    a, b, act = frame_pairs(gen.cpu(), layout, cb, first=P - 1)  # pairs ending in a generated frame
    pred = idm.predict(a, b)
    s = action_scores(pred, act, scorer.names)
    a, b, _ = frame_pairs(gt.cpu(), layout, cb, first=P - 1)
    s_gt = action_scores(idm.predict(a, b), act, scorer.names)
    row.update(action_f1=s["macro_f1"], action_f1_gt=s_gt["macro_f1"])
    per_clip["action_acc"] = (pred.reshape(len(act), -1) == act.reshape(len(act), -1)).all(1).double().view(
        len(gen), -1).mean(1)  # pairs are clip-major
    row.update(action_pr(pred, act, scorer.names, scorer.moves))
    extra["per_action"], extra["per_action_gt"] = s["per_action"], s_gt["per_action"]


def _unavailable_notes(row: dict) -> str:
    """Each reason a column has no value, once, with the columns it holds for."""
    by_reason: dict[str, list[str]] = {}
    for k, v in row.items():
        if isinstance(v, N.Unavailable):
            by_reason.setdefault(v.reason, []).append(k)
    return "; ".join(f"{', '.join(keys)}: {reason}" for reason, keys in by_reason.items())


def score_rows(outputs: dict, gt: torch.Tensor, *, scorer: Scorer, common: dict):
    """{label: (clips, speed)} -> table rows, per-frame curves and per-action extras, one per label. Image slots
    that got an action id are scored as code 0 (and counted in the row's notes); `outputs` then holds those clips,
    so videos show what was scored."""
    layout, cb, P = scorer.layout, scorer.codebook_size, scorer.prompt_frames
    rows, curves, extras = [], {}, {}
    for label, (clips, spd) in outputs.items():
        clips, n_bad = invalid_image_tokens(clips, layout, cb)
        outputs[label] = (clips, spd)  # videos show what was scored
        row, curves[label], extras[label] = score(clips, gt, scorer=scorer)
        if n_bad:
            n_img = len(clips) * (gt.shape[1] // layout.frame_len - P) * layout.frame_tokens
            row["notes"] = "; ".join(filter(None, [f"{n_bad}/{n_img} generated image tokens were action ids "
                                                   f"(scored as code 0)", row["notes"]]))
        rows.append({**common, "sampler": label, **row, **{k: spd.get(k) for k in ("loss_tf", "fps", "tp", "step")}})
    return rows, curves, extras


REFERENCES = ("ground_truth", "noise", "copy_last")


def reference_clips(kind: str, clips: torch.Tensor, layout: Layout, prompt_frames: int, codebook_size: int,
                    seed: int = 0) -> torch.Tensor:
    """Reference rows: 'ground_truth' (the clips themselves: PSNR inf, the ceiling), 'noise' (random tokens in every
    generated image slot, the floor) or 'copy_last' (every generated frame is the last prompt frame's image:
    "nothing moves"). Prompt frames and every action stay the clips' own."""
    if kind == "ground_truth":
        return clips.clone()
    if kind == "noise":
        out = clips.clone()
        generated = layout.is_image(clips.shape[1] // layout.frame_len).to(clips.device)
        generated[:layout.n_slots(prompt_frames)] = False
        g = torch.Generator().manual_seed(seed)
        out[:, generated] = torch.randint(0, codebook_size, (len(clips), int(generated.sum())), generator=g).to(out)
        return out
    if kind == "copy_last":
        return nothing_moves(clips, layout, prompt_frames)
    raise ValueError(f"references: unknown {kind!r}; choose from {', '.join(REFERENCES)}")
