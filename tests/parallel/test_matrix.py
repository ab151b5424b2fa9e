"""The equivalence matrix: every model and MoE option under every parallel layout.

The option factors live in tests/parallel/matrix_options.py, the layouts and the design in
tests/parallel/matrix_design.py. Each cell runs the micro MoE for ``STEPS`` steps under the
layout and compares it on every rank with the single-process run of the same options
(``check_cases`` of tests/multirank.py: losses, MoE statistics, every gradient of every
step, AdamW's moments, final parameters, and the layout facts), within ``TOLERANCES``.

- CI part: a pairwise covering design per layout -- every pair of option values that can
  go together meets every layout at least once (about 16 rows per layout, one spawned job
  per world size).
- Slow part (``-m slow``, deselected otherwise: tests/conftest.py): every row of the design
  under every layout where it is valid (the design's rows x the layouts).
- Refusals: a combination the code does not support is refused by config validation with a
  message naming the key; the design asks only for what validation accepts.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from pathlib import Path

import matrix_design as md
import pytest
from matrix_options import FACTORS
from multirank import Case, check_cases, expected_layout

WORLDS = (2, 4, 8)


def _cases(world: int, rows_for) -> list[Case]:
    return [
        Case(
            f"{layout.name} | {md.row_label(row)}",
            layout.overrides,
            md.BASE + md.row_overrides(row),
        )
        for layout in md.LAYOUTS
        if layout.world == world
        for row in rows_for(layout)
    ]


def test_design_covers_every_pair_of_option_values_under_every_layout() -> None:
    design = md.design()
    assert set(design) == set(md.LAYOUTS)
    for layout, rows in design.items():
        assert rows, f"{layout.name}: validation refuses every option row"
        for row in rows:
            assert md.refusal(row, layout) is None, (layout.name, md.row_label(row))
        covered = set().union(*(md._pairs(r) for r in rows))
        missing = md.coverable_pairs(layout) - covered
        assert not missing, (layout.name, sorted(missing)[:5])
        # Every value of every factor runs under every layout (unless validation refuses it
        # there, as tied embeddings under pp).
        for k, name in enumerate(md.NAMES):
            for v in range(md.LEVELS[k]):
                if any(
                    p[0] == k and p[1] == v or p[2] == k and p[3] == v
                    for p in md.coverable_pairs(layout)
                ):
                    assert any(r[k] == v for r in rows), (layout.name, name, v)
    print(
        f"{len(md.LAYOUTS)} layouts, {len(md.all_rows())} distinct option rows, "
        f"{sum(len(r) for r in design.values())} cells"
    )


def test_combinations_left_out_are_refused_by_validation_with_a_message() -> None:
    """A pair of values no valid row can hold under a layout is refused by config
    validation, and the message names the key -- never silently accepted and wrong."""
    key = re.compile(r"^[a-z_]+\.[a-z_]+: \S")
    for layout in md.LAYOUTS:
        coverable = md.coverable_pairs(layout)
        for i, j in itertools.combinations(range(len(md.LEVELS)), 2):
            for a, b in itertools.product(range(md.LEVELS[i]), range(md.LEVELS[j])):
                if (i, a, j, b) in coverable:
                    continue
                row = tuple(a if k == i else b if k == j else 0 for k in range(len(md.LEVELS)))
                reason = md.refusal(row, layout)
                assert reason is not None, (layout.name, md.row_label(row))
                if md.conflict(row) is None:
                    assert key.match(reason), (layout.name, md.row_label(row), reason)


def test_every_parallel_key_is_exercised_and_observable() -> None:
    """A ``parallel.*`` key the code silently ignored must fail a test: every key is set to
    a non-default value by some layout of the matrix, and that value changes the facts the
    layout check asserts (``expected_layout``), so running the layout without honouring the
    key would fail it. ``dp_shard`` is derived from the world size: an explicit value can
    only equal the derived one (a different one is refused, tests/parallel/test_dims.py)."""
    import dataclasses

    from moetrain.config import ParallelConfig

    # Every cell runs some option row: the baseline row's keys (train.micro_batch_size among
    # them) are what a key's effect is judged against.
    base = [*md.BASE, *md.row_overrides(tuple(0 for _ in md.NAMES))]
    for f in dataclasses.fields(ParallelConfig):
        if f.name == "dp_shard":
            continue
        witnesses = []
        # The layout alone, then under each option value the design pairs it with (a key
        # such as pp_microbatches only matters once the micro-batch size makes it differ
        # from the default).
        contexts = [[]] + [list(v) for values in FACTORS.values() for _, v in values]
        for layout in md.LAYOUTS:
            mine = [o for o in layout.overrides if o.startswith(f"parallel.{f.name}=")]
            if not mine:
                continue
            others = [o for o in layout.overrides if o not in mine]
            for extra in contexts:
                try:
                    with_key = expected_layout([*base, *extra, *layout.overrides],
                                               layout.world, 0)
                except Exception:  # noqa: BLE001 - this option value is refused here
                    continue
                try:
                    without = expected_layout([*base, *extra, *others], layout.world, 0)
                except Exception:  # noqa: BLE001 - the key is needed for the layout to exist
                    without = None
                if without != with_key:
                    witnesses.append((layout.name, extra))
                    break
        if f.name == "activation_checkpointing":
            # An option factor of the matrix rather than a layout: set by the rows.
            assert len(FACTORS["activation_checkpointing"]) == 3
            continue
        assert witnesses, f"parallel.{f.name}: no layout of the matrix shows it is honoured"


VALUE_ROWS_IN_CI = frozenset({
    "dp2 zero1",
    "dp2 zero2",
    "tp2 SP replicated experts",
    "pp2 gpipe",
    "ep2 shared experts overlapped with the all-to-all",
    "cp2 zero3, breadth-first passes of 2",
    "pp2 looped_bfs v2, 2 depth-first passes",
    "pp2 zbv, 2 pipeline micro-batches of 4",
    "pp2 dualpipev, 4 micro-batches",
})
"""Two-rank layouts that vary an axis the CI part already crosses pairwise with every option
(ZeRO-1/2 between ZeRO-0 and ZeRO-3, replicated experts beside expert TP, a schedule beside
1F1B / interleaved / zero-bubble, an overlap beside the plain all-to-all, ZeRO-3 and
breadth-first beside cp2): in CI they run the rows holding every option value, the rest of
their pairwise rows under ``-m exhaustive`` -- the suite's budget (342 two-rank cells took
7 min on two cores, the whole suite 24 min)."""


@functools.cache
def shared_value_rows(world: int) -> dict[str, tuple]:
    """The CI rows of the compositions on ``world`` ranks: every option value valid under
    some composition meets at least one of them, and every composition runs at least one
    row (its most covering one first). Chosen greedily over (layout, row) pairs of the
    layouts' ``value_rows``; the rest of each layout's pairwise rows runs under
    ``-m exhaustive``. (Every value under every composition took 5.5 min on two cores.)"""
    layouts = [layout for layout in md.LAYOUTS if layout.world == world]
    pairs = [(layout, row) for layout in layouts for row in md.value_rows(layout)]

    def values(row):
        return {(k, row[k]) for k in range(len(md.LEVELS))}

    left = set().union(*(values(row) for _, row in pairs))
    chosen: dict[str, list] = {layout.name: [] for layout in layouts}
    for layout in layouts:  # one row each, the most covering
        row = max(md.value_rows(layout), key=lambda r: len(values(r) & left))
        chosen[layout.name].append(row)
        left -= values(row)
    while left:
        layout, row = max(pairs, key=lambda p: len(values(p[1]) & left))
        chosen[layout.name].append(row)
        left -= values(row)
    return {name: tuple(rows) for name, rows in chosen.items()}


def _ci_rows(layout):
    if layout.world > 2:
        return shared_value_rows(layout.world)[layout.name]
    return md.value_rows(layout) if layout.name in VALUE_ROWS_IN_CI else md.design()[layout]


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_pairwise_design_under_every_two_rank_layout() -> None:
    """Every pair of option values meets every layout of one axis (dp with ZeRO 0-3, tp with
    and without SP and with replicated experts, pp with each schedule, ep with each
    dispatcher, cp) on two ranks; the variants in ``VALUE_ROWS_IN_CI`` meet every value."""
    assert VALUE_ROWS_IN_CI <= {layout.name for layout in md.LAYOUTS if layout.world == 2}
    check_cases(2, _cases(2, _ci_rows), md.STEPS, timeout=880)


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", (4, 8), ids=["4 ranks", "8 ranks"])
def test_every_option_value_under_every_composition(world: int) -> None:
    """Every option value meets some composition of axes on ``world`` ranks (HSDP, dp x tp,
    pp x dp, pp x tp, ep x tp, ep x edp, cp with tp / ep / pp, pp x dp x tp, pp x ep x tp,
    cp x dp x tp) and every composition runs (``shared_value_rows``). The rest of the pairwise
    design runs under ``-m exhaustive`` (``test_pairwise_design_under_every_composition``):
    16 rows a layout cost 3-11 s each on two cores, beyond the suite's budget."""
    check_cases(world, _cases(world, _ci_rows), md.STEPS, timeout=880)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world", (2, 4, 8), ids=["2 ranks", "4 ranks", "8 ranks"])
def test_pairwise_design_under_every_composition(world: int) -> None:
    design = md.design()

    def rest(layout):  # the pairwise rows the CI part did not run
        return [r for r in design[layout] if r not in _ci_rows(layout)]

    check_cases(world, _cases(world, rest), md.STEPS, timeout=3500)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world", WORLDS, ids=[f"{w} ranks" for w in WORLDS])
def test_every_row_under_every_layout(world: int) -> None:
    """The design's rows x the layouts: every row any layout's pairwise design chose, under
    every layout where validation accepts it."""
    design = md.design()

    def rest(layout):  # the rows the pairwise design did not run under this layout
        return [
            r for r in md.all_rows() if r not in design[layout] and md.refusal(r, layout) is None
        ]

    check_cases(world, _cases(world, rest), md.STEPS, timeout=3500)


# ----------------------------------------------------------------------------- the page

PAGE = Path(__file__).resolve().parents[2] / "docs" / "matrix.md"


def _values_under(layout: md.Layout, k: int) -> tuple[list[str], list[str]]:
    """The values of factor k that run under the layout, and the refused ones with why."""
    runs, refused = [], []
    for v, (label, _) in enumerate(FACTORS[md.NAMES[k]]):
        if any(r[k] == v for r in md.design()[layout]):
            runs.append(label)
        else:
            row = tuple(v if i == k else 0 for i in range(len(md.LEVELS)))
            refused.append(f"{label}: {md.refusal(row, layout) or 'no valid row'}")
    return runs, refused


def render_page() -> str:
    lines = [
        "# The equivalence matrix: what is proven equal to one process",
        "",
        "Written by `tests/parallel/test_matrix.py` from the design it runs; the test fails",
        "when this page is not what the design is. To rewrite it after changing the factors",
        "(`tests/parallel/matrix_options.py`) or the layouts",
        "(`tests/parallel/matrix_design.py`):",
        "`MOETRAIN_UPDATE_DOCS=1 python -m pytest tests/parallel/test_matrix.py -k page`.",
        "",
        f"Each cell trains the micro MoE (`tests/multirank.py`, made smaller: "
        f"{', '.join(f'`{o}`' for o in md.BASE)}) for {md.STEPS} steps under the layout and",
        "compares it on every rank with one process on the same options: losses, MoE",
        "statistics (aux / seq-aux / z losses, entropy, token and drop counts, score",
        "histograms, expert bias), every parameter's gradient at every step, AdamW's moments,",
        "the final parameters, and that the layout really ran (placements, FSDP sharding and",
        "resharding, ZeRO-1 shards, stages and schedule, checkpoint wrappers, experts per",
        "rank, the dispatcher, traffic on each axis), within `TOLERANCES` of",
        "`tests/multirank.py`.",
        "",
        f"{len(md.NAMES)} option factors, {len(md.LAYOUTS)} layouts, "
        f"{len(md.all_rows())} distinct option rows. CI runs, for every layout of one axis,",
        "a pairwise covering design (every pair of option values that validation accepts",
        "together meets the layout at least once) -- for the variants of an axis that CI",
        "already crosses pairwise (`VALUE_ROWS_IN_CI`: ZeRO-1/2, replicated experts, the",
        "later schedules, the overlapped all-to-all, cp with ZeRO-3 and breadth-first",
        "passes), the fewest of its pairwise rows that hold every option value; the",
        "compositions of axes share such rows (`shared_value_rows`: every option value meets",
        "some composition on 4 and on 8 ranks, every composition runs); `-m slow` runs",
        "the rest of the pairwise designs and every row under every layout where it is valid.",
        "",
        "| layout | ranks | overrides | cells in CI | cells under `-m slow` |",
        "|---|---|---|---|---|",
    ]
    for layout in md.LAYOUTS:
        ci = len(_ci_rows(layout))
        valid = sum(md.refusal(r, layout) is None for r in md.all_rows())
        overrides = " ".join(f"`{o.removeprefix('parallel.')}`" for o in layout.overrides)
        lines.append(f"| {layout.name} | {layout.world} | {overrides} | {ci} | {valid - ci} |")
    lines += [
        "",
        "## Option values under each layout",
        "",
        "Every value of every factor runs under every layout, except where config validation",
        "refuses it (the refusal names the key); those are listed.",
        "",
        "| factor | values | refused under |",
        "|---|---|---|",
    ]
    for k, name in enumerate(md.NAMES):
        labels = [label for label, _ in FACTORS[name]]
        refusals = {}
        for layout in md.LAYOUTS:
            for why in _values_under(layout, k)[1]:
                refusals.setdefault(why, []).append(layout.name)
        refused = "; ".join(
            f"{why.split(': ', 1)[0]} under {', '.join(names)} ({why.split(': ', 1)[1]})"
            for why, names in refusals.items()
        )
        lines.append(f"| {name} | {'; '.join(labels)} | {refused or '-'} |")
    return "\n".join(lines) + "\n"


def test_page_is_current() -> None:
    text = render_page()
    if os.environ.get("MOETRAIN_UPDATE_DOCS"):
        PAGE.write_text(text)
    assert PAGE.exists() and PAGE.read_text() == text, (
        "docs/matrix.md is stale: MOETRAIN_UPDATE_DOCS=1 python -m pytest "
        "tests/parallel/test_matrix.py -k page"
    )
