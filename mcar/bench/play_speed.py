"""Play's speed and steadiness without the page (`mcar bench play ckpt=...`): what a player sees (cold start, the
first action's frame, action-to-frame latency percentiles and deadline attainment: docs/speed.md), the steps of one
game per k, many games stepping together, and rollouts of held-out clips scored against the real frames. Every
frame timed here is what the page sends: sampled, decoded by the VQ and encoded as the page's PNG."""
from __future__ import annotations

import io
import statistics
import time

import numpy as np
import torch
from omegaconf import DictConfig, open_dict

from mcar.core.agreement import frame_agreement, nothing_moves
from mcar.core.latency import frames_per_second, latency_summary, seconds_since_process_start
from mcar.sampling.held_out import held_out_data, pick_clips
from mcar.sampling.play_server import PlaySession, open_game


def encode_png(frame: np.ndarray) -> bytes:
    """The page's image encoding of a frame (gradio's Image with format="png" saves it with PIL as PNG)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="png")
    return buffer.getvalue()


def timed_step(session: PlaySession, action) -> float:
    """One action to its frame as the page sends it (sampling, VQ decode, PNG encode) -> seconds."""
    t0 = time.perf_counter()
    frame, _ = session.step(action)
    encode_png(frame)
    return time.perf_counter() - t0


def timed_tick(session: PlaySession, games: list[PlaySession], actions: list) -> list[float]:
    """One tick of `games` stepping together, each frame then encoded in turn (one server) -> each game's seconds
    from the tick's start to its encoded frame."""
    t0 = time.perf_counter()
    frames = session.server.step_together(list(zip(games, actions)))
    out = []
    for frame, _ in frames:
        encode_png(frame)
        out.append(time.perf_counter() - t0)
    return out


def player_view(session: PlaySession, actions, steps: int, rate: float) -> dict:
    """One player, as docs/speed.md defines it: `first_action_s`, a fresh game's first action to its frame
    (nothing warmed: samplers built, compiled when sampler.compile=true); then, after the warm-up, `steps` actions
    one after another -> their latency percentiles, deadline attainment at `rate` and frames/s."""
    actions = list(actions) if session.actions else [[0] * session.layout.n_a]
    game = session.fork()
    first = timed_step(game, actions[0])
    first_frame_at = time.perf_counter()
    game.warm_up(actions[0])
    latencies = [timed_step(game, actions[i % len(actions)]) for i in range(steps)]
    session.server.leave(game)
    return {"first_action_s": round(first, 4), "first_frame_at": first_frame_at, "k": session.k,
            **latency_summary(latencies, rate),
            "frames_per_s": round(frames_per_second(len(latencies), sum(latencies)), 2)}


def bench_session(session: PlaySession, ks, actions, steps: int, repeats: int, rate: float | None = None) -> dict:
    """The page's speed without the page: for each k, `repeats` rounds of `steps` steps (the actions in turn), each
    round from a reset after an untimed warm-up, each step timed to its encoded frame -> {"ks": {k: {"frames_per_s":
    median of the rounds' steps / seconds, "rounds": [...], "passes": per frame, "latency": every step's
    latency_summary (deadline at `rate`)}}, "context", "threads", "steps"}. Rounds replay the same frames."""
    _check(steps, repeats)
    actions = list(actions) if session.actions else [[0] * session.layout.n_a]  # no action names: local id 0
    out, start_k = {}, session.k
    for k in ks:
        session.set_k(k)
        rounds, latencies = [], []
        for _ in range(repeats):
            session.warm_up(actions[0])  # untimed, ends with a reset
            took = [timed_step(session, actions[i % len(actions)]) for i in range(steps)]
            latencies += took
            rounds.append(round(frames_per_second(steps, sum(took)), 2))
        out[str(k)] = {"frames_per_s": statistics.median(rounds), "rounds": rounds,
                       "passes": session.info["passes"], "latency": latency_summary(latencies, rate)}
    session.set_k(start_k)  # what is measured next runs at the page's k again
    return {"ks": out, "context": session.context, "threads": torch.get_num_threads(), "steps": steps}


def bench_sessions(session: PlaySession, counts, actions, steps: int, repeats: int, rate: float | None = None
                   ) -> dict:
    """Many players: for each n of `counts`, n games (forks of `session`, seeds seed + i) step together `steps`
    ticks, `repeats` rounds from a reset after one untimed tick, each frame timed to its PNG (timed_tick) ->
    {"sessions": {n: {"per_session_frames_per_s": each game's frames/s (median round), "frames_per_s": all games'
    together, "rounds": [...], "latency": every frame's latency_summary (deadline at `rate`)}}, "k", "context",
    "threads", "steps"}."""
    _check(steps, repeats)
    if not counts or any(int(n) < 1 for n in counts):
        raise ValueError(f"bench.play.sessions={list(counts)}: each count of games must be >= 1")
    actions = list(actions) if session.actions else [[0] * session.layout.n_a]
    out = {}
    for n in counts:
        games = [session.fork(seed=session.seed + i) for i in range(int(n))]
        rounds, latencies = [], []
        for _ in range(repeats):
            for g in games:
                g.reset()
            session.server.step_together([(g, actions[0]) for g in games])  # untimed: builds the batch's rollout
            t0 = time.perf_counter()
            for i in range(steps):
                latencies += timed_tick(session, games, [actions[(i + j) % len(actions)] for j in range(len(games))])
            rounds.append(round(frames_per_second(steps, time.perf_counter() - t0), 3))
        for g in games:
            session.server.leave(g)
        per = statistics.median(rounds)
        out[str(n)] = {"per_session_frames_per_s": per, "frames_per_s": round(per * int(n), 2), "rounds": rounds,
                       "latency": latency_summary(latencies, rate)}
    return {"sessions": out, "k": session.k, "context": session.context, "threads": torch.get_num_threads(),
            "steps": steps}


def _check(steps: int, repeats: int) -> None:
    if steps < 1 or repeats < 1:
        raise ValueError(f"bench.play steps={steps} and bench.repeats={repeats} must be >= 1")


def rollout_agreement(session: PlaySession, clips: list[torch.Tensor]) -> dict:
    """How well play holds together at the session's settings: each clip (F frames of a held-out episode) starts
    a game at its first frame and takes the episode's own next F - 1 actions; each generated frame is compared
    with the real one. -> {"agreement": per step, the mean share of image tokens equal to the real frame's;
    "copy_first": the same for the unchanged start frame (nothing moves: the floor a model must beat);
    "final", "mean": of agreement; "clips"}."""
    lay, cb = session.layout, session.server.cb
    played = []
    for clip in clips:
        frames = clip.reshape(-1, lay.frame_len)
        game = session.fork(start=frames[:1])
        made = frames.clone()
        for t in range(1, len(frames)):
            ids = (frames[t - 1, lay.frame_tokens:] - cb).tolist()  # the real action, as local ids
            game.step(ids if len(ids) > 1 else ids[0])
            made[t, :lay.frame_tokens] = game.history[-1, :lay.frame_tokens]
        session.server.leave(game)
        played.append(made.reshape(-1))
    real, made = torch.stack(clips), torch.stack(played)
    per_step = frame_agreement(made, real, lay)[:, 1:].mean(0)
    still = frame_agreement(nothing_moves(real, lay, 1), real, lay)[:, 1:].mean(0)
    return {"agreement": [round(float(x), 4) for x in per_step], "copy_first": [round(float(x), 4) for x in still],
            "final": round(float(per_step[-1]), 4), "mean": round(float(per_step.mean()), 4), "clips": len(clips)}


def run_play(cfg: DictConfig) -> dict:
    """mcar bench play ckpt=...: the game's step per k (bench.play.steps), n games stepping together
    (bench.play.sessions) and held-out rollouts scored against the real frames (bench.play.rollouts), each when
    asked for, on the checkpoint, at the page's start temperature (bench.play.temperature)."""
    b = cfg.bench.play
    play_cfg = cfg.copy()
    with open_dict(play_cfg):
        play_cfg.device, play_cfg.dtype = cfg.bench.device, cfg.bench.dtype
        play_cfg.threads = 1 if cfg.bench.threads is None else cfg.bench.threads  # play's own default (play.yaml)
        play_cfg.sampler.temperature = float(b.temperature)
    t0 = time.perf_counter()
    session = open_game(play_cfg)
    load = time.perf_counter() - t0
    rate = float(b.deadline_fps) if b.get("deadline_fps") else None
    out = {"ckpt": str(cfg.ckpt), "sampler": cfg.sampler.name, "device": str(session.server.device),
           "temperature": session.temperature, "context": session.context, "threads": torch.get_num_threads(),
           "model_load_s": round(load, 3)}
    actions = list(b.actions)
    if b.get("player_steps"):  # first: the cold start is this process's first frame
        player = player_view(session, actions, int(b.player_steps), rate)
        age = seconds_since_process_start()
        first_at = player.pop("first_frame_at")
        # process start to the first frame, less the model's load (compile included: nothing was warmed before)
        cold = None if age is None else age - (time.perf_counter() - first_at) - load
        out["player"] = {"cold_start_s": None if cold is None else round(cold, 3), **player}
    if b.steps:
        out["steps"] = bench_session(session, list(b.ks), actions, int(b.steps), int(cfg.bench.repeats), rate)
    if b.sessions:
        counts = [int(b.sessions)] if isinstance(b.sessions, int) else [int(n) for n in b.sessions]
        out["sessions"] = bench_sessions(session, counts, actions, int(b.session_steps), int(cfg.bench.repeats),
                                         rate)
    if b.soak_ticks:
        out["soak"] = soak_games(session, int(b.soak_ticks), int(b.soak_players), int(cfg.seed))
    if b.rollouts:
        source = held_out_data(play_cfg, int(b.rollout_steps) + 1).val_source
        clips = [source.clip(i) for i in pick_clips(source, int(b.rollouts))]
        out["rollouts"] = {"k": session.k, "steps": int(b.rollout_steps), **rollout_agreement(session, clips)}
    return out


def soak_games(session: PlaySession, ticks: int, max_players: int, seed: int = 0) -> dict:
    """Players join, step, reset, change k and leave at random for `ticks` ticks on `session`'s server (the games
    stepping in a tick batched); then each game is played again alone, the same events in order, and every frame
    compared token for token. -> {"games", "frames", "mismatched" (frames that differ: 0), "ticks", "restarts",
    "splits", "seconds"}."""
    import random

    if ticks < 1 or max_players < 1:
        raise ValueError(f"soak: ticks={ticks} and max_players={max_players} must be >= 1")
    rng, server, t0 = random.Random(seed), session.server, time.perf_counter()
    actions = list(session.actions) or [[0] * session.layout.n_a]
    restarts, splits = server.restarts, server.splits
    live: dict[PlaySession, list] = {}  # game -> [(event, value, the frame it drew)]
    done: list[tuple[int, list]] = []  # (game seed, its events)
    for _ in range(ticks):
        if len(live) < max_players and rng.random() < 0.5:
            live[session.fork(seed=seed + len(live) + len(done) + 1)] = []
        moves = []
        for game, events in list(live.items()):
            r = rng.random()
            if r < 0.05:
                server.leave(game)
                done.append((game.seed, live.pop(game)))
            elif r < 0.12:
                game.reset()
                events.append(("reset", None, None))
            elif r < 0.15:
                events.append(("k", game.set_k(rng.choice([1, 2]))["k"], None))
            elif r < 0.75:
                moves.append((game, rng.choice(actions)))
        if moves:
            server.step_together(moves)
        for game, action in moves:
            live[game].append(("step", action, game.history[-1].clone()))
    for game, events in live.items():
        server.leave(game)
        done.append((game.seed, events))
    frames = mismatched = 0
    for game_seed, events in done:  # each game again, alone
        game = session.fork(seed=game_seed)
        for event, value, drawn in events:
            if event == "reset":
                game.reset()
            elif event == "k":
                game.set_k(value)
            else:
                game.step(value)
                frames += 1
                mismatched += not torch.equal(game.history[-1], drawn)
        server.leave(game)
    return {"games": len(done), "frames": frames, "mismatched": mismatched, "ticks": ticks,
            "restarts": server.restarts - restarts, "splits": server.splits - splits,
            "seconds": round(time.perf_counter() - t0, 1)}


def _ms(summary: dict) -> list[str]:
    return [f"{1000 * summary[f'p{q}_s']:.0f}" for q in (50, 95, 99)]


def _within(summary: dict) -> str:
    share = summary.get("deadline_attainment")
    return "-" if share is None else f"{100 * share:.0f}%"


def play_table(out: dict) -> str:
    """`mcar bench play`'s result as a table for the terminal (the JSON holds the same and more)."""
    rows = [f"mcar bench play {out['ckpt']}: {out['device']}, {out['threads']} thread(s), context {out['context']}, "
            f"temperature {out['temperature']:g} (terms: docs/speed.md)"]
    deadline = next((s["deadline_rate"] for s in _summaries(out) if "deadline_rate" in s), None)
    within = f"<= {1000 / deadline:.0f} ms" if deadline else "deadline"
    p = out.get("player")
    if p:
        cold = "-" if p["cold_start_s"] is None else f"{p['cold_start_s']:.2f} s"
        rows += [f"model load {out['model_load_s']:.2f} s; cold start {cold} (process start to the first frame, "
                 f"less the model load); first action to its frame {1000 * p['first_action_s']:.0f} ms"]
    table = [["", "p50 ms", "p95 ms", "p99 ms", "frames/s", "all frames/s", within]]
    if p:
        table.append([f"one player, k={p['k']}", *_ms(p), f"{p['frames_per_s']:.1f}", "", _within(p)])
    for k, row in out.get("steps", {}).get("ks", {}).items():
        table.append([f"one player, k={k}", *_ms(row["latency"]), f"{row['frames_per_s']:.1f}", "",
                      _within(row["latency"])])
    sessions = out.get("sessions", {})
    for n, row in sessions.get("sessions", {}).items():
        table.append([f"{n} player(s) at once, k={sessions['k']}", *_ms(row["latency"]),
                      f"{row['per_session_frames_per_s']:.1f}", f"{row['frames_per_s']:.1f}", _within(row["latency"])])
    if len(table) > 1:
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        rows += ["", *("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                       .rstrip() for r in table)]
    if "rollouts" in out:
        r = out["rollouts"]
        rows += ["", f"held-out rollouts ({r['clips']} clips, {r['steps']} steps, k={r['k']}): token agreement "
                     f"{r['final']:.3f} at the last step (nothing moves: {r['copy_first'][-1]:.3f}), mean "
                     f"{r['mean']:.3f}"]
    if "soak" in out:
        s = out["soak"]
        rows += ["", f"soak: {s['games']} games, {s['frames']} frames replayed alone, {s['mismatched']} mismatched"]
    return "\n".join(rows)


def _summaries(out: dict) -> list[dict]:
    found = [out["player"]] if "player" in out else []
    found += [row["latency"] for row in out.get("steps", {}).get("ks", {}).values()]
    return found + [row["latency"] for row in out.get("sessions", {}).get("sessions", {}).values()]
