"""The ``moetrain`` command line: command words, the default train command, unknown words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.cli import COMMANDS
from moetrain.cli import main as cli_main

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.mark.parametrize("word", ["no-such-command", "trian", "prepare_data"])
def test_unknown_command_is_an_error_naming_the_commands(
    word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main([word, "--help"]) == 2
    out, err = capsys.readouterr()
    assert out == "", "an unknown command must not run another command's parser"
    assert err.startswith(f"moetrain: unknown command {word!r}; commands are "), err
    for name in COMMANDS:
        assert name in err, f"{name} missing from: {err}"
    assert err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", TINY, "--print-config", "moe.top_k=1"],  # no command word: train
        ["train", "--config", TINY, "--print-config", "moe.top_k=1"],
        ["moe.top_k=1", "--print-config"],  # an override first: still train
        ["moe.top_k=1", "--config", TINY, "--print-config"],
    ],
    ids=["default", "explicit-train", "override-first", "override-then-config"],
)
def test_train_is_the_default_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(argv) == 0
    assert "  top_k: 1\n" in capsys.readouterr().out


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "commands: " + ", ".join(COMMANDS) in out


def test_console_entry_point_refuses_unknown_command() -> None:
    """Through ``python -m moetrain`` (what the ``moetrain`` script runs), exit status 2."""
    result = subprocess.run(
        [sys.executable, "-m", "moetrain", "no-such-command", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "unknown command 'no-such-command'" in result.stderr
    assert "usage:" not in result.stdout
