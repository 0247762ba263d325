"""A line of progress for a test run under xdist (whose dots say neither a count nor the time): every 10% of the
tests, '-- 120/855 tests (14%), 1 failed, in 1.4 min, ~8.5 min left'. Registered by tests/conftest.py."""
from __future__ import annotations

import time

import pytest

STEP_PERCENT = 10


def progress_line(done: int, total: int, seconds: float, failed: int = 0) -> str:
    left = f", ~{seconds * (total - done) / done / 60:.1f} min left" if 0 < done < total else ""
    bad = f", {failed} failed" if failed else ""
    return f"-- {done}/{total} tests ({100 * done // max(total, 1)}%){bad}, in {seconds / 60:.1f} min{left}"


class ProgressLine:
    """On the xdist controller: counts finished tests against the collected total, writes a line at each 10%."""

    def __init__(self, config):
        self.config, self.total, self.done, self.failed, self.said = config, 0, 0, 0, 0
        self.t0 = time.perf_counter()

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.total = max(self.total, len(ids))

    def pytest_runtest_logreport(self, report):
        if not self.total or report.when != "teardown":
            self.failed += report.failed and report.when == "call"
            return
        self.done += 1
        percent = 100 * self.done // self.total
        if percent // STEP_PERCENT > self.said and self.done < self.total:
            self.said = percent // STEP_PERCENT
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                if getattr(reporter._tw, "width_of_current_line", 0):  # after xdist's dots (ensure_newline misses them)
                    reporter.write("\n")
                reporter.write_line(progress_line(self.done, self.total, time.perf_counter() - self.t0,
                                                  self.failed))
