"""``-m`` expressions that ask for the exhaustive matrix, and those that do not."""

from __future__ import annotations

import pytest
from selection import asks_for_exhaustive


class _Config:
    def __init__(self, expr: str) -> None:
        self.expr = expr

    def getoption(self, name: str) -> str:
        assert name == "markexpr"
        return self.expr


@pytest.mark.parametrize(
    "expr, asks",
    [
        ("", False),  # the default run: CI and the README's test command
        ("not slow and not multirank", False),  # the fast subset
        ("not slow", False),
        ("multirank", False),  # names neither slow nor exhaustive
        ("slow", True),
        ("exhaustive", True),
        ("slow or exhaustive", True),
        ("multirank and slow", True),
    ],
)
def test_which_runs_ask_for_the_exhaustive_matrix(expr: str, asks: bool) -> None:
    assert asks_for_exhaustive(_Config(expr)) is asks
