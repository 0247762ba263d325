"""Why memory fades with the wait: what the training clips teach, and what the model looks at when the view comes back.

    python scripts/memory_census.py data <finetune overrides>   # e.g. data=crafter_tiles_all_world 'data.recall={...}'
    python scripts/memory_census.py attention ckpt=<checkpoint> [waits=1,2,3,4] [starts=48] [seed_base=100000] \
        [policy=explorer]
    python scripts/memory_census.py errors ckpt=<checkpoint> [the same]

`data`: every training clip of the data config, the far-copy targets (mcar.core.masks.far_copy_slots: image tokens
that differ from the same place in each of the 2 frames before but equal it earlier in the clip, what
far_copy_weight weights), counted by how many frames back their nearest equal frame is. After n=1 out, w noops, 1
back, the tiles come back from w + 2 frames back: 3 frames back is a wait of 1, 6 frames back a wait of 4.

`attention`: fresh Crafter worlds (the world tests' scenes and seeds), the walk out, w noops and back for each w,
one causal pass of the real frames (teacher-forced, as the world tests' teacher-forced rows); for the queries that
predict the tiles a copy from the last two frames cannot give (the world tests' recall_far tiles), the attention each
layer puts on each frame of the clip (mean over heads, walks and those queries), and the teacher-forced recall of
those tiles. The start frame's share is what memory must read.

`errors`: the same walks and pass; of those tiles, how many the start frame shows as they are at the end (the
ceiling of a copy), the recall on the whole context and on 2 frames, the share of the gap between them the context
recovers, what the model drew where it missed (the 2-frame window's own guess; the tile the frame before showed at
that place), and the probability it gave the truth.
"""
from __future__ import annotations

import sys
from collections import Counter

import torch


def far_copy_by_distance(clip: torch.Tensor, layout, frames: int) -> tuple[Counter, Counter]:
    """(B, N) clips -> ({d: far-copy targets whose nearest equal frame is d frames back}, {d: clip frames with
    one})."""
    from mcar.core.masks import far_copy_slots

    far = far_copy_slots(clip, layout, frames).view(len(clip), frames, layout.frame_len)[..., :layout.frame_tokens]
    img = clip.view(len(clip), frames, layout.frame_len)[..., :layout.frame_tokens]
    targets, with_one = Counter(), Counter()
    for t in range(3, frames):
        nearer = torch.zeros_like(far[:, t])  # equal in a frame nearer than d (3 or more back)
        for d in range(3, t + 1):
            same = img[:, t] == img[:, t - d]
            hit = far[:, t] & same & ~nearer
            targets[d] += int(hit.sum())
            with_one[d] += int(hit.any(1).sum())
            nearer |= same
    return targets, with_one


def data_census(overrides: list[str]) -> None:
    import hydra

    from mcar.core.layout import Layout
    from mcar.hydra_app import compose_tool

    cfg = compose_tool("finetune", overrides)
    dm = hydra.utils.instantiate(cfg.data, _convert_="all")
    dm.prepare_data()
    dm.setup("fit")
    layout, frames = Layout(cfg.data.h, cfg.data.w, cfg.data.n_a), int(cfg.data.clip_frames)
    train = dm.train_source
    back, clips_with, images = Counter(), Counter(), 0
    for start in range(0, len(train), 256):
        clip = torch.stack([train.clip(i) for i in range(start, min(start + 256, len(train)))])
        targets, with_one = far_copy_by_distance(clip, layout, frames)
        back, clips_with = back + targets, clips_with + with_one
        images += len(clip) * frames * layout.frame_tokens
    total = sum(back.values())
    print(f"{len(train)} training clips of {frames} frames, {images} image tokens, {total} far-copy targets "
          f"({total / images:.2%})\n")
    print("| frames back (wait, n=1) | far-copy targets | share of them | clip frames with one |")
    print("|---|---|---|---|")
    for d in range(3, frames):
        print(f"| {d} (wait {d - 2}) | {back[d]} | {back[d] / max(total, 1):.1%} | {clips_with[d]} |")


class AttentionRecorder:
    """Replaces mcar.core.model's SDPA in an uncached causal pass: each layer's (B, H, S, S) probabilities kept."""

    def __init__(self):
        import mcar.core.model as model

        self.model, self.sdpa, self.probs = model, model.F.scaled_dot_product_attention, []

    def __enter__(self):
        def recording(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kw):
            keys = k.repeat_interleave(q.shape[1] // k.shape[1], 1) if enable_gqa else k
            scores = (q @ keys.transpose(-1, -2)) / q.shape[-1] ** 0.5
            S = q.shape[-2]
            scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
            self.probs.append(scores.softmax(-1))
            return self.sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kw)

        self.model.F.scaled_dot_product_attention = recording
        return self

    def __exit__(self, *exc):
        self.model.F.scaled_dot_product_attention = self.sdpa


def wait_walks(wm, w: int, args: dict):
    """The world tests' walk out, w noops and back from fresh worlds -> (shape, clips (B, N), far masks (B, h, w) over
    the whole view), or None when the walk is longer than the model's context."""
    from mcar.crafter.gen import map_rows
    from mcar.crafter.map_tokens import MapGrid, far_mask
    from mcar.crafter.scenes import parse_shape, record_start
    from mcar.eval.world_tests import Tokens
    from mcar.tokenizer.vq_model import frame_size

    layout = wm.layout
    view = tuple(int(v) for v in wm.cfg.data.view)
    grid, tokens = MapGrid(map_rows(view), layout.w), Tokens(wm.vq, layout, wm.codebook_size)
    size = frame_size(wm.vq, layout.h, layout.w)
    shape = parse_shape(f"wait_n1_w{w}")
    if shape.frames > wm.context:
        return None
    recs, seed = [], int(args.get("seed_base", 100000))
    while len(recs) < int(args.get("starts", 48)) and seed < int(args.get("seed_base", 100000)) + 400:
        start = record_start(seed, [], 0, 0.0, 24, size, view, wm.cfg.data.get("daylight"), shapes=[shape],
                             policy=args.get("policy", "explorer"))  # the world tests' walk, no loops
        seed += 1
        if start is not None and shape.name in start.shapes:
            recs.append(start.shapes[shape.name])
    clips = torch.stack([tokens.clip(r) for r in recs])
    masks = torch.stack([far_mask(grid, [(x - r.pos[0][0], y - r.pos[0][1]) for x, y in r.pos]) for r in recs])
    hidden = torch.zeros(len(recs), layout.h, layout.w, dtype=torch.bool)
    hidden[:, :grid.map_h] = masks
    return shape, clips, hidden.flatten(1)


def last_frame_logits(wm, clips: torch.Tensor, frames: int) -> torch.Tensor:
    """One causal pass over the clips' last `frames` frames -> the logits (B, ft, codes) of the last frame's image
    tokens, each from the real tokens before it."""
    fl, ft = wm.layout.frame_len, wm.layout.frame_tokens
    x = clips[:, clips.shape[1] - frames * fl:]
    with torch.no_grad():
        logits = wm.model(x, wm.layout.coords(frames))
    last = (frames - 1) * fl
    return logits[:, last - 1:last - 1 + ft, :wm.codebook_size]


def attention_census(args: dict) -> None:
    from mcar.sampling.world_model import WorldModel

    wm = WorldModel.load(args["ckpt"], device="cpu")
    fl, ft = wm.layout.frame_len, wm.layout.frame_tokens
    print(f"{args['ckpt']}: context {wm.context} frames; {args.get('policy', 'explorer')} plays between the walks\n")
    print("| wait | frames | walks | recall of the far tiles, teacher-forced | with 2 frames | attention on the start "
          "frame, per layer | on the frame before the last | on the last frame's own tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for w in [int(w) for w in str(args.get("waits", "1,2,3,4")).split(",")]:
        walks = wait_walks(wm, w, args)
        if walks is None:
            print(f"| {w} | {w + 3} | beyond the {wm.context}-frame context | | | | | |")
            continue
        shape, clips, hidden = walks
        T, last = shape.frames, (shape.frames - 1) * fl
        with AttentionRecorder() as rec:
            guess = last_frame_logits(wm, clips, T).argmax(-1)
        real = clips[:, last:last + ft]
        recall = ((guess == real) & hidden).sum() / hidden.sum()
        short = last_frame_logits(wm, clips, 2)  # the same guess from the last 2 frames alone: what no memory gives
        recall_2 = ((short.argmax(-1) == real) & hidden).sum() / hidden.sum()
        per_layer = []
        for probs in rec.probs:  # (B, H, S, S): the queries at last - 1 + i predict the last frame's token i
            q = probs[:, :, last - 1:last - 1 + ft].mean(1)  # (B, ft, S)
            by_frame = torch.stack([q[..., f * fl:(f + 1) * fl].sum(-1) for f in range(T)], -1)  # (B, ft, T)
            per_layer.append(by_frame[hidden].mean(0))  # (T,)

        def cell(f: int, per_layer=per_layer) -> str:
            return " / ".join(f"{p[f]:.2f}" for p in per_layer)

        print(f"| {w} | {T} | {len(clips)} | {recall:.3f} | {recall_2:.3f} | {cell(0)} | {cell(T - 2)} | "
              f"{cell(T - 1)} |")


def error_census(args: dict) -> None:
    """Where the model misses a far tile given the real frames: whether the start frame showed the truth, what
    the model drew instead (the 2-frame window's own guess, the tile the frame before showed there, another) and how
    much probability the truth got, on the whole context and on 2 frames."""
    from mcar.sampling.world_model import WorldModel

    wm = WorldModel.load(args["ckpt"], device="cpu")
    fl, ft = wm.layout.frame_len, wm.layout.frame_tokens
    print(f"{args['ckpt']}: context {wm.context} frames; {args.get('policy', 'explorer')} plays between the walks\n")
    print("| wait | far tiles | start frame = the truth | recall: context / 2 frames | headroom recovered | misses: "
          "the 2-frame guess / the frame before's tile / another | p(truth): context / 2 frames | p(truth) on misses |")
    print("|---|---|---|---|---|---|---|---|")
    for w in [int(w) for w in str(args.get("waits", "1,2,3,4")).split(",")]:
        walks = wait_walks(wm, w, args)
        if walks is None:
            print(f"| {w} | beyond the {wm.context}-frame context | | | | | | |")
            continue
        shape, clips, hidden = walks
        last = (shape.frames - 1) * fl
        real, start, before = (clips[:, i:i + ft] for i in (last, 0, last - fl))
        full, short = last_frame_logits(wm, clips, shape.frames), last_frame_logits(wm, clips, 2)
        guess, guess_2 = full.argmax(-1), short.argmax(-1)
        p_true, p_true_2 = (lg.softmax(-1).gather(-1, real[..., None])[..., 0] for lg in (full, short))
        n = int(hidden.sum())
        recall, recall_2 = (float(((g == real) & hidden).sum()) / n for g in (guess, guess_2))
        ceiling = float(((start == real) & hidden).sum()) / n
        miss = hidden & (guess != real)
        m = max(int(miss.sum()), 1)
        as_short, as_before = int((miss & (guess == guess_2)).sum()), int((miss & (guess == before)).sum())
        other = int((miss & (guess != guess_2) & (guess != before)).sum())
        print(f"| {w} | {n} | {ceiling:.3f} | {recall:.3f} / {recall_2:.3f} | "
              f"{(recall - recall_2) / max(ceiling - recall_2, 1e-9):.0%} | {as_short / m:.2f} / {as_before / m:.2f} / "
              f"{other / m:.2f} | {p_true[hidden].mean():.3f} / {p_true_2[hidden].mean():.3f} | "
              f"{p_true[miss].mean():.3f} |")


if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "data":
        data_census(rest)
    elif what == "attention":
        attention_census(dict(a.split("=", 1) for a in rest))
    elif what == "errors":
        error_census(dict(a.split("=", 1) for a in rest))
    else:
        raise SystemExit("usage: memory_census.py data <overrides> | attention|errors ckpt=<checkpoint> "
                         "[waits=1,2,3,4]")
