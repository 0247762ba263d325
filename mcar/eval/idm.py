"""Inverse-dynamics model (IDM): two consecutive frames' VQ tokens -> the action taken between them.

MineWorld scores action following with VPT's IDM; we train our own on the same dataset as the world model, on
VQ tokens (so generated clips are scored without decoding), and report its held-out accuracy so the score can
be trusted. Train it:

    python -m mcar.idm data=crafter                 # -> checkpoints/idm-crafter/idm.pt + metrics.json
    python -m mcar.idm data=crafter steps=3000 threads=2

Frame t's action a[t] is taken after seeing frame t and leads to frame t+1 (the layout of DIAGD.md), so the
IDM reads (frame t, frame t+1) and predicts the n_a action tokens a[t] (local ids, before the codebook offset).
The action-following score (`action_scores`) is per-action precision / recall / F1 of its predictions on
generated frame pairs against the conditioning actions, as MineWorld reports.
"""
from __future__ import annotations

import json
import math
import logging
import time
from pathlib import Path

import hydra
import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from omegaconf import DictConfig, open_dict
from tqdm import tqdm

import mcar.config  # noqa: F401  (registers resolvers)
from mcar.core.layout import Layout
from mcar.eval.metrics import Unavailable
from mcar.tokenizer.clips import split_clip

log = logging.getLogger("mcar.eval.idm")


class InverseDynamics(nn.Module):
    """Embed both frames' tokens, a small CNN over [e_t, e_t+1, e_t+1 - e_t], pool, one linear head per slot."""

    def __init__(self, codebook_size: int, n_a: int, action_vocab_size: int, dim: int = 32, hidden: int = 128):
        super().__init__()
        self.config = dict(codebook_size=codebook_size, n_a=n_a, action_vocab_size=action_vocab_size, dim=dim,
                           hidden=hidden)
        self.n_a, self.action_vocab_size = n_a, action_vocab_size
        self.embed = nn.Embedding(codebook_size, dim)
        self.cnn = nn.Sequential(
            nn.Conv2d(3 * dim, hidden, 3, padding=1), nn.GELU(),
            nn.Conv2d(hidden, hidden, 3, padding=1), nn.GELU(),
            nn.Conv2d(hidden, hidden, 3, stride=2, padding=1), nn.GELU(),
        )
        self.head = nn.Linear(2 * hidden, n_a * action_vocab_size)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a, b (B, h, w) token ids of frames t and t+1 -> logits (B, n_a, action_vocab_size)."""
        ea, eb = self.embed(a), self.embed(b)  # (B, h, w, dim)
        x = rearrange(torch.cat([ea, eb, eb - ea], -1), "b h w c -> b c h w")  # c = 3 * dim
        x = self.cnn(x)  # (B, hidden, h/2, w/2)
        x = torch.cat([x.mean((2, 3)), x.amax((2, 3))], 1)  # (B, 2*hidden)
        return rearrange(self.head(x), "b (slot v) -> b slot v", slot=self.n_a)

    @torch.no_grad()
    def predict(self, a: torch.Tensor, b: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        """-> (B, n_a) predicted local action ids."""
        return torch.cat([self(x, y).argmax(-1) for x, y in zip(a.split(batch_size), b.split(batch_size))])


# ------------------------------------------------------------------------------------------------ frame pairs
def frame_pairs(clips: torch.Tensor, layout: Layout, codebook_size: int, first: int = 0):
    """Clips (B, N) in the layout -> (frames t, frames t+1, actions a[t]) for t = first .. T-2, flattened.

    Returns a, b (M, h, w) token ids and actions (M, n_a) local ids, M = B * (T - 1 - first); pairs are ordered
    clip-major (all pairs of clip 0, then clip 1, ...).
    """
    img, act = split_clip(clips, layout, codebook_size)  # (B, T, h, w), (B, T, n_a)
    T = img.shape[1]
    a, b = img[:, first:T - 1], img[:, first + 1:]
    return a.flatten(0, 1), b.flatten(0, 1), act[:, first:T - 1].flatten(0, 1)


def source_pairs(source, layout: Layout, codebook_size: int):
    """All consecutive pairs of a clip source of 2-frame clips -> (a, b, actions)."""
    clips = torch.stack([source.clip(i) for i in range(len(source))])
    return frame_pairs(clips, layout, codebook_size)


# ------------------------------------------------------------------------------------------------ scores
def action_scores(pred: torch.Tensor, target: torch.Tensor, names: dict[int, str] | None = None) -> dict:
    """Per-action precision / recall / F1 of predicted vs true action ids (any shape, compared elementwise).

    Returns accuracy (all slots of a pair right), token accuracy, macro F1 over actions present in the targets,
    and `per_action` {name: {precision, recall, f1, support}}.
    """
    pred2, tgt2 = pred.reshape(len(pred), -1), target.reshape(len(target), -1)
    p, t = pred2.flatten(), tgt2.flatten()
    per, f1s = {}, []
    for a in sorted(set(t.tolist()) | set(p.tolist())):
        tp = int(((p == a) & (t == a)).sum())
        n_pred, support = int((p == a).sum()), int((t == a).sum())
        prec = tp / n_pred if n_pred else 0.0
        rec = tp / support if support else 0.0
        f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
        per[(names or {}).get(a, str(a))] = dict(precision=prec, recall=rec, f1=f1, support=support)
        if support:
            f1s.append(f1)
    return dict(accuracy=float((pred2 == tgt2).all(1).float().mean()), token_accuracy=float((p == t).float().mean()),
                macro_f1=sum(f1s) / max(len(f1s), 1), n=len(pred2), per_action=per)


def action_names(data_name: str, action_vocab_size: int) -> dict[int, str]:
    """Readable names of local action ids where we know the action space (Crafter), else the ids."""
    if data_name == "crafter":
        from mcar.tokenizer.actions import CRAFTER_ACTIONS

        return dict(enumerate(CRAFTER_ACTIONS))
    return {i: str(i) for i in range(action_vocab_size)}


# ------------------------------------------------------------------------------------------------ save / load
def tokens_name(datamodule) -> str | None:
    """The token folder a data module reads (it names the VQ): an IDM only fits tokens of the VQ it saw."""
    try:
        return Path(datamodule.tokens_dir).name
    except (AttributeError, NotImplementedError):
        return None


def check_idm_fits(idm, datamodule, codebook_size: int, n_a: int, action_vocab_size: int):
    """The IDM, or Unavailable when it was trained on other tokens or another layout than the data's."""
    if isinstance(idm, Unavailable):
        return idm
    c, want = idm.config, tokens_name(datamodule)
    if (c["codebook_size"], c["n_a"], c["action_vocab_size"]) != (codebook_size, n_a, action_vocab_size):
        return Unavailable(f"the IDM was trained for codebook {c['codebook_size']}, n_a {c['n_a']}, "
                           f"{c['action_vocab_size']} actions, not this data's: retrain it (python -m mcar.idm)")
    have = idm.meta.get("tokens")
    if have and want and have != want:
        return Unavailable(f"the IDM was trained on {have}, the data is {want} (another VQ): retrain it "
                           f"(python -m mcar.idm)")
    return idm


def save_idm(model: InverseDynamics, path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"config": model.config, "state_dict": model.state_dict(), "meta": meta}, tmp)
    tmp.replace(path)


def load_idm(path: str | None, config_key: str = "idm") -> InverseDynamics | Unavailable:
    """The IDM saved by `python -m mcar.idm`, or Unavailable naming the path to train it to."""
    if not path:
        return Unavailable(f"no inverse-dynamics model: set {config_key}=/path/idm.pt (python -m mcar.idm)")
    if not Path(path).is_file():
        return Unavailable(f"inverse-dynamics model not found: {config_key}={path} (train it: python -m mcar.idm)")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    model = InverseDynamics(**ckpt["config"])
    model.load_state_dict(ckpt["state_dict"])
    model.meta = ckpt.get("meta", {})
    return model.eval()


# ------------------------------------------------------------------------------------------------ training
def evaluate_idm(model: InverseDynamics, pairs, names: dict[int, str]) -> dict:
    model.eval()
    a, b, act = pairs
    scores = action_scores(model.predict(a, b), act, names)
    majority = act.mode(0).values  # (n_a,) the most common action per slot: the trivial baseline
    scores["majority_baseline"] = float((act == majority).all(-1).float().mean())
    model.train()
    return scores


def train_idm(cfg: DictConfig) -> dict:
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with open_dict(cfg):  # every consecutive pair is a 2-frame clip
        cfg.data.clip_frames, cfg.data.clip_stride = 2, 1
    dm = hydra.utils.instantiate(cfg.data, _recursive_=False)
    dm.prepare_data()
    dm.setup("fit")
    lay, cb, V = dm.layout, cfg.data.codebook_size, cfg.data.action_vocab_size
    train, val = source_pairs(dm.train_source, lay, cb), source_pairs(dm.val_source, lay, cb)
    names = action_names(cfg.data.name, V)
    log.info("IDM data: %d train pairs, %d held-out pairs (%s)", len(train[0]), len(val[0]), cfg.data.name)

    model = InverseDynamics(cb, lay.n_a, V, cfg.dim, cfg.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = max(1, cfg.steps // 20)  # linear warm-up, then cosine to 0
    lr_at = lambda s: min(1, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    g = torch.Generator().manual_seed(cfg.seed)
    t0, history = time.time(), []
    for step in (bar := tqdm(range(cfg.steps), desc="idm", mininterval=5)):
        idx = torch.randint(0, len(train[0]), (cfg.batch_size,), generator=g)
        logits = model(train[0][idx], train[1][idx])  # (B, n_a, V)
        loss = F.cross_entropy(logits.flatten(0, 1), train[2][idx].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            s = evaluate_idm(model, val, names)
            history.append({"step": step + 1, "loss": loss.item(), "val_accuracy": s["accuracy"],
                            "val_macro_f1": s["macro_f1"]})
            bar.set_postfix(loss=f"{loss.item():.3f}", val_acc=f"{s['accuracy']:.3f}")
    final = evaluate_idm(model, val, names)
    final_train = evaluate_idm(model, tuple(x[:len(val[0]) * 4] for x in train), names)
    meta = {"data": cfg.data.name, "tokens": tokens_name(dm), "steps": cfg.steps, "train_pairs": len(train[0]),
            "val_pairs": len(val[0]),
            "val_accuracy": final["accuracy"], "val_macro_f1": final["macro_f1"],
            "majority_baseline": final["majority_baseline"], "train_accuracy": final_train["accuracy"],
            "seconds": time.time() - t0}
    out = Path(cfg.out)
    save_idm(model, out, meta)
    report = {**meta, "per_action": final["per_action"], "history": history}
    (out.parent / "metrics.json").write_text(json.dumps(report, indent=2))
    log.info("IDM held-out accuracy %.3f (majority baseline %.3f, macro F1 %.3f) -> %s", final["accuracy"],
             final["majority_baseline"], final["macro_f1"], out)
    return report


@hydra.main(version_base="1.3", config_path="../../conf", config_name="idm")
def main(cfg: DictConfig) -> None:
    train_idm(cfg)


if __name__ == "__main__":
    main()
