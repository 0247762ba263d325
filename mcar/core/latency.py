"""The one home of the speed statistics mcar reports (docs/speed.md defines them): percentiles of latencies, the
share of frames that met a deadline, frames per second. Plain Python on lists of seconds, so every bench, the
evaluation's FPS column and the GPU check compute them the same way."""
from __future__ import annotations

import math
from collections.abc import Sequence

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linearly interpolated between the two nearest ranks (numpy's
    default 'linear' method); nan for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q}: must be within 0..100")
    ordered = sorted(float(v) for v in values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def deadline_attainment(latencies: Sequence[float], rate: float) -> float:
    """The share of frames that arrived within 1 / rate seconds of their action (rate: the target frames/s);
    nan for no frames."""
    if rate <= 0:
        raise ValueError(f"deadline rate={rate}: a target rate is frames per second, > 0")
    if not latencies:
        return math.nan
    deadline = 1.0 / rate
    return sum(float(x) <= deadline for x in latencies) / len(latencies)


def latency_summary(latencies: Sequence[float], rate: float | None = None, ndigits: int = 4) -> dict:
    """Action-to-frame latencies (seconds) -> {"frames", "p50_s", "p95_s", "p99_s", "mean_s", "max_s"} and, given
    a target rate, "deadline_rate" and "deadline_attainment" (docs/speed.md)."""
    values = [float(x) for x in latencies]
    out = {"frames": len(values)}
    for q in PERCENTILES:
        out[f"p{q}_s"] = round(percentile(values, q), ndigits)
    out["mean_s"] = round(sum(values) / len(values), ndigits) if values else math.nan
    out["max_s"] = round(max(values), ndigits) if values else math.nan
    if rate is not None:
        out["deadline_rate"] = float(rate)
        out["deadline_attainment"] = round(deadline_attainment(values, rate), ndigits)
    return out


def frames_per_second(frames: int, seconds: float) -> float:
    """Frames over the wall-clock seconds they took (inf-safe: 0 s counts as 1e-9 s)."""
    return frames / max(float(seconds), 1e-9)


def seconds_since_process_start() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat against the boot time); None elsewhere."""
    import os
    import time

    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, StopIteration, IndexError):
        return None
    return time.time() - (boot + started_ticks / os.sysconf("SC_CLK_TCK"))
