"""A pytest plugin that prints each failure (its test id and traceback) the moment it is
reported, with pytest-xdist too: a run stopped at a time limit, as scripts/gpu-check stops its
steps, never prints pytest's closing summary, and so would not name what failed."""

from __future__ import annotations

import sys

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        sys.stdout.write(f"\n=== FAILED {report.nodeid} ({report.when})\n"
                         f"{report.longreprtext}\n=== end of {report.nodeid}\n")
        sys.stdout.flush()
