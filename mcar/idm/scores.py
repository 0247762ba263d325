"""What the IDM reads and gives: consecutive frame pairs of clips with the action between them, and the
action-following scores of its predictions (per-action precision / recall / F1, macro F1, the data's moves)."""
from __future__ import annotations

import torch

from mcar.core.layout import Layout
from mcar.tokenizer.actions import action_space
from mcar.tokenizer.clips import split_clip


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


# ---- scores
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
