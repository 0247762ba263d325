"""Training the inverse-dynamics model (`mcar idm`, conf/idm.yaml) on the world model's own data: the model and
its scores are mcar.idm's; this is the loop, the held-out report and the saved idm.pt + metrics.json.

    mcar idm data=crafter                 # -> checkpoints/idm-crafter/idm.pt + metrics.json
"""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, open_dict
from tqdm import tqdm

from mcar.atomic import write_json
from mcar.core.devices import set_threads
from mcar.core.lr_schedule import warmup_cosine
from mcar.data.common import build_datamodule, complete_data_config
from mcar.idm.model import InverseDynamics, random_codebook, save_idm, tokens_name, vq_codebook
from mcar.idm.scores import action_names, action_scores, data_moves, source_pairs

log = logging.getLogger("mcar.train.idm_training")


def evaluate_idm(model: InverseDynamics, pairs, names: dict[int, str], moves=()) -> dict:
    """action_scores on the pairs + majority_baseline and moves_accuracy (pairs whose true action is a movement:
    the fraction predicted right; None when the data has no movement actions, `moves`, or none in these pairs)."""
    was_training = model.training
    model.eval()
    a, b, act = pairs
    pred = model.predict(a, b)
    scores = action_scores(pred, act, names)
    majority = act.mode(0).values  # (n_a,) the most common action per slot: the trivial baseline
    scores["majority_baseline"] = float((act == majority).all(-1).float().mean())
    ids = torch.tensor([i for i, n in names.items() if n in moves])
    is_move = torch.isin(act, ids).flatten() if len(ids) else torch.zeros(act.numel(), dtype=torch.bool)
    scores["moves_accuracy"] = float((pred.flatten() == act.flatten())[is_move].float().mean()) if is_move.any() \
        else None
    model.train(was_training)
    return scores


def fit(model: InverseDynamics, train, val, names: dict[int, str], *, steps: int, batch_size: int, lr: float,
        weight_decay: float, seed: int = 0, eval_every: int = 250, moves=()) -> list[dict]:
    """AdamW on random batches of the train pairs (a, b, actions), linear warm-up (a 20th of the steps) then cosine
    to 0 (mcar.core.lr_schedule); the held-out pairs are scored every `eval_every` steps and at the end -> history
    [{step, loss, val_accuracy, ...}]."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    lr_at = functools.partial(warmup_cosine, warmup_steps=max(1, steps // 20), total=steps, min_lr_ratio=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    g = torch.Generator().manual_seed(seed)
    history = []
    model.train()
    for step in (bar := tqdm(range(steps), desc="idm", mininterval=5)):
        idx = torch.randint(0, len(train[0]), (batch_size,), generator=g)
        logits = model(train[0][idx], train[1][idx])  # (B, n_a, V)
        loss = F.cross_entropy(logits.flatten(0, 1), train[2][idx].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            s = evaluate_idm(model, val, names, moves)
            history.append({"step": step + 1, "loss": loss.item(), "val_accuracy": s["accuracy"],
                            "val_macro_f1": s["macro_f1"], "val_moves": s["moves_accuracy"]})
            bar.set_postfix(loss=f"{loss.item():.3f}", val_acc=f"{s['accuracy']:.3f}")
    model.eval()
    return history


def idm_codebook(datamodule, codebook_size: int, code_dim: int) -> tuple[torch.Tensor, str | None]:
    """The code vectors of the VQ that made the data's tokens (the data module's `resolved_vq_path()`, e.g. Crafter's),
    and its vq_id; data without a VQ (synthetic): a fixed random codebook of `code_dim` and None."""
    if not hasattr(datamodule, "resolved_vq_path"):
        return random_codebook(codebook_size, code_dim), None
    from mcar.tokenizer.vq_model import load_vq, vq_id

    path = datamodule.resolved_vq_path()
    return vq_codebook(load_vq(path)), vq_id(path)


def train_idm(cfg: DictConfig) -> dict:
    torch.manual_seed(cfg.seed)
    set_threads(cfg.threads)
    with open_dict(cfg):  # every consecutive pair is a 2-frame clip (synthetic clips have no stride: independent)
        cfg.data.clip_frames = 2
        if "clip_stride" in cfg.data:
            cfg.data.clip_stride = 1
    complete_data_config(cfg)  # data=recordings: its grid and actions, read from its folder
    dm = build_datamodule(cfg.data)
    dm.prepare_data()
    dm.setup("fit")
    lay, cb, V = dm.layout, cfg.data.codebook_size, cfg.data.action_vocab_size
    train, val = source_pairs(dm.train_source, lay, cb), source_pairs(dm.val_source, lay, cb)
    names, moves = action_names(cfg.data, V), data_moves(cfg.data)
    log.info("IDM data: %d train pairs, %d held-out pairs (%s)", len(train[0]), len(val[0]), cfg.data.name)

    codebook, vq = idm_codebook(dm, cb, cfg.dim)
    model = InverseDynamics(cb, lay.n_a, V, hidden=cfg.hidden, max_shift=tuple(cfg.max_shift), grid=tuple(cfg.grid),
                            dropout=cfg.dropout, temperature=cfg.temperature, codebook=codebook)
    t0 = time.time()
    history = fit(model, train, val, names, steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                  weight_decay=cfg.weight_decay, seed=cfg.seed, eval_every=cfg.eval_every, moves=moves)
    seconds = time.time() - t0
    final = evaluate_idm(model, val, names, moves)
    final_train = evaluate_idm(model, tuple(x[:len(val[0]) * 4] for x in train), names, moves)
    meta = {"data": cfg.data.name, "tokens": tokens_name(dm), "vq": vq, "input": "vq code vectors",
            "steps": cfg.steps, "train_pairs": len(train[0]), "val_pairs": len(val[0]),
            "val_accuracy": final["accuracy"], "val_macro_f1": final["macro_f1"],
            "val_moves_accuracy": final["moves_accuracy"], "majority_baseline": final["majority_baseline"],
            "train_accuracy": final_train["accuracy"], "seconds": seconds}
    out = Path(cfg.out)
    save_idm(model, out, meta)
    report = {**meta, "per_action": final["per_action"], "history": history}
    write_json(out.parent / "metrics.json", report, indent=2)
    log.info("IDM held-out accuracy %.3f, movement actions %s (majority baseline %.3f, macro F1 %.3f) -> %s",
             final["accuracy"], final["moves_accuracy"], final["majority_baseline"], final["macro_f1"], out)
    return report
