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
        ["moe.top_k=1", "--config", TINY, "--print-config"],  # an override first: still train
    ],
    ids=["default", "explicit-train", "override-then-config"],
)
def test_train_is_the_default_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(argv) == 0
    assert "  top_k: 1\n" in capsys.readouterr().out


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"\n  {name} " in out, name
    assert "moetrain --config configs/tiny.yaml" in out
    # What a terminal shows: no reStructuredText or Markdown markup.
    assert "``" not in out and "`" not in out, out


@pytest.mark.parametrize(
    "argv",
    [[], ["moe.top_k=1"], ["--print-config"], ["train"]],
    ids=["bare", "override-only", "print-config", "train-word"],
)
def test_training_without_a_config_is_an_error_naming_how_to_start(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """No silent run of the dataclasses' defaults: exit 2, nothing written, the way to start."""
    assert cli_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("moetrain: no --config given; nothing was run."), err
    assert "moetrain --config configs/tiny.yaml" in err


def test_torchrun_entry_point_needs_a_config_too() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "moetrain.train", "moe.top_k=1"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no --config given" in result.stderr


def _options_without_help(command_main) -> list[str]:
    """The options (and positionals) that ``command_main(["--help"])``'s parsers list without
    a help text (argparse prints such an option as its bare name)."""
    import argparse

    seen: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_known_args  # what every parse_* method calls

    def record(self, *args, **kwargs):
        seen.append(self)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_known_args", record)
        with pytest.raises(SystemExit):
            command_main(["--help"])
    assert seen, "no parser ran"
    return [
        action.option_strings[0] if action.option_strings else action.dest
        for parser in seen
        for action in parser._actions
        if not action.help and not isinstance(action, argparse._HelpAction)
    ]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_has_help_text(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    missing = _options_without_help(COMMANDS[command])
    capsys.readouterr()
    assert not missing, f"moetrain {command}: no help text for {missing}"


def test_help_text_check_can_fail(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    def bare(argv):
        parser = argparse.ArgumentParser()
        parser.add_argument("--explained", help="what it does")
        parser.add_argument("--bare")
        return parser.parse_args(argv)

    assert _options_without_help(bare) == ["--bare"]
    capsys.readouterr()
