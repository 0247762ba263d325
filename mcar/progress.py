"""Progress a person can read in a pipe or a log file: each redraw of a progress bar a line of its own."""
from __future__ import annotations

import contextlib
import os
import re
import sys

CURSOR_MOVES = re.compile(r"\x1b\[[0-9;]*[A-HJK]")  # tqdm's nested bars move the cursor up and clear lines


class LineProgress:
    """stdout / stderr going to a pipe or a file: each in-place redraw of a progress bar (a carriage return) becomes
    a line of its own and cursor moves are dropped, so `mcar generate ... > generate.log` reads top to bottom
    instead of as one 30 kB line; a log line written while a bar's line is open (on this stream or a peer's: stdout
    and stderr into one file) starts on a line of its own."""

    def __init__(self, stream, peers: list | None = None):
        self._stream, self._line_start, self._bar_open = stream, True, False
        self._peers = peers if peers is not None else []  # the streams sharing a terminal or a log file
        self._peers.append(self)

    def write(self, text: str) -> int:
        if text and not text.startswith(("\r", "\n")):  # a log line: a bar's open line (any stream's) ends first
            for peer in self._peers:
                if peer._bar_open:
                    peer._stream.write("\n")
                    peer._stream.flush()
                    peer._line_start, peer._bar_open = True, False
        out = []
        for i, piece in enumerate(CURSOR_MOVES.sub("", text).split("\r")):
            if i and not self._line_start:
                out.append("\n")
                self._line_start = True
            if piece:
                out.append(piece)
                self._line_start = piece.endswith("\n")
        self._bar_open = "\r" in text and not self._line_start
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
    saved, peers = {n: getattr(sys, n) for n in names}, []
    for n in names:
        setattr(sys, n, LineProgress(saved[n], peers))
    if names:
        os.environ.setdefault("TQDM_MININTERVAL", "5")
    try:
        yield
    finally:
        for n in names:
            setattr(sys, n, saved[n])
