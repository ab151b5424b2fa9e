"""A pytest plugin that writes each failing test's message the moment it fails.

    python -m pytest -p pytest_live_failures ...      # tools/ on PYTHONPATH

pytest prints failure tracebacks in its summary at the end of the session (`-rfE` too), so a
run killed at its time budget (the GPU suite's `tests` part) loses every message. This plugin
writes, as each report arrives, one line `LIVE <OUTCOME> <nodeid> (<phase>)` for every test
outcome (so a log cut short still counts what ran) and, for a failure or an error, the
report's text (`--tb` decides its length) between `LIVE-FAILURE-BEGIN` / `LIVE-FAILURE-END`
markers. Under pytest-xdist the hook runs in the controller, which receives every worker's
reports as they finish: the lines stream there too.
"""

from __future__ import annotations

import pytest

MAX_CHARS = 6000  # of one failure's text: its end, where the assertion is
_terminal = None


def pytest_configure(config: pytest.Config) -> None:
    global _terminal
    _terminal = config.pluginmanager.get_plugin("terminalreporter")


def _write(line: str) -> None:
    if _terminal is not None:
        _terminal.ensure_newline()
        _terminal.write_line(line, flush=True)
    else:  # pragma: no cover - pytest always has a terminal reporter unless -p no:terminal
        print(line, flush=True)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.failed or (report.skipped and report.when == "setup"):
        outcome = report.outcome.upper()
        if report.failed and report.when != "call":
            outcome = "ERROR"
        _write(f"LIVE {outcome} {report.nodeid} ({report.when})")
    if report.failed:
        text = report.longreprtext
        if len(text) > MAX_CHARS:
            text = "...\n" + text[-MAX_CHARS:]
        _write(f"LIVE-FAILURE-BEGIN {report.nodeid} ({report.when})")
        for line in text.splitlines():
            _write(line)
        _write(f"LIVE-FAILURE-END {report.nodeid}")
