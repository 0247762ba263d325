"""Stop signals end a run within seconds, in every phase: SIGTERM (SLURM, `docker stop`, `timeout`) and SIGINT
(Ctrl-C) raise `Stopped` in the main thread wherever it is (data build, training, validation sampling, the
end-of-run measurement). Work already written stays: checkpoints and token shards are written whole or not at all
(a write cut short leaves the previous file), so `ckpt_path=last` resumes. The process exits with 128 + the
signal's number (143 for SIGTERM, 130 for SIGINT), as a shell reports a killed command.

Lightning keeps its own SIGTERM handling (it calls this one after its own), so a SLURM requeue still saves its
checkpoint on the cluster's requeue signal first."""
from __future__ import annotations

import contextlib
import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """A stop signal arrived (a BaseException: no `except Exception` on the way swallows it). `kept`: what the job
    that stopped says it leaves behind and how to go on (set on the way out by `on_stop_say`)."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.kept: str | None = None
        super().__init__(f"stopped by {signal.Signals(self.signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_OWNER: list[int] = []  # the pid that installed the handlers (forked workers inherit them)


def _raise_stopped(signum, frame) -> None:
    if _OWNER and os.getpid() != _OWNER[-1]:  # a forked worker (data build, loader): it just ends, by the signal
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise Stopped(signum)


@contextlib.contextmanager
def stopping_on_signals():
    """Within: SIGTERM and SIGINT raise Stopped (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, _raise_stopped)
    _OWNER.append(os.getpid())
    try:
        yield
    finally:
        _OWNER.pop()
        for s, handler in before.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def on_stop_say(kept):
    """Within: a stop's line says `kept` (a string, or a function called at the stop that returns one: what the job
    leaves, e.g. its checkpoint and the command that resumes it). The innermost job's word wins."""
    try:
        yield
    except Stopped as e:
        if e.kept is None:
            try:
                e.kept = kept() if callable(kept) else str(kept)
            except Exception as err:  # noqa: BLE001  the stop must not fail on its message
                e.kept = f"finished work kept ({type(err).__name__} while naming it)"
        raise


@contextlib.contextmanager
def stop_signals_end(tool: str):
    """A tool's run: a stop signal raises Stopped inside, and out here becomes one line (what the job said it
    keeps, `on_stop_say`) and the exit status."""
    import sys

    try:
        with stopping_on_signals():
            yield
    except Stopped as e:
        print(f"mcar {tool}: {e}: {e.kept or 'finished work kept'}", file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
