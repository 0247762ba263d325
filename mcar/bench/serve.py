"""The page measured end to end (`mcar bench serve ckpt=...`): `mcar play` started as its own process on
127.0.0.1, then for each N of bench.serve.players, N simulated players, each its own browser session through the
page's HTTP API (gradio_client), press a move at a human rate for bench.serve.seconds. Reported per N: what the
players saw (action-to-frame latency percentiles, deadline attainment, stalls, errors, each one's first frame) and
the server's memory before and after (docs/speed.md defines each figure)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from omegaconf import DictConfig

from mcar.core.latency import frames_per_second, latency_summary

MOVES = ["move_left", "move_up", "move_right", "move_down"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float | None:
    """A process's resident memory (MiB; Linux /proc), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None
    return round(kib / 1024, 1)


def start_server(cfg: DictConfig, port: int, log_path: Path) -> tuple[subprocess.Popen, float]:
    """`mcar play` on 127.0.0.1:port in its own process (its log in log_path) -> (the process, seconds from its
    start until the page answers). Refused in one line when it exits first or does not answer in time."""
    s = cfg.bench.serve
    # max_games: every round's players, as an earlier round's games may not have left yet
    cmd = [sys.executable, "-m", "mcar.cli", "play", f"ckpt={cfg.ckpt}", "host=127.0.0.1", f"port={port}",
           f"max_games={sum(int(n) for n in s.players)}", f"hydra.run.dir={log_path.parent / 'play'}",
           *[str(o) for o in s.play_overrides]]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    while time.perf_counter() - t0 < float(s.start_timeout_s):
        if server.poll() is not None:
            raise RuntimeError(f"bench.serve: mcar play exited ({server.returncode}) before serving; its log: "
                               f"{log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server, time.perf_counter() - t0
        except OSError:
            time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"bench.serve: mcar play did not answer on port {port} in bench.serve.start_timeout_s="
                       f"{s.start_timeout_s}; its log: {log_path}")


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def player(url: str, seconds: float, rate: float, index: int, stall_s: float, results: list, ready: threading.Barrier,
           timeout_s: float = 120.0) -> None:
    """One simulated player: its own session (a gradio_client Client), a move every 1/rate s (or as soon as the
    last frame came, when slower), for `seconds` -> appends {"first_s", "latencies", "errors", "stalls", "frames",
    "played_s"}."""
    from gradio_client import Client

    got = {"first_s": None, "latencies": [], "errors": [], "stalls": 0, "frames": 0, "played_s": 0.0}
    try:
        # httpx's 5 s default would fail a join or a first frame on a busy machine
        client = Client(url, verbose=False, httpx_kwargs={"timeout": timeout_s})
    except Exception as e:  # noqa: BLE001  a player that cannot connect is an error seen, not a crash
        got["errors"].append(f"connect: {type(e).__name__}: {e}")
        client = None
    ready.wait()
    start, i = time.perf_counter(), 0
    while client is not None and time.perf_counter() - start < seconds:
        time.sleep(max(0.0, start + i / rate - time.perf_counter()))
        t0 = time.perf_counter()
        try:
            client.predict(api_name=f"/step_{MOVES[(index + i) % len(MOVES)]}")
            took = time.perf_counter() - t0
            got["frames"] += 1
            if got["first_s"] is None:
                got["first_s"] = took  # the game is made on the first step: not a steady frame
            else:
                got["latencies"].append(took)
                got["stalls"] += took > stall_s
        except Exception as e:  # noqa: BLE001
            got["errors"].append(f"{type(e).__name__}: {str(e)[:200]}")
        i += 1
    got["played_s"] = time.perf_counter() - start
    if client is not None:
        client.close()
    results.append(got)


def players_round(url: str, n: int, cfg: DictConfig, server: subprocess.Popen) -> dict:
    """n players at once for bench.serve.seconds -> what they saw, and the server's memory after."""
    s = cfg.bench.serve
    rate, deadline = float(s.rate), cfg.bench.play.get("deadline_fps")
    results: list = []
    ready = threading.Barrier(n)
    threads = [threading.Thread(target=player, args=(url, float(s.seconds), rate, i, float(s.stall_s), results,
                                                     ready, float(s.request_timeout_s)), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(float(s.seconds) + 120)
    latencies = [x for r in results for x in r["latencies"]]
    errors = [e for r in results for e in r["errors"]]
    firsts = [r["first_s"] for r in results if r["first_s"] is not None]
    each = [frames_per_second(r["frames"], r["played_s"]) for r in results if r["played_s"] > 0]
    return {"players": n, "rate": rate, "seconds": float(s.seconds),
            **latency_summary(latencies, float(deadline) if deadline else None),
            "first_frame_max_s": round(max(firsts), 4) if firsts else None,
            "per_player_p95_max_s": max((latency_summary(r["latencies"])["p95_s"] for r in results
                                         if r["latencies"]), default=None),
            "stalls": sum(r["stalls"] for r in results), "stall_s": float(s.stall_s),
            "errors": len(errors), "first_error": errors[0] if errors else None,
            "frames_per_s_per_player": round(sum(each) / len(each), 2) if each else 0.0,
            "frames_per_s": round(sum(each), 2), "server_rss_mib": rss_mib(server.pid)}


def run_serve(cfg: DictConfig) -> dict:
    """mcar bench serve ckpt=...: the page on 127.0.0.1 under bench.serve.players simulated players, each count in
    turn on one server; the server is stopped at the end (or on any failure)."""
    if not cfg.get("ckpt"):
        raise ValueError("mcar bench serve: give ckpt=... (the checkpoint the page plays)")
    s = cfg.bench.serve
    if not s.players or any(int(n) < 1 for n in s.players) or float(s.rate) <= 0 or float(s.seconds) <= 0:
        raise ValueError(f"bench.serve: players={list(s.players or [])} (each >= 1), rate={s.rate} and "
                         f"seconds={s.seconds} (> 0)")
    try:
        import gradio_client  # noqa: F401
    except ImportError:
        raise RuntimeError("mcar bench serve needs gradio: pip install -e '.[play]'") from None
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request of every player otherwise
    port = free_port()
    log_path = Path(cfg.bench.out).parent / "serve" / "play.log"
    server, ready_s = start_server(cfg, port, log_path)
    try:
        out = {"ckpt": str(cfg.ckpt), "url": f"http://127.0.0.1:{port}", "page_ready_s": round(ready_s, 2),
               "server_rss_mib_before": rss_mib(server.pid), "rounds": {}}
        for n in s.players:
            out["rounds"][str(int(n))] = players_round(out["url"], int(n), cfg, server)
        out["server_rss_mib_after"] = rss_mib(server.pid)
        out["server_log"] = str(log_path)
        return out
    finally:
        stop_server(server)


def serve_table(out: dict) -> str:
    """`mcar bench serve`'s result as a table (the JSON holds the same)."""
    rows = [f"mcar bench serve {out['ckpt']}: {out['url']}, page ready {out['page_ready_s']:.1f} s after its process "
            f"started; server memory {out['server_rss_mib_before']} MiB before, {out['server_rss_mib_after']} MiB "
            f"after (terms: docs/speed.md)"]
    first = next(iter(out["rounds"].values()), None)
    deadline = f"<= {1000 / first['deadline_rate']:.0f} ms" if first and "deadline_rate" in first else "deadline"
    table = [["players", "moves/s each", "p50 ms", "p95 ms", "p99 ms", "frames/s each", "frames/s all", deadline,
              "stalls", "errors", "1st frame ms", "MiB"]]
    for n, r in out["rounds"].items():
        ms = ["-" if r[f"p{q}_s"] != r[f"p{q}_s"] else f"{1000 * r[f'p{q}_s']:.0f}" for q in (50, 95, 99)]
        within = "-" if r.get("deadline_attainment") is None else f"{100 * r['deadline_attainment']:.0f}%"
        table.append([n, f"{r['rate']:g}", *ms, f"{r['frames_per_s_per_player']:.1f}", f"{r['frames_per_s']:.1f}",
                      within, str(r["stalls"]), str(r["errors"]),
                      "-" if r["first_frame_max_s"] is None else f"{1000 * r['first_frame_max_s']:.0f}",
                      str(r["server_rss_mib"])])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    rows += ["", *("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table)]
    errors = [f"  {n} players: {r['first_error']}" for n, r in out["rounds"].items() if r["first_error"]]
    if errors:
        rows += ["", "first error seen:", *errors]
    return "\n".join(rows)
