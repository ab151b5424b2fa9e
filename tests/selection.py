"""Whether a pytest run asks for the exhaustive tests (the full equivalence matrix).

They run only when ``-m`` names ``slow`` or ``exhaustive`` and selects a test carrying their
marks (``exhaustive``, ``slow``, ``multirank``): ``-m slow`` and ``-m exhaustive`` do, the
default run and ``-m "not slow and not multirank"`` (the fast subset) do not, so neither
computes the design (a minute of collection on two cores).
"""

from __future__ import annotations

from typing import Any

EXHAUSTIVE_MARKS = frozenset({"exhaustive", "slow", "multirank"})


def asks_for_exhaustive(config: Any) -> bool:
    expr = config.getoption("markexpr") or ""
    if "slow" not in expr and "exhaustive" not in expr:
        return False
    try:
        from _pytest.mark.expression import Expression

        return bool(Expression.compile(expr).evaluate(lambda name, **_: name in EXHAUSTIVE_MARKS))
    except Exception:  # pytest's expression parser is not public API: its old reading
        return True
