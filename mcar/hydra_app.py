"""How every mcar tool meets Hydra: the packaged configs (`pkg://mcar.conf`), the OmegaConf resolvers they use,
registered explicitly by each entry point.

`hydra_tool(name)` makes a tool's `main(argv=None)` from its job function (conf/<name>.yaml, Hydra's run dirs,
multirun and `--cfg`); `compose_tool(name, argv)` composes conf/<name>.yaml without run dirs, for the small tools
(convert, tokenize, crafter_gen, vq_eval, vq_patches) whose output goes where `out=` says.
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import math
import os
import re
import shutil
import sys
from pathlib import Path

from hydra.errors import HydraException, InstantiationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mcar.assets import asset_path
from mcar.config_checks import check_before_run
from mcar.progress import readable_progress
from mcar.stopping import stop_signals_end

CONFIG_PATH = "pkg://mcar.conf"
CONF_DIR = Path(__file__).resolve().parent / "conf"  # the same packaged configs, as files
COMPOSE_ERRORS = (HydraException, OmegaConfBaseException)  # a composition that failed: a bad override


def trainer_precision(*args):
    """conf's `${mcar_precision:}` (mcar.core.precision; torch imported on first use: `--help` needs no torch)."""
    from mcar.core.precision import trainer_precision as precision

    return precision(*args)


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


def exit_on_help(config_name: str, args: list[str]) -> None:
    """`-h` / `--help` among the arguments: the tool's help (mcar.tool_help), then exit 0."""
    if any(a in ("-h", "--help") for a in args):
        from mcar.tool_help import usage_exit  # it reads CONF_DIR from here

        usage_exit(config_name)


def compose_tool(config_name: str, argv: list[str] | None = None) -> DictConfig:
    """conf/<config_name>.yaml with the command line's Hydra overrides (`key=value`, `group=option`)."""
    from hydra import compose, initialize_config_module

    args = sys.argv[1:] if argv is None else list(argv)
    exit_on_help(config_name, args)
    register_resolvers()
    try:
        with initialize_config_module(version_base="1.3", config_module="mcar.conf"):
            cfg = compose(config_name, overrides=args)
    except COMPOSE_ERRORS as e:
        raise SystemExit(override_error(config_name, args, e)) from None
    missing = sorted(k for k in cfg if OmegaConf.is_missing(cfg, k))
    if missing:
        raise SystemExit(f"mcar {config_name}: give {', '.join(k + '=...' for k in missing)} "
                         f"(conf/{config_name}.yaml has no default for {'them' if len(missing) > 1 else 'it'})")
    check_before_run(config_name, cfg=cfg)
    return cfg


def override_error(config_name: str, args: list[str], e: BaseException) -> str:
    """A failed composition -> one line naming the override and the fix: an unknown key gets the keys of that
    name or spelling the config has (`trainer.max_step` -> trainer.max_steps, `optim.warmup_steps` ->
    lr_schedule.warmup_steps), an unknown group option the options (`model=70m` -> 700m)."""
    text = str(e)
    option = re.search(r"Could not find '([\w./-]+)/([^'/]+)'", text)
    if option:
        group, name = option.groups()
        options = list(getattr(e, "options", None) or sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
        guess = f"did you mean {group}={close[0]}? " if close else ""
        return f"mcar {config_name}: {group}={name}: conf/{group}/ has no {name}.yaml; {guess}(options: " \
               f"{', '.join(options)})"
    key = re.search(r"Could not override '([^']+)'", text)
    if key:
        key = key.group(1)
        given = next((a for a in args if a.split("=", 1)[0] == key), key)
        keys = config_keys(config_name, args)
        own = [k.rsplit(".", 1)[1] for k in keys if k.rsplit(".", 1)[0] == key]
        if key in keys and own:  # the key is there: the mapping given names keys it does not have
            return f"mcar {config_name}: {given}: {key} has the keys {', '.join(own)}; set those " \
                   f"({key}.{own[0]}=...), or add a key with +{key}.<name>=..."
        close = similar_keys(key, keys)
        if close:
            return f"mcar {config_name}: {given}: conf/{config_name}.yaml has no key {key}; did you mean " \
                   f"{' or '.join(close)}?"
        return f"mcar {config_name}: {given}: conf/{config_name}.yaml has no key {key} and none like it " \
               f"(`mcar {config_name} --cfg job` prints them all; +{given} would add it)"
    word = re.search(r"Error parsing override '([^'=]+)'\s+missing EQUAL", text)
    if word:
        return f"mcar {config_name}: {word.group(1)}: an override is key=value (the keys: conf/{config_name}.yaml)"
    return f"mcar {config_name}: " + " ".join(line.strip() for line in text.splitlines() if line.strip())


def config_keys(config_name: str, args: list[str]) -> list[str]:
    """Every dotted key of conf/<config_name>.yaml composed with the group choices of `args` (not hydra's)."""
    from hydra import compose, initialize_config_module

    groups = [a for a in args if "=" in a and not a.startswith(("-", "+", "~")) and "," not in a
              and (CONF_DIR / a.split("=", 1)[0].split("@")[0]).is_dir()]
    try:
        with initialize_config_module(version_base="1.3", config_module="mcar.conf"):
            cfg = OmegaConf.to_container(compose(config_name, overrides=groups), resolve=False)
    except COMPOSE_ERRORS:
        return []

    def walk(node, prefix):
        for k, v in node.items():
            yield prefix + str(k)
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")

    return list(walk(cfg, ""))


def similar_keys(key: str, keys: list[str]) -> list[str]:
    """Keys spelt like `key`, then keys of the same last name elsewhere (a key that moved group); at most 3."""
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.8)
    moved = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != key]
    return list(dict.fromkeys(close + moved))[:3]


def hydra_tool(config_name: str, words=None):
    """Decorator: a job function taking the composed config -> the tool's `main(argv=None)` under @hydra.main
    (conf/<config_name>.yaml). `words` rewrites the arguments first (e.g. bench's mode as a bare first word)."""
    import hydra

    def wrap(job):
        user = {"full_error": None}  # the user's HYDRA_FULL_ERROR, which the job runs under
        app = hydra.main(version_base="1.3", config_path=CONFIG_PATH,
                         config_name=config_name)(said_plainly(job, lambda: user["full_error"]))

        @functools.wraps(job)
        def main(argv: list[str] | None = None):
            args = sys.argv[1:] if argv is None else list(argv)
            exit_on_help(config_name, args)  # the conf files as written, in seconds (not Hydra's dump)
            args = words(args) if words else args
            saved, sys.argv = sys.argv, [sys.argv[0], *args]
            register_resolvers()
            check_before_run(config_name, args)  # a refused value leaves no run folder
            user["full_error"] = os.environ.get("HYDRA_FULL_ERROR")
            os.environ["HYDRA_FULL_ERROR"] = "1"  # a failed composition reaches us (said in one line, below)
            try:
                with readable_progress(), stop_signals_end(config_name):
                    return app()
            except COMPOSE_ERRORS as e:  # the job's own errors went through Hydra's handler (said_plainly)
                if user["full_error"] == "1":
                    raise
                raise SystemExit(override_error(config_name, args, e)) from None
            finally:
                sys.argv = saved
                restore_env("HYDRA_FULL_ERROR", user["full_error"])

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
    except (*SAID_PLAINLY, InstantiationException) as caught:
        e = caught.__cause__ if isinstance(caught, InstantiationException) else caught  # ours, inside Hydra's call
        if not isinstance(e, SAID_PLAINLY):
            raise
        said = path_given(e)  # the OS refusing a path the command line gave: the user's to fix, said as such
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or not (raised_by_mcar(e) or said):
            raise
        print(f"Error: {said or field_named(e)}\n(the traceback: HYDRA_FULL_ERROR=1)", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def given_overrides() -> list[str]:
    """key=value words of the command line (Hydra's job overrides, or argv for the tools that compose themselves)."""
    return [o for o in [*command_line_overrides(), *sys.argv[1:]] if "=" in o]


def path_given(e: BaseException) -> str | None:
    """An OSError on a path under one a key=value of the command line gave -> 'key=value: <the OS's reason>'."""
    name = getattr(e, "filename", None)
    if not isinstance(e, OSError) or not name:
        return None
    for o in given_overrides():
        value = o.split("=", 1)[1]
        inside = [value.rstrip("/") + "/", str(name).rstrip("/") + "/"]  # a path in the given one, or above it
        if value and "/" in value and (str(name) == value or str(name).startswith(inside[0])
                                       or value.startswith(inside[1])):
            return f"{o}: {e.strerror or e} ({name})"
    return None


NOT_A_NUMBER = re.compile(r"invalid literal for int\(\) with base \d+: '(.*)'"
                          r"|could not convert string to float: '(.*)'")


def field_named(e: BaseException) -> str:
    """A conversion error of a value the command line gave (int('abc') in a tool) said with its key=value: the
    message itself names no field."""
    m = NOT_A_NUMBER.fullmatch(str(e))
    if m is None:
        return str(e)
    value = m.group(1) if m.group(1) is not None else m.group(2)
    given = [o for o in given_overrides() if o.split("=", 1)[1] == value]
    if not given:
        return str(e)
    key = given[0].split("=", 1)[0].lstrip("+~")
    return f"{given[0]}: {key} takes a number, not {value!r}"


def restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def said_plainly(job, user_full_error=lambda: None):
    """`job` under plain_errors (inside @hydra.main, before Hydra's own handler sees the error), with the user's
    HYDRA_FULL_ERROR; a job that fails before writing anything leaves no run folder (remove_unused_run_dir)."""

    @functools.wraps(job)
    def run(cfg):
        restore_env("HYDRA_FULL_ERROR", user_full_error())
        try:
            with plain_errors():
                return job(cfg)
        except BaseException:
            remove_unused_run_dir()
            raise

    return run


def close_file_logs_in(folder: Path) -> None:
    """Close and detach every logging file handler writing into `folder`."""
    import logging

    folder = folder.resolve()
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", [])):
            name = getattr(handler, "baseFilename", None)
            if name and Path(name).resolve().is_relative_to(folder):
                logger.removeHandler(handler)
                handler.close()


def remove_unused_run_dir() -> None:
    """Hydra's fresh run folder (outputs/<task>/<time>/) of a failed job, when it holds nothing but Hydra's own
    log of the job and its config record (.hydra/), is removed: a command refused before its work leaves no
    folder that looks like a run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.RUN:
        return
    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    if out.is_dir() and out.resolve() != Path.cwd().resolve() and \
            {p.name for p in out.iterdir()} <= {f"{hc.job.name}.log", hc.output_subdir or ".hydra"}:
        close_file_logs_in(out)  # Hydra's job log would be reopened, in a folder gone, by the next log line
        shutil.rmtree(out, ignore_errors=True)
        cwd = Path.cwd().resolve()
        for parent in out.resolve().parents:  # outputs/<task>/ too (under the working folder), when it held only this
            if parent == cwd or not parent.is_relative_to(cwd) or not parent.is_dir() or any(parent.iterdir()):
                break
            parent.rmdir()


def command_line_overrides() -> list[str]:
    """The Hydra job's command-line overrides, in their order ([] outside a Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


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
