"""mcar.play: PlaySession driven in-process on a tiny random model (Crafter geometry, the committed small VQ, a
start frame from an image; and a held-out synthetic clip), the gradio page built over it, and a headless Chromium
that presses a key on the served page and sees a new frame."""
import base64
import io
import json
import logging
import os
import select
import shutil
import socket
import statistics
import subprocess
import time

import numpy as np
import pytest
import torch

from .conftest import SMALL_DATA, compose

H, W, CB = 14, 24, 1024  # data=crafter: 14x24 tokens of the committed small VQ, 224x384 frames


@pytest.fixture(scope="module")
def crafter_files(tmp_path_factory):
    """A tiny random model in data=crafter geometry (clip_frames 3) and a start image."""
    from PIL import Image

    from mcar.train.module import MCARModule

    tmp = tmp_path_factory.mktemp("play")
    torch.manual_seed(0)
    hp = dict(arch=dict(vocab_size=CB + 17, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64),
              layout=dict(h=H, w=W, n_a=1), clip_frames=3, mask={"name": "causal"}, optim={}, max_steps=1)
    torch.save({"hyper_parameters": hp, "state_dict": MCARModule(**hp).state_dict()}, tmp / "tiny.ckpt")
    img = np.zeros((224, 384, 3), np.uint8)
    img[:, :, 1] = 120  # grass-ish, with a block
    img[80:140, 150:230] = (90, 90, 90)
    Image.fromarray(img).save(tmp / "start.png")
    return tmp


def crafter_session(files, *overrides):
    from mcar.sampling.play_server import open_game

    return open_game(compose("play", [f"ckpt={files}/tiny.ckpt", f"prompt_image={files}/start.png",
                                          "schedule.k=2", *overrides]))


def test_steps_give_frames_and_the_context_slides(crafter_files):
    from mcar.tokenizer.actions import CRAFTER_ACTIONS

    assert crafter_session(crafter_files).context == 3  # the default: the checkpoint's clip_frames
    assert crafter_session(crafter_files, "sampler.context=2").context == 2
    s = crafter_session(crafter_files)
    assert s.history.shape == (1, H * W + 1)
    start = s.frame.copy()
    assert start.shape == (224, 384, 3) and start.dtype == np.uint8
    frames, ctxs = [], []
    for a in ["move_left", "do", "noop", "move_up"]:
        frame, info = s.step(a)
        assert frame.shape == (224, 384, 3) and frame.dtype == np.uint8
        assert info["action"] == a and info["k"] == 2 and info["fps"] > 0 and info["passes"] == (H - 1) * 2 + W
        assert info["context"] == 3 and info["batch"] == 1
        frames.append(frame.copy())
        ctxs.append(s.history.clone())
    ft = H * W
    assert [len(c) for c in ctxs] == [2, 2, 2, 2]  # at most context - 1 frames: the window slides
    assert torch.equal(ctxs[0][0, :ft], s.start[0, :ft])  # the start frame, then it drops out
    for i in (1, 2, 3):
        assert torch.equal(ctxs[i][0, :ft], ctxs[i - 1][1, :ft])  # the newest frame moves down one place
        # ... carrying the action taken from it
        assert int(ctxs[i][0, ft]) == CB + CRAFTER_ACTIONS.index(["move_left", "do", "noop", "move_up"][i])
    assert (ctxs[-1][:, :ft] < CB).all()  # image slots hold image codes
    assert not np.array_equal(frames[0], start)  # a random model draws something else
    assert s.server.restarts == 1  # one rollout: no prefill after the first step
    assert s.step(CRAFTER_ACTIONS.index("sleep"))[1]["action"] == "sleep"  # an id, labelled by its name
    with pytest.raises(ValueError, match="move_left"):
        s.step("jump")


def test_reset_restores_the_start_frame_and_replays_the_same_frames(crafter_files):
    s = crafter_session(crafter_files)
    start, start_ctx = s.frame.copy(), s.history.clone()
    first = [s.step(a)[0].copy() for a in ["move_right", "do"]]
    frame, info = s.reset()
    assert np.array_equal(frame, start) and torch.equal(s.history, start_ctx)
    assert info["step"] == 0 and info["action"] == "reset" and s.steps == 0
    again = [s.step(a)[0].copy() for a in ["move_right", "do"]]
    assert all(np.array_equal(x, y) for x, y in zip(first, again))  # seeded per step: replayed exactly

    w3 = crafter_session(crafter_files)
    assert w3.warm_up() > 0 and w3.steps == 0 and np.array_equal(w3.frame, start)  # back at the start frame
    assert sorted(w3.server._samplers) == [(2, 1), (2, 2)]  # k=2 from 1 and 2 frames held: ready for any restart


def test_set_k_changes_the_samplers_k_and_pass_count(crafter_files):
    s = crafter_session(crafter_files)
    assert s.sampler().config.k == 2
    assert s.step("noop")[1]["passes"] == (H - 1) * 2 + W
    s.set_k(1)
    assert s.sampler().config.k == 1 and s.info["k"] == 1
    _, info = s.step("noop")
    assert info["k"] == 1 and info["passes"] == (H - 1) * 1 + W
    s.set_k(4)
    assert s.step("noop")[1]["passes"] == (H - 1) * 4 + W
    with pytest.raises(ValueError, match="k=0"):
        s.set_k(0)
    assert s.k == 4


def test_forked_games_do_not_share_their_state(crafter_files):
    """Each browser session's game is a fork: steps, k and temperature of one never reach another, and a game
    interleaved with another draws exactly the frames it draws alone (the model and samplers are shared; each
    rollout's KV cache is swapped in while it runs)."""
    base = crafter_session(crafter_files, "sampler.temperature=1.0")
    solo = base.fork()
    alone = [solo.step(a)[0].copy() for a in ["move_left", "do", "move_up"]]
    a, b = base.fork(), base.fork()
    assert a.steps == b.steps == 0 and np.array_equal(a.frame, base.frame)
    b.set_k(4), b.set_temperature(0.0)
    mixed = []
    for act in ["move_left", "do", "move_up"]:
        mixed.append(a.step(act)[0].copy())
        b.step("move_right")
    assert all(np.array_equal(x, y) for x, y in zip(alone, mixed))
    assert (a.steps, a.k, a.temperature) == (3, 2, 1.0) and (b.steps, b.k, b.temperature) == (3, 4, 0.0)
    assert a.info["action"] == "move_up" and b.info["action"] == "move_right" and base.steps == 0
    assert a.server is b.server is base.server  # one model, samplers built once
    with pytest.raises(ValueError, match="temperature=-1"):
        a.set_temperature(-1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_games_stepped_together_draw_what_each_draws_alone(crafter_files, temperature):
    """Many players: games that step in one tick are batch rows of one rollout (one forward pass per schedule
    pass for all), and each draws exactly the frames it draws stepped alone (greedy; sampled: noise keyed by the
    game's own seed, not its batch row)."""
    base = crafter_session(crafter_files, f"sampler.temperature={temperature}")
    rng = torch.Generator().manual_seed(1)
    starts = [torch.cat([torch.randint(0, CB, (H * W,), generator=rng), torch.tensor([CB])]) for _ in range(3)]
    together = [base.fork(start=st, seed=i) for i, st in enumerate(starts)]
    alone = [base.fork(start=st, seed=i) for i, st in enumerate(starts)]
    acts = [["move_left", "do", "noop"], ["do", "do", "move_up"], ["noop", "move_right", "do"]]
    restarts = base.server.restarts
    got = [base.server.step_together([(g, a[t]) for g, a in zip(together, acts)]) for t in range(3)]
    assert base.server.restarts == restarts + 1  # one batch rollout for the three, no prefill after its first step
    assert all(info["batch"] == 3 for tick in got for _, info in tick)
    for i, (g, a) in enumerate(zip(alone, acts)):
        for t in range(3):
            frame, info = g.step(a[t])
            assert info["batch"] == 1 and np.array_equal(frame, got[t][i][0]), (i, t)
        assert torch.equal(g.history, together[i].history)
    with pytest.raises(ValueError, match="one step per tick"):
        base.server.step_together([(together[0], "do"), (together[0], "noop")])


def steps_in_one_tick(server, moves) -> dict:
    """Each (game, action) stepped from its own thread (the page's tabs), all waiting while a tick runs, so they
    make the next tick's batch together -> {game: (frame, info)}; every thread has ended."""
    import threading

    out = {}
    with server._cv:
        server._busy = True  # a tick is running: the steps wait for the next one
    threads = [threading.Thread(target=lambda g=g, act=act: out.setdefault(g, g.step(act))) for g, act in moves]
    for t in threads:
        t.start()
    while len(server._waiting) < len(moves):
        time.sleep(0.01)
    with server._cv:
        server._busy = False
        server._cv.notify_all()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    return out


def test_steps_from_threads_waiting_at_once_share_a_tick(crafter_files):
    """PlayServer.step from several threads (the page's tabs): the steps waiting while a tick runs are the next
    tick's batch, and each thread gets its own game's frame."""

    base = crafter_session(crafter_files)
    a, b = base.fork(), base.fork(seed=1)
    want = base.server.step_together([(base.fork(), "do"), (base.fork(seed=1), "noop")])
    out = steps_in_one_tick(base.server, [(a, "do"), (b, "noop")])
    assert out[a][1]["batch"] == out[b][1]["batch"] == 2
    assert np.array_equal(out[a][0], want[0][0]) and np.array_equal(out[b][0], want[1][0])


def test_bench_sessions_reports_each_games_and_all_games_frames_per_s(crafter_files, tmp_path):
    """mcar play bench.sessions=[1,2]: n games stepping together; per game and aggregate frames/s, JSON."""
    from mcar.bench.play_speed import bench_sessions, run_play

    s = crafter_session(crafter_files)
    out = bench_sessions(s, [1, 2], ["move_left"], steps=1, repeats=2)
    assert out["context"] == 3 and out["k"] == 2 and set(out["sessions"]) == {"1", "2"}
    for n, row in out["sessions"].items():
        assert len(row["rounds"]) == 2 and row["per_session_frames_per_s"] == statistics.median(row["rounds"])
        assert row["frames_per_s"] == round(row["per_session_frames_per_s"] * int(n), 2)
    cfg = compose("bench", ["bench.mode=play", "data=crafter", f"ckpt={crafter_files}/tiny.ckpt",
                            f"prompt_image={crafter_files}/start.png",
                            "bench.play.steps=0", "bench.play.sessions=[2]", "bench.play.session_steps=1",
                            "bench.repeats=1", "bench.play.player_steps=0"])
    res = run_play(cfg)
    out = res["sessions"]
    assert list(out["sessions"]) == ["2"] and out["sessions"]["2"]["frames_per_s"] > 0 and "steps" not in res
    for counts in ([0], []):  # no games: refused, not 69,175 frames/s
        with pytest.raises(ValueError, match="must be >= 1"):
            bench_sessions(s, counts, ["noop"], steps=1, repeats=1)


def test_temperature_zero_is_greedy_and_seed_free(crafter_files):
    """temperature 0 takes the most likely token: the frames do not depend on the seed; at 1 they do."""
    frames = {}
    for t in (0.0, 1.0):
        for seed in (0, 1):
            g = crafter_session(crafter_files, f"sampler.temperature={t}", f"seed={seed}")
            frames[t, seed] = g.step("move_left")[0]
    assert np.array_equal(frames[0.0, 0], frames[0.0, 1])
    assert not np.array_equal(frames[1.0, 0], frames[1.0, 1])


def test_rollout_agreement_scores_a_game_against_the_real_frames(crafter_files):
    """bench.rollouts: an oracle game (its model copies the real next frame) agrees 1.0 at every step; the
    unchanged start frame is the copy_first row."""
    from mcar.bench.play_speed import rollout_agreement

    s = crafter_session(crafter_files)
    L, ft = H * W + 1, H * W
    rng = torch.Generator().manual_seed(0)
    clip = torch.cat([torch.cat([torch.randint(0, CB, (ft,), generator=rng), torch.tensor([CB + 3])])
                      for _ in range(4)])
    frames = clip.reshape(4, L)

    class Oracle:  # a rollout whose next frame is the real one (any model would do as well as this at best)
        passes, rows, temperature, top_k = 1, None, 1.0, None

        def rolling_schedule(self, device):
            return type("Ring", (), {"cache_slots": 1})()

        def rollout(self, model, prompt, **settings):
            model.setup_cache(len(prompt), 1)  # a rollout runs on the model's cache (play lends it from its pool)
            self.last = prompt[0, -L:-1]
            return self

        def advance(self, ids):
            t = next(i for i in range(3) if torch.equal(frames[i, :ft], self.last))
            self.last = frames[t + 1, :ft]
            return self.last[None].clone()

    s.server.sampler = lambda k, held: Oracle()
    r = rollout_agreement(s, [clip])
    assert r["agreement"] == [1.0, 1.0, 1.0] and r["final"] == 1.0 and r["clips"] == 1
    same = [(frames[0, :ft] == frames[t, :ft]).float().mean().item() for t in (1, 2, 3)]
    assert r["copy_first"] == [round(x, 4) for x in same]


def test_serving_port_moves_past_a_taken_port():
    from mcar.tools.play import serving_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        assert serving_port("127.0.0.1", taken) != taken
        with pytest.raises(OSError, match="taken"):
            serving_port("127.0.0.1", taken, tries=1)


def test_bench_times_each_k_without_the_page(crafter_files, tmp_path):
    """mcar bench play bench.play.steps=N: no page, no gradio; per k the median of the rounds and the passes per
    frame, one JSON line printed and written to bench.out."""
    from mcar.bench.play_speed import bench_session, run_play

    s = crafter_session(crafter_files)
    out = bench_session(s, [1, 2], ["move_left", "noop"], steps=2, repeats=3)
    assert out["context"] == 3 and out["steps"] == 2 and set(out["ks"]) == {"1", "2"}
    for k, row in out["ks"].items():
        assert row["passes"] == (H - 1) * int(k) + W and len(row["rounds"]) == 3 and min(row["rounds"]) > 0
        assert row["frames_per_s"] == sorted(row["rounds"])[1]
    cfg = compose("bench", ["bench.mode=play", "data=crafter", f"ckpt={crafter_files}/tiny.ckpt",
                            f"prompt_image={crafter_files}/start.png",
                            "bench.play.steps=1", "bench.repeats=1", "bench.play.ks=[3]", "bench.play.player_steps=0",
                            "bench.play.sessions=null"])
    written = run_play(cfg)
    assert list(written["steps"]["ks"]) == ["3"] and written["steps"]["ks"]["3"]["passes"] == (H - 1) * 3 + W
    assert written["temperature"] == 0.0 and written["context"] == 3  # the page's start temperature
    with pytest.raises(ValueError, match="steps=0"):
        bench_session(s, [1], ["noop"], steps=0, repeats=1)


def test_play_without_gradio_says_how_to_install_it(crafter_files, monkeypatch):
    """A RuntimeError from our code: one line through plain_errors (it was a chained ImportError, two tracebacks)."""
    import sys

    from mcar.tools.play import play

    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio -> ImportError
    cfg = compose("play", [f"ckpt={crafter_files}/tiny.ckpt", f"prompt_image={crafter_files}/start.png"])
    with pytest.raises(RuntimeError, match=r"mcar play needs gradio: pip install -e '.\[play\]'") as e:
        play(cfg)
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_start_frames_from_a_held_out_clip():
    """prompt=<held-out clip id> with 2 start frames (schedule.prompt_frames=2), local action ids (n_a = 2)."""
    import tempfile
    from pathlib import Path

    from mcar.sampling.held_out import held_out_source
    from mcar.sampling.play_server import open_game

    from .test_cached_attention import tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint(Path(tmp))  # h=3, w=4, n_a=2, clip_frames=3
        cfg = compose("play", [*SMALL_DATA, f"ckpt={path}", "prompt=1", "schedule.prompt_frames=2",
                               f"paths.data_dir={tmp}/data"])  # context null: the checkpoint's 3 frames
        s = open_game(cfg)
        with pytest.raises(ValueError, match="set sampler.context=3 or more"):
            open_game(compose("play", [*SMALL_DATA, f"ckpt={path}", "prompt=1", "schedule.prompt_frames=2",
                                           f"paths.data_dir={tmp}/data", "sampler.context=2"]))
        clip = held_out_source(cfg, 3).clip(1)
    L = 3 * 4 + 2
    assert torch.equal(s.start.flatten(), clip[: 2 * L]) and s.context == 3 and s.frame.shape == (48, 64, 3)
    frame, info = s.step([1, 2])
    assert frame.shape == (48, 64, 3) and info["action"] == "[1, 2]" and len(s.history) == 2
    assert torch.equal(s.history[0, :12], clip[L:L + 12])  # the first start frame dropped out
    assert s.history[0, 12:].tolist() == [32 + 1, 32 + 2]
    with pytest.raises(ValueError, match="2 local action id"):
        s.step(3)
    from mcar.bench.play_speed import bench_session

    assert bench_session(s, [1], ["move_left"], steps=1, repeats=1)["ks"]["1"]["passes"] > 0  # no names: ids 0, 0


def test_the_page_binds_crafter_keys_to_buttons(crafter_files):
    pytest.importorskip("gradio", reason="gradio is an optional extra: pip install -e '.[play]'")
    from mcar.tools.play import build_app, key_script, page_controls

    s = crafter_session(crafter_files)
    controls = page_controls("crafter")  # Crafter's schema declares its keys and moves
    demo = build_app(s, buttons=["noop", "sleep", "place_stone"], ks=[1, 2, 3], **controls)
    ids = {getattr(b, "elem_id", None) for b in demo.blocks.values()}
    assert {"play-move_left", "play-do", "play-sleep", "play-place_stone", "play-reset", "play-frame"} <= ids
    assert "play-make_iron_sword" not in ids  # only the moves, the keys' actions and the buttons asked for
    js = key_script(controls["keys"])
    table = json.loads(js[js.index("{", js.index("keys =")):js.index(";", js.index("keys ="))])
    assert table["ArrowLeft"] == table["a"] == table["A"] == "move_left" and table[" "] == "do"
    assert table["s"] == "move_down" and table["W"] == "move_up"


def test_a_game_of_its_own_gets_a_button_per_action_and_its_schemas_keys():
    from mcar.tokenizer.actions import action_space
    from mcar.tools.play import page_actions, page_controls

    schema = {"actions": [{"name": "action", "type": "choice", "choices": ["NOOP", "FIRE", "RIGHT", "LEFT"]}],
              "moves": ["LEFT", "RIGHT"], "play_keys": [["ArrowLeft", "LEFT"], [" ", "FIRE"]]}
    controls = page_controls(schema)
    names, keys = page_actions(list(action_space(schema).names), ["noop", "do", "sleep"], **controls)
    assert names == ["LEFT", "RIGHT", "FIRE", "NOOP"] and keys == {"ArrowLeft": "LEFT", " ": "FIRE"}
    crafter = page_actions(list(action_space("crafter").names), ["noop", "sleep"], **page_controls("crafter"))
    assert crafter[0] == ["move_left", "move_right", "move_up", "move_down", "do", "noop", "sleep"]
    assert page_controls(None) == {"keys": {}, "moves": ()}


@pytest.mark.slow
def test_two_sessions_on_the_page_play_their_own_games(crafter_files, tmp_path, monkeypatch):
    """Two gradio clients (two browser sessions) on one served page: each steps its own game (its steps, k and
    frames are its own: the frames are those of a game played alone), idle games are dropped, the frames' temp
    PNGs are deleted."""
    pytest.importorskip("gradio", reason="gradio is an optional extra: pip install -e '.[play]'")
    from gradio_client import Client
    from PIL import Image

    from mcar.tools.play import build_app, page_controls

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "cache"))
    s = crafter_session(crafter_files, "sampler.temperature=1.0")
    alone = s.fork()
    want = [alone.step(a)[0].copy() for a in ["move_left", "do", "move_left"]]
    demo = build_app(s, buttons=["noop"], ks=[1, 2, 4], idle_minutes=6 / 60, cache_seconds=2,
                     **page_controls("crafter"))
    kept = set((tmp_path / "cache").rglob("*.png"))  # the page's own start frame: gradio keeps it
    port = free_port()
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        url = f"http://127.0.0.1:{port}/"
        a, b = (Client(url, verbose=False, download_files=str(tmp_path / n)) for n in "ab")
        got = []
        for act in ["move_left", "do", "move_left"]:
            image, info_a = a.predict(api_name=f"/step_{act}")
            got.append(np.asarray(Image.open(image).convert("RGB")))
            assert "k=4" in b.predict(4, api_name="/set_k") if act == "do" else b.predict(api_name="/step_noop")
        _, info_b = b.predict(api_name="/step_move_up")
        assert "step 3" in info_a and "k=2" in info_a and "**move_left**" in info_a
        assert "step 3" in info_b and "k=4" in info_b and "**move_up**" in info_b  # 2 noops + move_up
        assert all(np.array_equal(x, y) for x, y in zip(want, got)), "a game's frames changed with another's steps"
        assert demo.games.live == 2 and s.steps == 0  # the loaded session only lends its model
        end = time.monotonic() + 40
        made = lambda: set((tmp_path / "cache").rglob("*.png")) - kept  # noqa: E731
        assert made(), "the steps' frames were not written where expected"
        while (demo.games.live or made()) and time.monotonic() < end:
            time.sleep(0.5)
        assert demo.games.live == 0, "idle games were not dropped"
        assert not made(), f"the frames' temporary PNGs were not deleted: {sorted(made())}"
    finally:
        demo.close()


# ---- the browser check ------------------------------------------------------------------------------------
class Chromium:
    """Headless Chromium driven over the DevTools protocol on --remote-debugging-pipe (fd 3 in, fd 4 out:
    NUL-terminated JSON), so no websocket client is needed."""

    def __init__(self, exe: str, profile, width: int = 1280, height: int = 1000):
        to_r, self._w = os.pipe()
        self._r, from_w = os.pipe()
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--remote-debugging-pipe", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                "about:blank"]
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" 3<&{to_r} 4>&{from_w}', exe, *args],
                                     pass_fds=(to_r, from_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_r), os.close(from_w)
        self._id, self._buf, self.session = 0, b"", None

    def send(self, method: str, timeout: float = 30, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        end = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                left = end - time.monotonic()
                if left <= 0 or not select.select([self._r], [], [], left)[0]:
                    raise TimeoutError(f"chromium: no answer to {method}")
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the pipe")
                self._buf += chunk
            raw, _, self._buf = self._buf.partition(b"\0")
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> str:
        """A new tab on `url`, made the current one; -> its session id (for `use`)."""
        target = self.send("Target.createTarget", url=url)["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        return self.session

    def use(self, session: str) -> None:
        """Switch to a tab of `open`, brought to the front (a hidden tab does not load its images)."""
        self.session = session
        self.send("Page.bringToFront")

    def eval(self, expr: str):
        return self.send("Runtime.evaluate", expression=expr, returnByValue=True)["result"].get("value")

    def wait(self, expr: str, timeout: float = 60):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = self.eval(expr)
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"page: {expr} stayed false for {timeout}s")

    def screenshot(self, selector: str) -> np.ndarray:
        from PIL import Image

        png = self.send("Page.captureScreenshot", format="png", clip={**self.box(selector), "scale": 1})["data"]
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(png))).convert("RGB"))

    def save_page(self, path) -> None:
        """The whole visible page as a PNG (kept when a check fails, to see what the player saw)."""
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))

    def box(self, selector: str) -> dict:
        return self.eval(f"(() => {{ const r = document.querySelector('{selector}').getBoundingClientRect();"
                         "return {x: r.x, y: r.y, width: r.width, height: r.height}; })()")

    def key(self, key: str, code: str, vk: int):
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", type=kind, key=key, code=code, windowsVirtualKeyCode=vk,
                      nativeVirtualKeyCode=vk)

    def click(self, selector: str):
        """A mouse press and release at the centre of `selector`, as a player clicks it."""
        r = self.box(selector)
        x, y = r["x"] + r["width"] / 2, r["y"] + r["height"] / 2
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._w), os.close(self._r)


def chromium_exe():
    """The browser for the page check. Without one the check is skipped, unless MCAR_REQUIRE_BROWSER is set (as
    .ci/run sets it): then a missing browser fails the run."""
    exe = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if exe is None and os.environ.get("MCAR_REQUIRE_BROWSER"):
        pytest.fail("MCAR_REQUIRE_BROWSER is set and no chromium is on PATH: apt-get install -y chromium")
    if exe is None:
        pytest.skip("no chromium binary (apt-get install chromium) for the headless browser check")
    return exe


def test_a_missing_browser_fails_when_the_browser_check_is_required(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("MCAR_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y chromium"):
        chromium_exe()
    monkeypatch.delenv("MCAR_REQUIRE_BROWSER")
    with pytest.raises(pytest.skip.Exception):
        chromium_exe()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


IMG, INFO = "document.querySelector('#play-frame img')", "document.getElementById('play-info').innerText"


def play_a_step(browser, press, action: str, step: int) -> str:
    """`press()` (a key or a click) -> the frame on screen changes and the step counter reads `step`, `action`;
    -> the new frame's src."""
    src, before = browser.eval(f"{IMG}.src"), browser.screenshot("#play-frame img")
    press()
    browser.wait(f"{IMG}.src !== {json.dumps(src)} && {IMG}.complete && {INFO}.includes('step {step}')")
    assert action in browser.eval(INFO)
    after = browser.screenshot("#play-frame img")
    assert before.shape == after.shape and before.size > 0
    diff = np.abs(before.astype(int) - after.astype(int)).mean()
    assert diff > 5, f"the frame on the page did not change (mean abs difference {diff:.2f})"
    return browser.eval(f"{IMG}.src")


@pytest.mark.slow
def test_a_player_in_the_browser_steps_their_own_game(crafter_files, tmp_path, monkeypatch):
    """The page served on localhost, two headless Chromium tabs (two sessions) at once, played as a player plays:
    ArrowLeft, then a click on the move_right button, each change the frame on screen and advance the step
    counter of that tab's game only; the other tab stays at its start and its own key press gives its own step 1;
    a reload starts a new game with the k radio showing its k. On a failure each tab's page is kept as a PNG in
    the test's tmp folder."""
    pytest.importorskip("gradio", reason="gradio is an optional extra: pip install -e '.[play]'")
    exe = chromium_exe()
    from mcar.tools.play import build_app, page_controls

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    s = crafter_session(crafter_files)
    demo = build_app(s, buttons=["noop"], ks=[1, 2], **page_controls("crafter"))
    port = free_port()
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    browser = Chromium(exe, tmp_path / "profile")
    tabs = []
    try:
        tabs += [browser.open(f"http://127.0.0.1:{port}/") for _ in range(2)]
        for tab in tabs:
            browser.use(tab)
            browser.wait(f"!!{IMG} && window.__mcarPlayKeys === true && {IMG}.complete")
        browser.use(tabs[0])
        played = [play_a_step(browser, lambda: browser.key("ArrowLeft", "ArrowLeft", 37), "move_left", 1),
                  play_a_step(browser, lambda: browser.click("#play-move_right"), "move_right", 2)]

        browser.use(tabs[1])  # the other session: still at its start, then its own first step
        assert "reset" in browser.eval(INFO) and "step 0" in browser.eval(INFO)
        assert browser.eval(f"{IMG}.src") not in played  # not the other tab's new frames
        play_a_step(browser, lambda: browser.key("ArrowUp", "ArrowUp", 38), "move_up", 1)
        assert demo.games.live == 2
        browser.use(tabs[0])
        assert "move_right" in browser.eval(INFO) and "step 2" in browser.eval(INFO)
        assert s.steps == 0  # the loaded session only lends its model

        browser.click('#play-k input[value="1"]')  # k=1 in this tab ...
        browser.wait(f"{INFO}.includes('k=1')")
        browser.send("Page.reload")  # ... a reload is a new session: a new game, the radio at its k again
        browser.wait(f"!!{IMG} && {INFO}.includes('step 0')")
        assert browser.wait("document.querySelector('#play-k input:checked')?.value") == str(s.k)
    except BaseException:
        for i, tab in enumerate(tabs):
            browser.use(tab)
            browser.save_page(tmp_path / f"failure-tab{i}.png")
        raise
    finally:
        browser.close()
        demo.close()


def test_a_partner_leaving_or_resetting_never_breaks_or_restarts_a_batched_game(crafter_files):
    """Once two games share a rollout, a reset or a leave of one leaves a ghost row: the other steps on alone,
    with no restart, drawing what it draws played alone (it broke with "shape '[2, 1]' is invalid" before)."""
    base = crafter_session(crafter_files, "sampler.temperature=1.0")
    solo = base.fork(seed=5)
    alone = [solo.step(a)[0].copy() for a in ["move_left", "do", "noop", "move_up"]]
    for drop in ("reset", "leave"):
        a, b = base.fork(seed=5), base.fork(seed=6)
        got = [base.server.step_together([(a, "move_left"), (b, "do")])[0][0]]
        restarts = base.server.restarts
        b.reset() if drop == "reset" else base.server.leave(b)
        got += [a.step(act)[0].copy() for act in ["do", "noop", "move_up"]]
        assert base.server.restarts == restarts, drop
        assert all(np.array_equal(x, y) for x, y in zip(alone, got)), drop
        if drop == "reset":
            assert b.step("noop")[1]["batch"] == 1  # b restarts on its own
        base.server.leave(a)


def test_a_game_dropped_while_its_step_runs_keeps_its_own_frame(crafter_files, monkeypatch):
    """A game that leaves during a tick (the page's idle drop) waits for the tick; each thread still gets its
    own game's frame, nobody's thread spins, and the other game steps on."""
    import threading

    from mcar.sampling.play_server import PlaySession

    base = crafter_session(crafter_files)
    want = base.server.step_together([(base.fork(), "do"), (base.fork(seed=1), "noop")])
    a, b = base.fork(), base.fork(seed=1)
    server, leaving = base.server, []
    decode = PlaySession.decode

    def decode_and_drop(self, tokens):  # mid-tick: another thread drops game a
        if not leaving:
            leaving.append(threading.Thread(target=server.leave, args=(a,)))
            leaving[0].start()
        return decode(self, tokens)

    monkeypatch.setattr(PlaySession, "decode", decode_and_drop)
    out = steps_in_one_tick(server, [(a, "do"), (b, "noop")])
    leaving[0].join(30)
    assert not leaving[0].is_alive()
    assert np.array_equal(out[a][0], want[0][0]) and np.array_equal(out[b][0], want[1][0])
    assert a not in server.games and b.step("do")[1]["batch"] == 1


def test_a_games_noise_does_not_depend_on_who_joins(crafter_files):
    """Seeded at temperature 1: a game that another player joins (and steps beside) draws the frames it draws
    alone; a game restarted from its own history later draws the same noise for the same frame index."""
    base = crafter_session(crafter_files, "sampler.temperature=1.0")
    acts = ["move_left", "do", "noop", "move_up", "do", "move_right"]
    solo = base.fork(seed=3)
    alone = [solo.step(a)[0].copy() for a in acts]
    a = base.fork(seed=3)
    got = [a.step(act)[0].copy() for act in acts[:3]]
    b = base.fork(seed=3)  # the same seed, another game, as far into its game as a: they once shared a restart
    b.step("noop"), b.step("do")
    for act in acts[3:]:
        got.append(base.server.step_together([(a, act), (b, "noop")])[0][0])
    assert all(np.array_equal(x, y) for x, y in zip(alone, got))


def test_games_are_capped_and_their_memory_returned(crafter_files):
    """max_games: the next join is refused with a message the page shows; games that leave free their place and
    give their rollout's KV cache back to the server's pool, and a server whose players all left lends none."""
    from mcar.sampling.play_server import GamesFull

    base = crafter_session(crafter_files, "max_games=2")
    a, b = base.fork(), base.fork(seed=1)
    with pytest.raises(GamesFull, match="all 2 games are taken"):
        base.fork()
    base.server.step_together([(a, "do"), (b, "noop")])
    a.step("do")  # a alone: split off into its own rollout; b's row of the shared one stays, a's is a ghost
    assert len(base.server._groups) == 2
    base.server.leave(a)
    c = base.fork()  # a's place is free
    base.server.leave(b), base.server.leave(c)
    assert base.server.leaves_nothing()
    with pytest.raises(ValueError, match="max_games=0"):
        crafter_session(crafter_files, "max_games=0")


def cache_addresses_by_width(model) -> dict:
    """Batch width -> the KV cache addresses (each layer's k and v buffers) the model's cached passes have read,
    collected from now on. Every cache seen is kept alive, so a freed buffer's address never returns as a new
    cache's."""
    seen, kept = {}, []

    def record(module, args):
        caches = module.kv_caches()
        if caches is not None:
            kept.append(caches)
            ptrs = tuple(b.data_ptr() for c in caches for b in (c.k_buf, c.v_buf))
            seen.setdefault(args[0].shape[0], set()).add(ptrs)

    model.register_forward_pre_hook(record)
    return seen


def test_joins_leaves_resets_and_k_changes_keep_each_widths_kv_caches_at_the_same_addresses(crafter_files, monkeypatch):
    """CUDA graphs read the KV caches at fixed addresses: a cache that moved is recorded again (and after 128
    records of a shape torch stops graphing it). Rollouts borrow their caches from the server's pool, so a width's
    passes see no more cache sets than rollouts of that width ever live at once, however often players come, go,
    reset or change k. On the static path (CUDA's) a rollout's own inputs (tokens, row keys, first slots) ride on
    its cache set too: as many addresses per width as cache sets."""
    from mcar.sampling.play_server import PlayServer, PlaySession

    monkeypatch.setattr(PlaySession, "decode", lambda self, tokens: np.zeros((1, 1, 3), np.uint8))  # images unused
    base = crafter_session(crafter_files, "sampler.temperature=1.0", "sampler.static=true")
    server = base.server
    seen = cache_addresses_by_width(server.model)
    inputs, step_together = {}, PlayServer.step_together

    def stepped(self, moves):
        out = step_together(self, moves)
        for g in self._groups:
            r = g.run
            inputs.setdefault(len(g.rows), set()).add((r.tokens.data_ptr(), r.rows.data_ptr(),
                                                       r.first_slots.data_ptr()))
        return out

    monkeypatch.setattr(PlayServer, "step_together", stepped)
    a, b = base.fork(seed=1), base.fork(seed=2)
    server.step_together([(a, "do"), (b, "noop")])  # one rollout of width 2
    b.reset()
    server.step_together([(a, "do"), (b, "noop")])  # a split off (width 1), b restarted (width 1): two live
    b.set_k(1)
    server.step_together([(a, "do"), (b, "noop")])  # b restarted at k=1: the set it left
    server.leave(b)
    c = base.fork(seed=3)
    server.step_together([(a, "do"), (c, "noop")])  # c starts on b's set
    server.leave(a), server.leave(c)
    d, e = base.fork(seed=4), base.fork(seed=5)
    server.step_together([(d, "do"), (e, "noop")])  # a width-2 rollout again: the first one's set
    server.leave(d), server.leave(e)
    assert server.restarts == 5 and server.splits == 1
    assert {w: len(sets) for w, sets in seen.items()} == {1: 2, 2: 1}
    assert {w: len(sets) for w, sets in inputs.items()} == {1: 2, 2: 1}
    assert server.leaves_nothing()


def test_a_game_on_a_recycled_kv_cache_draws_what_it_draws_on_a_fresh_one(crafter_files, monkeypatch):
    """A rollout started on a cache another game filled sees nothing of it (the prefill zeroes the set): the same
    game, seed and actions draw the same frames token for token as on a fresh server's new cache."""
    from mcar.sampling.play_server import PlaySession

    monkeypatch.setattr(PlaySession, "decode", lambda self, tokens: np.zeros((1, 1, 3), np.uint8))  # tokens compared
    acts = ["move_left", "do", "noop", "move_up"]
    base = crafter_session(crafter_files, "sampler.temperature=1.0")
    server = base.server

    def drawn(game) -> list[torch.Tensor]:
        frames = []
        for act in acts:
            game.step(act)
            frames.append(game.history[-1].clone())
        return frames

    fresh = base.fork(seed=7)
    want = drawn(fresh)
    cache = server.model.kv_caches()[0]
    server.leave(fresh)
    other = base.fork(seed=8)  # another game fills the set (every ring slot) first
    drawn(other)
    server.leave(other)
    again = base.fork(seed=7)
    assert all(torch.equal(x, y) for x, y in zip(want, drawn(again)))
    assert server.model.kv_caches()[0] is cache  # the very same buffers, recycled twice
    server.leave(again)


def test_a_soak_of_players_coming_and_going_draws_every_frame_as_played_alone(crafter_files):
    """Players join, step, reset, change k and leave at random (batched in ticks); every game, replayed alone
    with the same events, draws the same frames token for token (mcar bench play bench.play.soak_ticks=N)."""
    from mcar.bench.play_speed import soak_games

    base = crafter_session(crafter_files, "sampler.temperature=1.0")
    r = soak_games(base, ticks=14, max_players=3, seed=3)
    assert r["mismatched"] == 0 and r["frames"] >= 10 and r["games"] >= 3, r
    assert r["splits"] >= 1  # partners stepping apart were split, not restarted
    assert base.server.leaves_nothing()  # every game gone, every rollout's cache back in the pool


def test_a_game_gradio_deletes_twice_leaves_once():
    """gradio calls a State's delete callback when it expires and again when its session closes: the game leaves
    the server once and the live count never goes below the games held (it read -1 on a loaded machine)."""
    from mcar.tools.play import Games

    left = []
    server = type("Server", (), {"leave": lambda self, game: left.append(game)})()
    game = type("Game", (), {"server": server, "steps": 3})()
    base = type("Base", (), {"fork": lambda self: game})()
    games = Games(base)
    assert games.of(None) is game and games.live == 1
    games.dropped(game)
    games.dropped(game)
    games.dropped(None)
    assert games.live == 0 and left == [game]


def test_a_closed_page_gives_its_place_back_at_once(crafter_files, tmp_path, monkeypatch, capfd, caplog):
    """A session that closes (a tab closed or reloaded, a client done) gives its game's place and KV cache back
    when it goes, not when gradio deletes a closed session's State (an hour later, whatever idle_minutes says);
    a player turned away at max_games is told so in one line, with no traceback in the log."""
    pytest.importorskip("gradio", reason="gradio is an optional extra: pip install -e '.[play]'")
    from gradio_client import Client

    from mcar.tools.play import build_app

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.5")  # a closed client is seen at its next heartbeat
    s = crafter_session(crafter_files, "max_games=2")
    demo = build_app(s, buttons=[], ks=[2], idle_minutes=30, cache_seconds=0)
    port = free_port()
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}/"
    clients = []
    try:
        with caplog.at_level(logging.INFO, logger="mcar.play"):
            a, b, c = (Client(url, verbose=False, download_files=str(tmp_path / n)) for n in "abc")
            clients += [a, b, c]
            a.predict(api_name="/step_do")
            b.predict(api_name="/step_do")
            with pytest.raises(Exception, match="all 2 games are taken"):
                c.predict(api_name="/step_do")
            a.close()
            b.close()
            end = time.monotonic() + 30
            while demo.games.live and time.monotonic() < end:
                time.sleep(0.2)
            assert demo.games.live == 0 and not s.server.games, "a closed session still holds its game"
            _, info = c.predict(api_name="/step_do")
            assert "step 1" in info
        assert sum("a closed page's game was dropped" in r.getMessage() for r in caplog.records) == 2
        assert any("a new player was turned away: all 2 games are taken" in r.getMessage() for r in caplog.records)
        out = capfd.readouterr()
        assert "Traceback" not in out.out + out.err
    finally:
        for client in clients:
            client.close()
        demo.close()


def slow_page(first_answer_s: float):
    """A local HTTP server whose first answer comes after `first_answer_s` (a loaded machine); -> (url, server)."""
    import http.server
    import threading

    answered = []

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            if not answered:
                time.sleep(first_answer_s)
            answered.append(1)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/", server


def test_the_page_check_waits_out_a_slow_first_answer_and_skips_proxies(monkeypatch):
    """gradio gives its own page 3 s to answer; play's check waits as long as it is told, asks no proxy, and says
    no for a port where nothing answers."""
    from mcar.tools.play import page_answers

    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a proxy that would refuse: never asked
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    url, server = slow_page(3.5)
    try:
        t0 = time.monotonic()
        assert page_answers(url, 20) and time.monotonic() - t0 >= 3.5
    finally:
        server.shutdown()
    t0 = time.monotonic()
    assert not page_answers(f"http://127.0.0.1:{free_port()}/", 1) and time.monotonic() - t0 < 4


def test_play_serves_when_gradios_own_check_of_its_page_gives_up(crafter_files, tmp_path, monkeypatch):
    """On a loaded machine gradio's 3 s check of its own page fails and its launch raises ("a shareable link must
    be created"); play's start does not depend on it, and a page that never answers is one line saying what to do."""
    pytest.importorskip("gradio", reason="gradio is an optional extra: pip install -e '.[play]'")
    import gradio.networking
    from gradio_client import Client

    from mcar.tools import play as play_tool

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gradio.networking, "url_ok", lambda url: False)  # its first answer took over 3 s
    demo = play_tool.build_app(crafter_session(crafter_files), buttons=[], ks=[2], cache_seconds=0)
    port = free_port()
    try:
        play_tool.serve(demo, "127.0.0.1", port, block=False, answer_s=30)
        client = Client(f"http://127.0.0.1:{port}/", verbose=False, download_files=str(tmp_path / "c"))
        assert "step 1" in client.predict(api_name="/step_do")[1]
        client.close()
    finally:
        demo.close()
    monkeypatch.setattr(play_tool, "page_answers", lambda url, within_s: False)
    with pytest.raises(RuntimeError, match=r"^mcar play: the page at http://127.0.0.1:\d+/ did not answer within "
                                           r"30 s: .*start it again") as e:
        play_tool.serve(demo, "127.0.0.1", free_port(), block=False, answer_s=30)
    assert "\n" not in str(e.value) and not demo.is_running


def test_two_events_of_a_new_page_at_once_make_one_game():
    """A page's first events can reach the server together, its State still empty: they get one game, not one
    each (the second would hold a place until it idled out)."""
    import threading

    from mcar.tools.play import Games

    class SlowBase:
        forks = 0

        def fork(self):
            SlowBase.forks += 1
            time.sleep(0.2)
            return object()

    games = Games(SlowBase())
    got = []
    threads = [threading.Thread(target=lambda: got.append(games.of(None, "page-1"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert SlowBase.forks == 1 and len({id(g) for g in got}) == 1 and games.live == 1
    assert games.of(None, "page-2") is not got[0] and games.live == 2
