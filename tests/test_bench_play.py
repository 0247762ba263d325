"""What a player sees, as `mcar bench play` reports it (docs/speed.md): the first action's frame, action-to-frame
latency percentiles with the page's PNG encoding inside, deadline attainment, many players at once, and the table
the terminal shows."""
import time

import numpy as np
import pytest

from tests.conftest import run_in_process
from tests.test_play import crafter_files, crafter_session  # noqa: F401  the tiny data=crafter model and start


def test_a_players_latency_includes_the_pages_png_and_follows_its_percentiles(crafter_files, monkeypatch):  # noqa: F811
    import mcar.bench.play_speed as bench

    session = crafter_session(crafter_files)
    encoded = []
    real = bench.encode_png

    def slow_png(frame):  # the page's encoding, made slow: every timed frame must carry it
        encoded.append(frame.shape)
        time.sleep(0.02)
        return real(frame)

    monkeypatch.setattr(bench, "encode_png", slow_png)
    out = bench.player_view(session, ["move_left", "noop"], steps=3, rate=1000.0)
    assert out["frames"] == 3 and len(encoded) == 4 and encoded[0] == (224, 384, 3)  # 3 timed + the first action
    assert 0.02 <= out["p50_s"] <= out["p95_s"] <= out["p99_s"] <= out["max_s"]
    assert out["first_action_s"] >= 0.02 and out["deadline_attainment"] == 0.0  # nothing within 1 ms
    assert out["frames_per_s"] < 50  # 20 ms of encoding a frame caps it
    together = bench.bench_sessions(session, [2], ["move_left"], steps=1, repeats=1, rate=1.0)["sessions"]["2"]
    lat = together["latency"]
    assert lat["frames"] == 2 and lat["max_s"] >= 0.04 and lat["p50_s"] >= 0.02  # the second waits for two PNGs
    assert lat["deadline_attainment"] == 1.0 and together["frames_per_s"] > 0


def test_bench_play_prints_a_table_and_keeps_the_json_in_its_file(crafter_files, tmp_path, capsys):  # noqa: F811
    import json

    from mcar.tools import bench

    out = tmp_path / "play.json"
    run_in_process(bench.main, "play", "data=crafter", f"ckpt={crafter_files}/tiny.ckpt",
                   f"prompt_image={crafter_files}/start.png", "bench.play.steps=1", "bench.repeats=1",
                   "bench.play.ks=[1]", "bench.play.player_steps=3", "bench.play.sessions=[1,2]",
                   "bench.play.session_steps=1", f"bench.out={out}", f"hydra.run.dir={tmp_path}/run")
    said = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert said.rstrip().endswith(f"JSON: {out}") and "{" not in said
    for row in ("one player, k=2", "one player, k=1", "1 player(s) at once, k=2", "2 player(s) at once, k=2"):
        assert row in said, said
    assert "p50 ms  p95 ms  p99 ms" in said and "<= 100 ms" in said and "cold start" in said
    player = result["player"]
    assert player["frames"] == 3 and player["deadline_rate"] == 10.0 and result["model_load_s"] > 0
    assert player["cold_start_s"] is None or player["cold_start_s"] > player["first_action_s"] > 0
    assert set(result["sessions"]["sessions"]) == {"1", "2"} and result["sessions"]["k"] == 2
    assert f"{1000 * player['p95_s']:.0f}" in said.split("one player, k=2")[1].splitlines()[0]
    assert np.isfinite(result["steps"]["ks"]["1"]["latency"]["p50_s"])


def test_a_simulated_players_requests_wait_the_configured_timeout(monkeypatch):
    """bench.serve.request_timeout_s reaches the player's HTTP client (httpx's own 5 s fails a loaded machine); a
    client that cannot connect is an error the round counts, not a crash."""
    import threading

    import gradio_client

    from mcar.bench.serve import player

    seen = {}

    def refusing_client(url, **kwargs):
        seen.update(kwargs)
        raise ConnectionError("refused")

    monkeypatch.setattr(gradio_client, "Client", refusing_client)
    results: list = []
    player("http://127.0.0.1:1", 0.1, 4.0, 0, 1.0, results, threading.Barrier(1), timeout_s=7.0)
    assert seen["httpx_kwargs"] == {"timeout": 7.0}
    assert results[0]["frames"] == 0 and results[0]["errors"] == ["connect: ConnectionError: refused"]


def test_bench_serve_plays_the_page_itself_with_simulated_players(crafter_files, tmp_path, capsys):  # noqa: F811
    """mcar bench serve: `mcar play` in its own process, two players at once on its HTTP API (gradio_client), each
    in its own session; what they saw, the server's memory, a table; the server is stopped at the end."""
    import json

    pytest.importorskip("gradio_client")
    from mcar.tools import bench

    out = tmp_path / "serve.json"
    run_in_process(bench.main, "serve", f"ckpt={crafter_files}/tiny.ckpt", "bench.serve.players=[2]",
                   "bench.serve.seconds=3", "bench.serve.rate=4",
                   f"bench.serve.play_overrides=['prompt_image={crafter_files}/start.png','idle_minutes=1']",
                   f"bench.out={out}", f"hydra.run.dir={tmp_path}/run")
    said = capsys.readouterr().out
    result = json.loads(out.read_text())
    r = result["rounds"]["2"]
    assert r["errors"] == 0 and r["frames"] >= 2 and r["first_frame_max_s"] > 0, (r, said)
    assert 0 < r["p50_s"] <= r["p95_s"] <= r["p99_s"] and 0 <= r["deadline_attainment"] <= 1
    assert r["frames_per_s"] > 0 and result["server_rss_mib_before"] > 0 and result["server_rss_mib_after"] > 0
    assert "players  moves/s each  p50 ms" in said and said.rstrip().endswith(f"JSON: {out}")
    log = (tmp_path / "serve" / "play.log").read_text()
    assert "stopped by SIGINT: the page on 127.0.0.1 is closed" in log  # the server is gone
