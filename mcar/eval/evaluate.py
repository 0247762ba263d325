"""Evaluate a world model as the paper does: held-out clips, P prompt frames + every action as the prompt,
generate the rest, compare with the ground truth. One results row per sampler setting.

    mcar evaluate ckpt=checkpoints/<run>/last.ckpt data=crafter sampler=diagd schedule.k=2
    mcar evaluate -m ckpt=... 'sampler=ntp,diagd' n_clips=16     # rows gather in <sweep dir>/results.*
    mcar evaluate ckpt=... fvd.i3d=/weights/i3d_torchscript.pt lpips=/weights/lpips_alex.pt idm=...
    mcar evaluate ckpt=... vbench.dino=/weights/dino-vitb16        # pip install 'mcar[vbench]'
    mcar evaluate ckpt=... vbench.raft=/weights/raft_large_C_T_V1-22a6c225.pth \
        vbench.musiq=/weights/musiq_spaq_ckpt-358bb6af.pth          # torchvision + pyiqa: mcar/eval/networks.py


Columns (one entry each in mcar/eval/metric_registry.py): token_acc (the share of generated image tokens equal
to the real ones), FVD (I3D from a local TorchScript file), PSNR / SSIM / LPIPS of generated vs ground-truth
frames (both decoded by the VQ, so the VQ's own loss is not counted), SUBJ (VBench's subject consistency: DINO
features of each generated frame against the one before and the first), DYN and IMG (VBench's dynamic degree:
the share of clips whose RAFT optical flow moves, and imaging quality: MUSIQ / 100), the action-following macro F1
of the inverse-dynamics model (`mcar idm`) on generated frame pairs vs the conditioning actions (and on ground-truth
pairs, its ceiling), FPS (generated frames per second), TP (generated tokens per second), STEP (forward passes per
clip, i.e. per batch), LOSS_TF (the teacher-forced cross-entropy of the generated image tokens on the sampler's own
schedule, ground truth fed: for DiagD the loss the fine-tuning masks train). Speed is timed around generation only,
after a warm-up, synchronised on GPU; the model samples in bfloat16 on CUDA and float32 on CPU (dtype=auto).
A metric whose weights are missing is 'n/a' with the reason in `notes`. A metric with per-clip values (token_acc,
PSNR, SSIM, LPIPS, SUBJ, DYN, IMG, unchanged, action_acc) comes with a 95% bootstrap interval over clips (<key>_lo,
<key>_hi; 1000 resamples seeded by `seed`); results.json keeps each row's per-clip values (extra.<row>.per_clip,
LOSS_TF's too), so that intervals can be pooled over several evaluations (mcar table3). The terminal shows a narrow
table; everything logged to W&B is also written to the run's output dir: results.{md,csv,json} (every column),
per_frame.csv, videos/, mask_<sampler>.png.

The parts: the checkpoint ready to sample and its held-out clips (mcar.sampling.WorldModel), metrics
(mcar.eval.scoring), tables, W&B and videos (mcar.eval.reporting); this module runs them in order.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from mcar.checkpoint.load import resolve_ckpt
from mcar.core.devices import set_threads
from mcar.core.latency import frames_per_second
from mcar.eval import networks as N
from mcar.eval.action_following import check_idm_fits, load_idm, resolve_idm
from mcar.eval.reporting import (
    gather_sweep,
    log_wandb,
    terminal_table,
    write_per_frame,
    write_results_json,
    write_table,
    write_videos,
)
from mcar.eval.scoring import Scorer, reference_clips, score_rows
from mcar.idm.scores import action_names, data_moves
from mcar.sampling.world_model import WorldModel
from mcar.tokenizer.pictures import mask_image, schedule_table, write_png

log = logging.getLogger("mcar.eval.evaluate")


def evaluate(cfg: DictConfig) -> list[dict]:
    set_threads(cfg.threads)
    for key in ("n_clips", "batch_size"):
        if cfg[key] is not None and int(cfg[key]) < 1:
            raise ValueError(f"{key}={cfg[key]}: evaluate needs at least 1 (conf/evaluate.yaml)")
    torch.manual_seed(cfg.seed)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    wm = WorldModel.from_config(cfg)
    layout, cb = wm.layout, wm.codebook_size
    frames = cfg.frames or wm.trained_frames
    sampler = wm.sampler(frames)  # past the model's context it rolls, as generate does
    P = sampler.prompt_frames
    dm, ids, gt = wm.pick_held_out(frames, cfg.n_clips, cfg.clips)  # the data read once
    log.info("%s: %d held-out clips of %d frames, %d prompt frame(s), sampler %s%s", cfg.ckpt, len(ids), frames, P,
             sampler.label, f", a rolling window of {sampler.context} frames" if sampler.rolls() else "")

    trusted = list(cfg.get("trust_code") or [])
    nets = {"i3d": N.load_torchscript(cfg.fvd.i3d, "I3D", "fvd.i3d", trusted),
            "lpips": N.load_torchscript(cfg.lpips, "LPIPS", "lpips", trusted),
            "dino": N.load_dino(cfg.vbench.dino),
            "raft": N.load_raft(cfg.vbench.raft),
            "musiq": N.load_musiq(cfg.vbench.musiq),
            "idm": check_idm_fits(load_idm(resolve_idm(cfg.idm, cfg.paths.checkpoint_root, cfg.data.name)), dm, cb,
                                   layout.n_a, cfg.data.action_vocab_size)}
    try:
        vq = wm.vq
    except FileNotFoundError as e:
        vq = N.Unavailable(str(e))
    names = action_names(cfg.data, cfg.data.action_vocab_size)
    model_name = cfg.name or resolve_ckpt(cfg.ckpt).parent.name

    gen, stats = wm.generate(gt, sampler, cfg.batch_size, cfg.warmup, progress=True)
    generated_frames = len(gt) * (frames - P)
    loss_tf = wm.teacher_forced_loss(gt, sampler, cfg.batch_size)
    # FPS: batch generation's frames/s, tokens only (docs/speed.md)
    speed = {"fps": frames_per_second(generated_frames, stats.seconds), "tp": stats.tokens / stats.seconds,
             "step": stats.passes, "seconds": stats.seconds, "loss_tf": float(loss_tf.mean())}
    outputs = {sampler.label: (gen, speed)}
    for kind in cfg.references:
        outputs[kind] = (reference_clips(kind, gt, layout, P, cb, cfg.seed), {})

    common = {"model": model_name, "clips": len(ids), "frames": frames, "prompt_frames": P}
    scorer = Scorer(layout=layout, codebook_size=cb, prompt_frames=P, vq=vq, nets=nets, names=names, seed=cfg.seed,
                    moves=data_moves(cfg.data))
    rows, curves, extras = score_rows(outputs, gt, scorer=scorer, common=common)
    extras[sampler.label]["per_clip"]["loss_tf"] = loss_tf.tolist()
    media = write_videos(cfg, gt, outputs, layout, cb, vq, out)
    mask = write_png(mask_image(schedule_table(sampler)), out / f"mask_{sampler.name}.png")
    media[f"eval/mask_{sampler.name}"] = mask

    write_table(rows, out)
    per_frame = write_per_frame(curves, P, out)
    write_results_json(out, rows, curves, ids, {k: v[1] for k, v in outputs.items()}, extras)
    gather_sweep(rows)
    log_wandb(cfg, rows, per_frame, media)
    log.info("%s:\n%s\nevery column: %s (and .csv, .json)", model_name, terminal_table(rows), out / "results.md")
    return rows
