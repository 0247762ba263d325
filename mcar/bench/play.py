"""Play's speed and steadiness without the page (`mcar bench play ckpt=...`): the steps of one game per k, many
games stepping together, and rollouts of held-out clips scored against the real frames."""
from __future__ import annotations

import statistics
import time

import torch
from omegaconf import DictConfig, open_dict

from mcar.core.agreement import frame_agreement, nothing_moves
from mcar.sampling.held_out import held_out_data, pick_clips
from mcar.sampling.play import PlaySession, open_game


def bench_session(session: PlaySession, ks, actions, steps: int, repeats: int) -> dict:
    """The page's speed without the page: for each k, `repeats` rounds of `steps` steps (the actions in turn), each
    round from a reset after an untimed warm-up -> {"ks": {k: {"frames_per_s": median of the rounds' steps /
    seconds, "rounds": [...], "passes": per frame}}, "context", "threads", "steps"}. Rounds replay the same frames."""
    _check(steps, repeats)
    actions = list(actions) if session.actions else [[0] * session.layout.n_a]  # no action names: local id 0
    out = {}
    for k in ks:
        session.set_k(k)
        rounds = []
        for _ in range(repeats):
            session.warm_up(actions[0])  # untimed, ends with a reset
            t0 = time.perf_counter()
            for i in range(steps):
                _, info = session.step(actions[i % len(actions)])
            rounds.append(round(steps / (time.perf_counter() - t0), 2))
        out[str(k)] = {"frames_per_s": statistics.median(rounds), "rounds": rounds, "passes": info["passes"]}
    return {"ks": out, "context": session.context, "threads": torch.get_num_threads(), "steps": steps}


def bench_sessions(session: PlaySession, counts, actions, steps: int, repeats: int) -> dict:
    """Many players: for each n of `counts`, n games (forks of `session`, seeds seed + i) step together `steps`
    ticks, `repeats` rounds from a reset after one untimed tick -> {"sessions": {n: {"per_session_frames_per_s":
    each game's frames/s (median round), "frames_per_s": all games' together, "rounds": [...]}}, "k", "context",
    "threads", "steps"}."""
    _check(steps, repeats)
    if not counts or any(int(n) < 1 for n in counts):
        raise ValueError(f"bench.play.sessions={list(counts)}: each count of games must be >= 1")
    actions = list(actions) if session.actions else [[0] * session.layout.n_a]
    out = {}
    for n in counts:
        games = [session.fork(seed=session.seed + i) for i in range(int(n))]
        rounds = []
        for _ in range(repeats):
            for g in games:
                g.reset()
            session.server.step_together([(g, actions[0]) for g in games])  # untimed: builds the batch's rollout
            t0 = time.perf_counter()
            for i in range(steps):
                session.server.step_together([(g, actions[(i + j) % len(actions)]) for j, g in enumerate(games)])
            rounds.append(round(steps / (time.perf_counter() - t0), 3))
        for g in games:
            session.server.leave(g)
        per = statistics.median(rounds)
        out[str(n)] = {"per_session_frames_per_s": per, "frames_per_s": round(per * int(n), 2), "rounds": rounds}
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
    session = open_game(play_cfg)
    out = {"ckpt": str(cfg.ckpt), "sampler": cfg.sampler.name, "device": str(session.server.device),
           "temperature": session.temperature, "context": session.context, "threads": torch.get_num_threads()}
    actions = list(b.actions)
    if b.steps:
        out["steps"] = bench_session(session, list(b.ks), actions, int(b.steps), int(cfg.bench.repeats))
    if b.sessions:
        counts = [int(b.sessions)] if isinstance(b.sessions, int) else [int(n) for n in b.sessions]
        out["sessions"] = bench_sessions(session, counts, actions, int(b.session_steps), int(cfg.bench.repeats))
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
