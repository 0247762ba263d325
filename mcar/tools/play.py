"""Play a trained world model in the browser: keys and buttons pick the action, DiagD draws the next frame.

    pip install -e '.[play]'                                  # gradio, an optional extra
    mcar play ckpt=checkpoints/<run> [prompt=3] [schedule.k=2] [port=7860] [sampler.context=N]
    mcar play ckpt=... prompt_image=frame.png       # start from an image instead of a held-out clip
    mcar bench play ckpt=...                        # no page: speed, many games, rollouts (mcar.bench.play_speed)

Then open http://127.0.0.1:7860. The keys are the action space's (`play_keys`: Crafter's arrows or WASD move,
space is `do`; a recordings folder's actions.yaml names its own); buttons take the other actions (`buttons`, or
every action of a game of its own), `reset` goes back to the start frame, the k radio sets schedule.k.

Each step draws the frame the chosen action leads to on the rolling KV cache: the model sees `sampler.context`
frames (null: the checkpoint's clip_frames, the longest clips it was trained on), the last context - 1 frames and
the new one. The start frame(s): the first schedule.prompt_frames frames of held-out clip `prompt` (as in
mcar.generate), or `prompt_image`. The engine (games, batching the games of several tabs) is mcar.sampling.play_server;
this module is the page and the command.
"""
from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from functools import partial

from omegaconf import DictConfig

from mcar.hydra_app import hydra_tool
from mcar.sampling.play_server import GamesFull, PlaySession, open_game
from mcar.stopping import on_stop_say
from mcar.tokenizer.pictures import data_action_space

log = logging.getLogger("mcar.play")

def page_controls(space) -> dict:
    """A data's action space (a name or a schema: mcar.tokenizer.pictures.data_action_space) -> build_app's `keys`
    (KeyboardEvent.key -> action; the page also binds upper-case letters) and `moves` (their buttons first)."""
    from mcar.tokenizer.actions import action_space

    if space is None:
        return {"keys": {}, "moves": ()}
    space = action_space(space)
    return {"keys": dict(space.play_keys), "moves": tuple(space.moves)}


# ---- the page ---------------------------------------------------------------------------------------------
K_HELP = ("**k** is DiagD's slope: row i of the next frame starts k tokens after row i - 1, so a frame takes "
          "(h - 1)·k + w model passes instead of h·w. Small k: fewer passes, a faster step; large k: each token "
          "sees more of the row above it. **temperature** 0 takes the most likely token everywhere (the steadiest "
          "world); higher values sample more freely (more variety, more drift).")


def context_help(context: int) -> str:
    """What the model sees, and why things it saw may go."""
    return (f"**What the model sees**: {context} frames, the last {context - 1} and the one it draws (its context: "
            f"the clip length it was trained on, or `context=`). It has no memory beyond them: anything that leaves "
            f"the picture, or was last seen more than {context - 1} step(s) ago, has left its context, and it may "
            f"vanish or come back different.")


def key_help(keys: dict) -> str:
    """{key: action} -> "ArrowLeft/a move_left, space do" for the page's first line."""
    by_action: dict[str, list[str]] = {}
    for key, action in keys.items():
        by_action.setdefault(action, []).append("space" if key == " " else key)
    return ", ".join(f"{'/'.join(ks)} `{a}`" for a, ks in by_action.items())


def describe(info: dict) -> str:
    fps = "-" if info["fps"] is None else f"{info['fps']:.2f}"
    return (f"**{info['action']}** &nbsp; {fps} frames/s &nbsp; k={info['k']} ({info['passes']} passes) &nbsp; "
            f"temperature {info.get('temperature', '-')} &nbsp; step {info['step']}; the model sees "
            f"{info['frames'] + 1} of its {info['context']} context frames")


class Games:
    """One game per browser session, forked from the loaded session (one server: its model, VQ and samplers are
    shared, and games stepping at once are batched); `live` counts the games sessions still hold. A game goes when
    its session closes (`closed`: a tab closed or reloaded, a client done) or after the session's idle time
    (gradio's State expiry, `dropped`); a closed session's State outlives it by an hour in gradio, far too long to
    hold a place of max_games and a KV cache."""

    def __init__(self, base: PlaySession, refuse=RuntimeError):
        self.base, self.refuse, self._lock = base, refuse, threading.Lock()
        self._held: set[int] = set()  # ids of the games sessions hold
        self._leaving: set[int] = set()  # ids of those giving their place back now
        self._of_session: dict[str, PlaySession] = {}  # session id -> its game

    def of(self, game: PlaySession | None, session: str | None = None) -> PlaySession:
        """The session's game; a new one (from the start frame) for a session that has none yet, or whose game was
        dropped; `refuse` (the page's error, a message to the player) when the server holds max_games games."""
        if game is not None and id(game) in self._held:
            return game
        with self._lock:  # two events of a new page at once (its State still empty) make one game, not two
            if session is not None and session in self._of_session:
                return self._of_session[session]
            try:
                game = self.base.fork()
            except GamesFull as e:
                log.info("mcar.play: a new player was turned away: %s", e)
                raise self.refuse(str(e)) from None
            self._held.add(id(game))
            if session is not None:
                self._of_session[session] = game
        return game

    @property
    def live(self) -> int:
        return len(self._held)

    def closed(self, session: str) -> None:
        """The page's unload callback: session `session` closed, its game leaves now."""
        with self._lock:
            game = self._of_session.pop(session, None)
        self._leave(game, "a closed page's game")

    def dropped(self, game: PlaySession | None) -> None:
        """gradio's callback for a session state it deletes: on expiry and again when the session closes, so a game
        may come twice; it leaves once."""
        self._leave(game, "an idle game")

    def _leave(self, game: PlaySession | None, what: str) -> None:
        with self._lock:
            if game is None or id(game) not in self._held or id(game) in self._leaving:
                return
            self._leaving.add(id(game))  # a second callback for it waits for nothing and leaves nothing
            self._of_session = {k: g for k, g in self._of_session.items() if g is not game}
        game.server.leave(game)  # its place is free (the server's count) before `live` says so
        with self._lock:
            self._held.discard(id(game))
            self._leaving.discard(id(game))
        log.info("mcar.play: %s was dropped after %d step(s); %d live", what, game.steps, self.live)


def key_script(keys: dict[str, str]) -> str:
    """Browser JS: a key of `keys` clicks the button `play-<action>` (not while typing in a field)."""
    table = {**keys, **{k.upper(): v for k, v in keys.items() if len(k) == 1 and k.isalpha()}}
    return """() => {
  const keys = %s;
  if (window.__mcarPlayKeys) return;
  window.__mcarPlayKeys = true;
  document.addEventListener('keydown', (e) => {
    const t = e.target;
    if (t && (t.tagName === 'TEXTAREA' || (t.tagName === 'INPUT' && t.type !== 'radio' && t.type !== 'range'))) return;
    const name = keys[e.key];
    if (!name) return;
    const b = document.getElementById('play-' + name);
    if (!b) return;
    e.preventDefault();
    (b.tagName === 'BUTTON' ? b : b.querySelector('button') || b).click();
  });
}""" % json.dumps(table)


def page_actions(actions: list[str], buttons, keys: dict, moves) -> tuple[list[str], dict]:
    """The page's buttons (the moves, the keys' actions, then `buttons`; every action when none of `buttons` is
    one: a game of its own) and the keys whose action the game has."""
    keys = {k: v for k, v in keys.items() if v in actions}
    if not any(b in actions for b in buttons):
        buttons = actions
    return [a for a in dict.fromkeys([*moves, *keys.values(), *buttons]) if a in actions], keys


def build_app(session: PlaySession, buttons=(), ks=(1, 2, 3, 4), title: str = "mcar play", idle_minutes: float = 30,
              cache_seconds: int = 120, keys: dict | None = None, moves=()):
    """A gradio Blocks page over `session`: the frame, the action/fps line, k and temperature, reset and one button
    per action (the moves, the keys' actions, then `buttons`; every action when none of `buttons` is the game's);
    `keys` (KeyboardEvent.key -> action name: `page_controls`) press them. Every browser session plays its own
    game (a gr.State holding a fork of `session`, on its server), dropped when the session closes or after
    `idle_minutes` without a step; the frames' temporary PNGs older than `cache_seconds` are deleted. -> the page
    (`demo.games`: Games)."""
    import gradio as gr

    names, keys = page_actions(list(session.actions), buttons, keys or {}, moves)
    ks = sorted({int(k) for k in ks} | {session.k})
    quiet = {"print_exception": False} if "print_exception" in inspect.signature(gr.Error.__init__).parameters else {}
    games = Games(session, refuse=partial(gr.Error, **quiet))  # a refusal is a message, not a traceback in the log

    def told_the_session(fn):  # gradio passes a handler its request (the session's id) by this annotation
        fn.__annotations__ = {"request": gr.Request}
        return fn

    def take(name):
        @told_the_session
        def step(game, request):
            game = games.of(game, request.session_hash)
            frame, info = game.step(name)
            return frame, describe(info), game
        return step

    @told_the_session
    def reset(game, request):
        game = games.of(game, request.session_hash)
        frame, info = game.reset()
        return frame, describe(info), game

    @told_the_session
    def change_k(k, game, request):
        game = games.of(game, request.session_hash)
        return describe(game.set_k(int(k))), game

    @told_the_session
    def change_temperature(t, game, request):
        game = games.of(game, request.session_hash)
        return describe(game.set_temperature(float(t))), game

    @told_the_session
    def opened(game, request):  # a (re)loaded page shows its own game and that game's k and temperature
        game = games.of(game, request.session_hash)
        return game.frame, describe(game.info), game.k, game.temperature, game

    @told_the_session
    def closed(request):
        games.closed(request.session_hash)

    # lossless frames where the Image component can say so (gradio >= 4.x's `format`; webp is the default)
    png = {"format": "png"} if "format" in inspect.signature(gr.Image.__init__).parameters else {}
    cache = {"delete_cache": (cache_seconds, cache_seconds)} if cache_seconds and \
        "delete_cache" in inspect.signature(gr.Blocks.__init__).parameters else {}
    # steps of several tabs may wait at once: the server batches the games stepping together into one tick
    serial = {"concurrency_limit": None, "concurrency_id": "play"}
    with gr.Blocks(title=title, analytics_enabled=False, **cache) as demo:
        game = gr.State(None, time_to_live=idle_minutes * 60 if idle_minutes else None,
                        delete_callback=games.dropped)
        gr.Markdown(f"### {title}\n" + (f"Keys: {key_help(keys)}; " if keys else "")
                    + "the buttons take an action; each step generates the next frame with DiagD.")
        with gr.Row():
            image = gr.Image(value=session.frame, type="numpy", label="frame", interactive=False,
                             elem_id="play-frame", **png)
            with gr.Column():
                info = gr.Markdown(describe(session.info), elem_id="play-info")
                k = gr.Radio(choices=ks, value=session.k, label="k (DiagD)", elem_id="play-k")
                temperature = gr.Slider(0, 1.5, value=session.temperature, step=0.05, label="temperature",
                                        elem_id="play-temperature")
                reset_button = gr.Button("reset", elem_id="play-reset")
                gr.Markdown(K_HELP, elem_id="play-help")
                gr.Markdown(context_help(session.context), elem_id="play-context")
        with gr.Row():
            for name in names:
                b = gr.Button(name, elem_id=f"play-{name}", size="sm")
                b.click(take(name), game, [image, info, game], api_name=f"step_{name}", **serial)
        reset_button.click(reset, game, [image, info, game], api_name="reset", **serial)
        k.input(change_k, [k, game], [info, game], api_name="set_k", **serial)
        temperature.release(change_temperature, [temperature, game], [info, game], api_name="set_temperature",
                            **serial)
        demo.load(opened, game, [image, info, k, temperature, game], api_name="open", **serial)
        demo.load(None, None, None, js=key_script(keys))
        demo.unload(closed)
    demo.games = games
    return demo


def serving_port(host: str, port: int, tries: int = 100) -> int:
    """`port` when it is free on `host`, else the next free one of the `tries` after it (said in the log)."""
    import socket

    for candidate in range(port, port + tries):
        with socket.socket() as s:
            try:
                s.bind((host, candidate))
            except OSError:
                continue
        if candidate != port:
            log.warning("mcar.play: port %d is taken: serving on %d instead", port, candidate)
        return candidate
    raise OSError(f"port={port}: it and the {tries - 1} after it are taken on {host}; pick another (port=...)")


def page_answers(url: str, within_s: float) -> bool:
    """The page at `url` answers an HTTP request (any status under 500) within `within_s` seconds, asked again
    until then; proxies are not asked (a proxy set for the web would not reach this machine's own page)."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    end = time.monotonic() + within_s
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return False
        try:
            with opener.open(urllib.request.Request(url, method="HEAD"), timeout=left) as r:
                return r.status < 500
        except urllib.error.HTTPError as e:
            if e.code < 500:
                return True
        except (OSError, TimeoutError):
            pass
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))


def serve(demo, host: str, port: int, block: bool = True, answer_s: float = 120) -> None:
    """Serve `demo` on host:port and wait (up to `answer_s`) for the page to answer: gradio's own check of its page
    gives up after 3 s, which a loaded machine takes for its first response, and then ends the command in a
    misleading error (a shareable link or proxy settings); here the wait is patient and a failure one line."""
    launch = dict(server_name=host, server_port=port, prevent_thread_lock=True, inbrowser=False, share=False,
                  quiet=True)
    if "_frontend" in inspect.signature(demo.launch).parameters:
        launch["_frontend"] = False  # gradio's 3 s check of its own page: ours below waits
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/"
    try:
        demo.queue().launch(**launch)
        answered = page_answers(url, answer_s)
    except Exception as e:  # the server did not start: said below with what to do
        demo.close()
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RuntimeError(f"mcar play: the page did not start on {url} ({why}): "
                           f"check that host={host} is this machine's and that no proxy is set for it "
                           f"(NO_PROXY={host}), then start it again") from None
    if not answered:
        demo.close()
        raise RuntimeError(f"mcar play: the page at {url} did not answer within {answer_s:g} s: the machine is too "
                           f"busy or a firewall holds the port; start it again when the load is lower, or pick "
                           f"another port (port=...)")
    log.info("mcar.play: the page answers at %s", url)
    if block:
        demo.block_thread()


def play(cfg: DictConfig, block: bool = True):
    """Open the game and serve its page on cfg.host:cfg.port; -> (demo, session)."""
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise RuntimeError("mcar play needs gradio: pip install -e '.[play]'") from None
    int(cfg.port)  # a port that is no number is said (port=abc) before the model loads
    session = open_game(cfg)
    log.info("mcar.play: warming up at k=%d (with sampler.compile=true this compiles, ~1 min on CPU)", session.k)
    log.info("mcar.play: warm-up took %.1f s", session.warm_up())
    demo = build_app(session, buttons=list(cfg.buttons), ks=list(cfg.ks), idle_minutes=cfg.idle_minutes,
                     cache_seconds=cfg.cache_seconds, **page_controls(data_action_space(cfg.data)))
    port = serving_port(cfg.host, int(cfg.port))
    log.info("mcar.play: %s, context %d frames, k=%d, temperature %g, at most %s games: http://%s:%d", cfg.ckpt,
             session.context, session.k, session.temperature, cfg.max_games, cfg.host, port)
    serve(demo, cfg.host, port, block=block)
    return demo, session


def stop_note(cfg: DictConfig) -> str:
    """Play's stop line: the page is gone and games are not saved; the command that serves it again."""
    import shlex

    from mcar.hydra_app import command_line_overrides

    again = shlex.join(["mcar", "play", *command_line_overrides()])
    return f"the page on {cfg.host} is closed (games are not saved); serve it again with: {again}"


@hydra_tool("play")
def main(cfg: DictConfig) -> None:
    with on_stop_say(lambda: stop_note(cfg)):
        play(cfg)
