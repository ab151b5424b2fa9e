"""The shell commands a Markdown page shows: what tests/test_docs.py parses and
tests/test_readme_chain.py runs.

A command is a line of a fenced block marked ``bash``, ``sh``, ``shell`` or ``console``;
a fence without a language holds a diagram, a file tree or output, never a command
(``unlabeled_commands`` finds a command left in one, so none hides from the checks).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

SHELL = {"bash", "sh", "shell", "console"}
PROGRAMS = ("moetrain", "python", "python3", "torchrun", "pip", "bash", "tensorboard", "git")
"""First words of the commands the docs show: a line starting with one of them, at the start
of a line of a fence that is not a shell fence, is a command in the wrong fence."""
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")


def blocks(page: Path) -> Iterator[tuple[int, str | None, str]]:
    """(line number, fence language or None outside a fence, line) for every line."""
    lang: str | None = None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            lang = (fence.group(2) or "") if lang is None else None
            continue
        yield number, lang, line


def commands(page: Path) -> Iterator[tuple[int, list[str]]]:
    """(line, argv) of every command in a shell code block; continuation lines joined,
    comments dropped, ``&&`` / ``;`` chains split, leading ``VAR=value`` assignments removed."""
    pending, start = "", 0
    for number, lang, line in blocks(page):
        if lang not in SHELL:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full, pending = pending + line, ""
        try:
            words = shlex.split(full, comments=True)
        except ValueError:
            continue  # not shell (log output in a console block)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";", "||"):
                while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", command[0]):
                    command.pop(0)
                if command:
                    yield start, command
                command = []
            else:
                command.append(word)


def unlabeled_commands(page: Path) -> list[tuple[int, str]]:
    """Lines of a non-shell fence that start with a command: invisible to ``commands``."""
    return [
        (number, line)
        for number, lang, line in blocks(page)
        if lang is not None
        and lang not in SHELL
        and lang not in ("yaml", "yml", "python", "py")
        and line[:1].strip()
        and line.split()[0] in PROGRAMS
    ]
