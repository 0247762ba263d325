"""How every mcar tool meets Hydra: the packaged configs (`pkg://mcar.conf`), the OmegaConf resolvers they use,
registered explicitly by each entry point, and the old `--flag value` spelling of the tools that had argparse.

`hydra_tool(name)` makes a tool's `main(argv=None)` from its job function (conf/<name>.yaml, Hydra's run dirs,
multirun and `--cfg`); `compose_tool(name, argv)` composes conf/<name>.yaml without run dirs, for the small tools
(convert, tokenize, crafter_gen, vq_eval, vq_patches) whose output goes where `out=` says.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mcar.core.precision import trainer_precision

CONFIG_PATH = "pkg://mcar.conf"
CONF_DIR = Path(__file__).resolve().parent / "conf"  # the same packaged configs, as files


def asset_path(name: str) -> str:
    """The absolute path of a committed asset folder, mcar/assets/<name> (conf: `${mcar_asset:vq_crafter_tiles}`)."""
    assets = Path(__file__).parent / "assets"
    if not (assets / name).is_dir():
        raise FileNotFoundError(f"no committed asset {name!r} in {assets} (there: "
                                f"{sorted(p.name for p in assets.iterdir() if p.is_dir())})")
    return str(assets / name)


def relocated_asset(value):
    """A path into another install's mcar/assets/<name> (a checkpoint's config, made on another machine or
    clone) -> this install's asset of that name; anything else unchanged."""
    if not isinstance(value, str) or "/" not in value:
        return value
    p = Path(value)
    if p.exists() or p.parent.name != "assets" or p.parent.parent.name != "mcar":
        return value
    try:
        return asset_path(p.name)
    except FileNotFoundError:
        return value


def register_resolvers() -> None:
    """The `${mcar_...:}` resolvers of conf/: every entry point calls this before Hydra composes (idempotent)."""
    for name, fn in {"mcar_sum": lambda *xs: sum(int(x) for x in xs),
                     "mcar_prod": lambda *xs: math.prod(int(x) for x in xs), "mcar_precision": trainer_precision,
                     "mcar_min_positive": lambda *xs: min(int(x) for x in xs if int(x) > 0),
                     "mcar_asset": asset_path}.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def to_dict(cfg: DictConfig | dict | None) -> dict:
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg)


def legacy_flags(argv: list[str], positional: tuple[str, ...] = ()) -> list[str]:
    """Old argparse spellings -> Hydra overrides: `--min-frames 8` -> `min_frames=8`, `--size 224 384` ->
    `size=[224,384]`, a bare `--keep-null` -> `keep_null=true`, and bare words -> the named `positional` keys.
    Hydra overrides (`key=value`) pass through, so both spellings mix in one command."""
    out, words, i = [], list(positional), 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and len(arg) > 2 and "=" not in arg:
            values = []
            while i + 1 < len(argv) and not argv[i + 1].startswith("--") and "=" not in argv[i + 1]:
                values.append(argv[i + 1])
                i += 1
            key = arg[2:].replace("-", "_")
            out.append(f"{key}=" + ("true" if not values else values[0] if len(values) == 1
                                    else "[" + ",".join(values) + "]"))
        elif arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
            out.append(f"{key.replace('-', '_')}={value}")
        elif "=" not in arg and words:
            out.append(f"{words.pop(0)}={arg}")
        else:
            out.append(arg)
        i += 1
    return out


def compose_tool(config_name: str, argv: list[str] | None = None, positional: tuple[str, ...] = ()) -> DictConfig:
    """conf/<config_name>.yaml with the command line's overrides (Hydra syntax, or the old `--flags`)."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = legacy_flags(sys.argv[1:] if argv is None else list(argv), positional)
    if any(a in ("-h", "help=true") for a in args):
        raise SystemExit(f"usage: mcar {config_name} key=value ... (the keys and their defaults: "
                         f"{Path(__file__).parent / 'conf' / (config_name + '.yaml')})")
    register_resolvers()
    try:
        with initialize_config_module(version_base="1.3", config_module="mcar.conf"):
            cfg = compose(config_name, overrides=args)
    except (HydraException, OmegaConfBaseException) as e:  # an unknown key or group: say which, no traceback
        raise SystemExit(f"mcar {config_name}: {e}") from e
    missing = sorted(k for k in cfg if OmegaConf.is_missing(cfg, k))
    if missing:
        raise SystemExit(f"mcar {config_name}: give {', '.join(k + '=...' for k in missing)} "
                         f"(conf/{config_name}.yaml has no default for {'them' if len(missing) > 1 else 'it'})")
    return cfg


CURSOR_MOVES = re.compile(r"\x1b\[[0-9;]*[A-HJK]")  # tqdm's nested bars move the cursor up and clear lines


class LineProgress:
    """stdout / stderr going to a pipe or a file: each in-place redraw of a progress bar (a carriage return) becomes
    a line of its own and cursor moves are dropped, so `mcar generate ... > generate.log` reads top to bottom
    instead of as one 30 kB line."""

    def __init__(self, stream):
        self._stream, self._line_start = stream, True

    def write(self, text: str) -> int:
        out = []
        for i, piece in enumerate(CURSOR_MOVES.sub("", text).split("\r")):
            if i and not self._line_start:
                out.append("\n")
                self._line_start = True
            if piece:
                out.append(piece)
                self._line_start = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def __getattr__(self, name):  # flush, fileno, isatty, encoding, ...: the stream's own
        return getattr(self._stream, name)


@contextlib.contextmanager
def readable_progress():
    """While a tool runs, stdout and stderr (tqdm draws on one, Lightning's bar on the other) that are not a
    terminal show progress redraws as lines (LineProgress), at most one every 5 s per data bar (tqdm's
    TQDM_MININTERVAL, unless set; the training bar redraws every log_every_n_steps)."""
    names = [n for n in ("stdout", "stderr") if not getattr(sys, n).isatty()
             and not isinstance(getattr(sys, n), LineProgress)]
    saved = {n: getattr(sys, n) for n in names}
    for n in names:
        setattr(sys, n, LineProgress(saved[n]))
    if names:
        os.environ.setdefault("TQDM_MININTERVAL", "5")
    try:
        yield
    finally:
        for n in names:
            setattr(sys, n, saved[n])


def hydra_tool(config_name: str, words=None):
    """Decorator: a job function taking the composed config -> the tool's `main(argv=None)` under @hydra.main
    (conf/<config_name>.yaml). `words` rewrites the arguments first (e.g. bench's mode as a bare first word)."""
    import hydra

    def wrap(job):
        app = hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)(said_plainly(job))

        @functools.wraps(job)
        def main(argv: list[str] | None = None):
            args = sys.argv[1:] if argv is None else list(argv)
            args = words(args) if words else args
            saved, sys.argv = sys.argv, [sys.argv[0], *args]
            register_resolvers()
            try:
                with readable_progress():
                    return app()
            finally:
                sys.argv = saved

        main.job = job  # the undecorated job, for callers that compose the config themselves
        return main

    return wrap


SAID_PLAINLY = (ValueError, OSError, RuntimeError)  # what mcar raises with a message that says what to fix


def raised_by_mcar(e: BaseException) -> bool:
    """The exception comes from a `raise` in mcar's own code (not from inside torch, Lightning, ...)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(Path(__file__).parent)


@contextlib.contextmanager
def plain_errors():
    """Our own errors end the command with their message only (Hydra would print a traceback and its
    HYDRA_FULL_ERROR hint around it); HYDRA_FULL_ERROR=1 shows the full traceback, and errors from inside the
    libraries keep theirs."""
    try:
        yield
    except SAID_PLAINLY as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or not raised_by_mcar(e):
            raise
        print(f"Error: {e}\n(the traceback: HYDRA_FULL_ERROR=1)", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def said_plainly(job):
    """`job` under plain_errors (inside @hydra.main, before Hydra's own handler sees the error)."""

    @functools.wraps(job)
    def run(cfg):
        with plain_errors():
            return job(cfg)

    return run


def hydra_job() -> tuple[bool, int, str]:
    """(is multirun, job number, group name) of the current Hydra job; (False, 0, 'mcar') outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False, 0, "mcar"
    hc = HydraConfig.get()
    multi = hc.mode == RunMode.MULTIRUN
    group = Path(hc.sweep.dir).name if multi else hc.job.name
    return multi, hc.job.num if multi else 0, group
