"""Inverse-dynamics model (IDM): two consecutive frames' VQ tokens -> the action taken between them.

MineWorld scores action following with VPT's IDM; we train our own on the same dataset as the world model, on
VQ tokens read as the VQ's frozen code vectors (so generated clips are scored without decoding, and two codes
for one texture look alike), and report its held-out accuracy so the score can be trusted. Train it:

    mcar idm data=crafter                 # -> checkpoints/idm-crafter/idm.pt + metrics.json
    mcar idm data=crafter steps=1000 hidden=32   # + a CNN

Frame t's action a[t] is taken after seeing frame t and leads to frame t+1 (the layout of docs/diagd.md), so the
IDM reads (frame t, frame t+1) and predicts the n_a action tokens a[t] (local ids, before the codebook offset).
The action-following score (`action_scores`) is per-action precision / recall / F1 of its predictions on
generated frame pairs against the conditioning actions, as MineWorld reports.
"""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from omegaconf import DictConfig, open_dict
from tqdm import tqdm

from mcar.checkpoint.io import load_weights_only
from mcar.core.devices import set_threads
from mcar.core.layout import Layout
from mcar.core.lr_schedule import warmup_cosine
from mcar.data.common import build_datamodule
from mcar.data.files import write_json
from mcar.eval.metrics import Unavailable
from mcar.tokenizer.actions import action_space
from mcar.tokenizer.clips import split_clip

log = logging.getLogger("mcar.eval.idm")


def random_codebook(codebook_size: int, code_dim: int, seed: int = 0) -> torch.Tensor:
    """A fixed seeded unit-norm codebook (K, D): the code vectors of data that has no VQ (synthetic data, tests)."""
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(codebook_size, code_dim, generator=g), dim=-1)


def vq_codebook(vq, max_dim: int = 32) -> torch.Tensor:
    """A VQ's code vectors (K, D), l2-normalised (the committed VQs' lookup is on the unit sphere). Wider codes (a
    patch VQ's are 768 raw pixels) are centred and cut to their `max_dim` principal components first: the
    correlation volume holds D x 63 numbers per position, 4 GB a batch at D = 768."""
    codes = vq.quantize.embedding.weight.detach().float().cpu()
    if codes.shape[1] > max_dim:
        centred = codes - codes.mean(0)
        codes = centred @ torch.linalg.svd(centred, full_matrices=False).Vh[:max_dim].t()
    return F.normalize(codes, dim=-1)


class InverseDynamics(nn.Module):
    """Frozen VQ code vectors of both frames -> [e_t, e_t+1, e_t+1 - e_t, local correlation volume] -> CNN -> heads.

    The token ids are looked up in the VQ's codebook (a frozen buffer `codebook` (K, D), saved with the IDM, so
    evaluation sees the same vectors): synonyms (two codes for one texture) get near vectors, and nothing per id is
    learned, which overfit on the ~1k pairs of a small dataset. The correlation volume holds, for every shift
    (dy, dx) within +-max_shift tokens, the cosine of e_t+1(y, x) with e_t(y + dy, x + dx), and its softmax over
    the shifts (`temperature`): each position's vote for where its content came from. A whole-view shift (Crafter
    moves the view one tile, 1.5 x 2.6 tokens) lights up one shift wherever the view is not uniform. The head
    reads the CNN's mean and max over the grid, a coarse pooled grid (where things changed: the player is in the
    centre) and the correlation and votes pooled by a learned attention over positions (content and coordinates:
    it learns to skip Crafter's inventory rows, whose changes are not motion), standardised.
    """

    def __init__(self, codebook_size: int, n_a: int, action_vocab_size: int, dim: int = 8, hidden: int = 64,
                 max_shift: tuple = (3, 4), grid: tuple = (3, 3), dropout: float = 0.1, temperature: float = 20.0,
                 codebook: torch.Tensor | None = None):
        super().__init__()
        cbk = random_codebook(codebook_size, dim) if codebook is None else codebook.detach().float().cpu()
        if cbk.shape[0] != codebook_size:
            raise ValueError(f"the codebook has {cbk.shape[0]} codes, not codebook_size={codebook_size}")
        dim = cbk.shape[1]  # the code width (the VQ's vq_embed_dim)
        self.config = dict(codebook_size=codebook_size, n_a=n_a, action_vocab_size=action_vocab_size, dim=dim,
                           hidden=hidden, max_shift=tuple(max_shift), grid=tuple(grid), dropout=dropout,
                           temperature=temperature)
        self.n_a, self.action_vocab_size = n_a, action_vocab_size
        self.max_shift, self.grid, self.temperature = tuple(max_shift), tuple(grid), temperature
        self.register_buffer("codebook", cbk)  # frozen: not a parameter, saved in the state dict
        n_shift = (2 * self.max_shift[0] + 1) * (2 * self.max_shift[1] + 1)
        self.cnn = nn.Identity() if not hidden else nn.Sequential(
            nn.Conv2d(3 * dim + 2 * n_shift, hidden, 1), nn.GELU(),
            nn.Conv2d(hidden, hidden, 3, padding=1), nn.GELU(),
            nn.Conv2d(hidden, hidden, 3, stride=2, padding=1), nn.GELU(),
        )
        self.drop = nn.Dropout(dropout)
        self.attend = nn.Conv2d(3 * dim + 2 * n_shift + 2, 1, 1)  # where to pool the votes (content + position)
        nn.init.zeros_(self.attend.weight), nn.init.zeros_(self.attend.bias)  # starts as the plain mean
        self.norm = nn.BatchNorm1d(2 * n_shift)  # the pooled correlation and votes, standardised
        self.head = nn.Linear(hidden * (2 + grid[0] * grid[1]) + 2 * n_shift, n_a * action_vocab_size)  # hidden 0:
        # no CNN, the head reads the pooled votes only

    def correlation(self, ea: torch.Tensor, eb: torch.Tensor) -> torch.Tensor:
        """(B, D, h, w) x 2 -> (B, n_shift, h, w): eb(y, x) . ea(y + dy, x + dx), zero outside the frame."""
        (sy, sx), (B, D, h, w) = self.max_shift, ea.shape
        win = F.unfold(ea, (2 * sy + 1, 2 * sx + 1), padding=(sy, sx)).view(B, D, -1, h * w)  # (B, D, n_shift, hw)
        return torch.einsum("bdsn,bdn->bsn", win, eb.flatten(2)).view(B, -1, h, w)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a, b (B, h, w) token ids of frames t and t+1 -> logits (B, n_a, action_vocab_size)."""
        ea = rearrange(self.codebook[a], "b h w d -> b d h w")
        eb = rearrange(self.codebook[b], "b h w d -> b d h w")
        corr = self.correlation(ea, eb)
        votes = torch.softmax(self.temperature * corr, 1)  # where each position's content came from
        feats = torch.cat([ea, eb, eb - ea, corr, votes], 1)
        B, _, h, w = feats.shape
        yx = torch.stack(torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij"))
        att = torch.softmax(self.attend(torch.cat([feats, yx.expand(B, 2, h, w)], 1)).flatten(1), 1)  # (B, hw)
        pooled = self.norm(torch.einsum("bcn,bn->bc", torch.cat([corr, votes], 1).flatten(2), att))
        if self.config["hidden"]:
            x = self.cnn(feats)  # (B, hidden, h/2, w/2)
            pooled = torch.cat([x.mean((2, 3)), x.amax((2, 3)), F.adaptive_avg_pool2d(x, self.grid).flatten(1),
                                pooled], 1)
        x = pooled
        return rearrange(self.head(self.drop(x)), "b (slot v) -> b slot v", slot=self.n_a)

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


def pr_keys(moves) -> list[str]:
    """The precision/recall columns of the data's movement actions: prec_move_left, rec_move_left, ..."""
    return [f"{k}_{name}" for name in moves for k in ("prec", "rec")]


def action_pr(pred: torch.Tensor, target: torch.Tensor, names: dict[int, str] | None, actions) -> dict:
    """{prec_<name>, rec_<name>} for each named action (elementwise over all slots): precision = right / predicted,
    recall = right / true; None when undefined (never predicted, never true, or a name the data does not have)."""
    p, t = pred.flatten(), target.flatten()
    ids = {n: i for i, n in (names or {}).items()}
    out = {}
    for name in actions:
        a = ids.get(name)
        n_pred = int((p == a).sum()) if a is not None else 0
        n_true = int((t == a).sum()) if a is not None else 0
        tp = int(((p == a) & (t == a)).sum()) if a is not None else 0
        out[f"prec_{name}"] = tp / n_pred if n_pred else None
        out[f"rec_{name}"] = tp / n_true if n_true else None
    return out


def data_moves(data) -> tuple[str, ...]:
    """The movement actions of the data config's action space (its own names: Crafter's move_left, ...), () for
    data whose space has none: the per-move precision/recall columns are the data's, never another game's."""
    from mcar.tokenizer.pictures import data_action_space

    space = data_action_space(data)
    return tuple(action_space(space).moves) if space else ()


def action_names(data, action_vocab_size: int) -> dict[int, str]:
    """Readable names of local action ids where the data config's action space names its actions, else the ids."""
    from mcar.tokenizer.pictures import data_action_space

    space = data_action_space(data)
    names = action_space(space).names if space else None
    return dict(enumerate(names)) if names else {i: str(i) for i in range(action_vocab_size)}


# ------------------------------------------------------------------------------------------------ save / load
def tokens_name(datamodule) -> str | None:
    """The token folder a data module reads (it names the VQ): an IDM only fits tokens of the VQ it saw."""
    if getattr(datamodule, "tokens_name", None):  # shipped held-out clips: the folder they were copied from
        return datamodule.tokens_name
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
                           f"{c['action_vocab_size']} actions, not this data's: retrain it (mcar idm)")
    have = idm.meta.get("tokens")
    if have and want and have != want:
        return Unavailable(f"the IDM was trained on {have}, the data is {want} (another VQ): retrain it "
                           f"(mcar idm)")
    return idm


def save_idm(model: InverseDynamics, path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"config": model.config, "state_dict": model.state_dict(), "meta": meta}, tmp)
    tmp.replace(path)


def resolve_idm(value: str | None, checkpoint_root: str | Path, data_name: str) -> str | None:
    """evaluate's idm= -> a path: auto is <checkpoint_root>/idm-<data>/idm.pt (what `mcar idm` writes), else the
    shipped <checkpoint_root>/shipped/idm-<data>/idm.pt when there is one; anything else as given."""
    if value != "auto":
        return value
    own = Path(checkpoint_root) / f"idm-{data_name}" / "idm.pt"
    shipped = Path(checkpoint_root) / "shipped" / f"idm-{data_name}" / "idm.pt"
    return str(shipped if not own.is_file() and shipped.is_file() else own)


def load_idm(path: str | None, config_key: str = "idm") -> InverseDynamics | Unavailable:
    """The IDM saved by `mcar idm`, or Unavailable naming the path to train it to."""
    if not path:
        return Unavailable(f"no inverse-dynamics model: set {config_key}=/path/idm.pt (mcar idm)")
    if not Path(path).is_file():
        return Unavailable(f"inverse-dynamics model not found: {config_key}={path} (train it: mcar idm)")
    ckpt = load_weights_only(path, "inverse-dynamics model")
    if "codebook" not in ckpt["state_dict"]:  # the token-id IDM (learned id embeddings) of before 2026-11-22
        return Unavailable(f"{config_key}={path} is an old token-id IDM (no VQ codebook in it): retrain it "
                           f"(mcar idm)")
    model = InverseDynamics(**ckpt["config"], codebook=ckpt["state_dict"]["codebook"])
    model.load_state_dict(ckpt["state_dict"])
    model.meta = ckpt.get("meta", {})
    return model.eval()


# ------------------------------------------------------------------------------------------------ training
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
