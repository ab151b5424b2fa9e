"""The equivalence matrix: every model and MoE option under every parallel layout.

The option factors live in tests/parallel/matrix_options.py, the layouts and the design in
tests/parallel/matrix_design.py. Each cell runs the micro MoE for ``STEPS`` steps under the
layout and compares it on every rank with the single-process run of the same options
(``check_cases`` of tests/multirank.py: losses, MoE statistics, every gradient of every
step, the optimizer's state, final parameters, and the layout facts), within ``TOLERANCES``.

- The design: a pairwise covering design per layout -- every pair of option values that can
  go together meets every layout at least once (about 16 rows per layout).
- CI part: every option value under every layout (``_ci_rows``: a layout's fewest rows that
  hold every value, the compositions sharing theirs), one job per world size; and a slice
  of the rest, rotating with the commit (``slices``).
- Exhaustive part (``-m exhaustive``, deselected otherwise: tests/conftest.py): the rest of
  the pairwise designs, and every row of the design under every layout where it is valid.
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
from multirank import Case, RankFailure, check_cases, expected_layout

WORLDS = (2, 4, 8)
ROOT = Path(__file__).resolve().parents[2]


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


def test_the_designs_fast_conflict_test_agrees_with_conflict() -> None:
    """The design tests rows with ``md._conflicts`` (bit masks) and writes messages with
    ``md.conflict``: both say the same of every pair of values and of random rows."""
    import random

    rng = random.Random(0)
    rows = [tuple(rng.randrange(n) for n in md.LEVELS) for _ in range(2000)]
    for i, j in itertools.combinations(range(len(md.LEVELS)), 2):
        for a, b in itertools.product(range(md.LEVELS[i]), range(md.LEVELS[j])):
            rows.append(tuple(a if k == i else b if k == j else 0 for k in range(len(md.LEVELS))))
    assert any(md._conflicts(r) for r in rows) and not all(md._conflicts(r) for r in rows)
    for row in rows:
        assert md._conflicts(row) == (md.conflict(row) is not None), md.row_label(row)
    # No two factors set one key today (the conflicts above are FORBIDDEN's): the masks of
    # keys set differently, on factors that do.
    settings = [[(), (("moe.top_k", "1"),)], [(), (("moe.top_k", "2"),), (("moe.top_k", "1"),)]]
    bit, clash = md.value_bits(settings)
    assert clash == [[0, bit[1][1]], [0, bit[0][1], 0]], (bit, clash)


def witnesses(key: str, expect=expected_layout) -> list[tuple[str, list[str]]]:
    """The layouts of the matrix that set ``parallel.<key>`` and whose expected facts
    (``expect``) differ without it: under the layout alone, or under some option value the
    design pairs it with (a key such as pp_microbatches only matters once the micro-batch
    size makes it differ from the default). A request that forms no layout (``expect``
    raises: degrees that do not divide) is no evidence either way."""
    # Every cell runs some option row: the baseline row's keys (train.micro_batch_size among
    # them) are what a key's effect is judged against.
    base = [*md.BASE, *md.row_overrides(tuple(0 for _ in md.NAMES))]
    contexts = [[]] + [list(v) for values in FACTORS.values() for _, v in values]
    found = []
    for layout in md.LAYOUTS:
        mine = [o for o in layout.overrides if o.startswith(f"parallel.{key}=")]
        if not mine:
            continue
        others = [o for o in layout.overrides if o not in mine]
        for extra in contexts:
            try:
                with_key = expect([*base, *extra, *layout.overrides], layout.world, 0)
                without = expect([*base, *extra, *others], layout.world, 0)
            except ValueError:
                continue
            if without != with_key:
                found.append((layout.name, extra))
                break
    return found


def test_every_parallel_key_is_exercised_and_observable() -> None:
    """A ``parallel.*`` key the code silently ignored must fail a test: every key is set to
    a non-default value by some layout of the matrix, and that value changes the facts the
    layout check asserts (``expected_layout``), so running the layout without honouring the
    key would fail it. ``dp_shard`` is derived from the world size: an explicit value can
    only equal the derived one (a different one is refused, tests/parallel/test_dims.py)."""
    import dataclasses

    from moetrain.config import ParallelConfig

    for f in dataclasses.fields(ParallelConfig):
        if f.name == "dp_shard":
            continue
        if f.name == "activation_checkpointing":
            # An option factor of the matrix rather than a layout: set by the rows.
            assert len(FACTORS["activation_checkpointing"]) == 3
            continue
        assert witnesses(f.name), f"parallel.{f.name}: no layout of the matrix shows it is honoured"


def test_a_request_that_forms_no_layout_is_no_witness() -> None:
    """The witness search can fail: when the expectation cannot be computed without the key
    (it raises), the key has no witness -- it used to count as one."""

    def needs_cp(overrides, world, rank):
        if not any(o.startswith("parallel.cp=") for o in overrides):
            raise ValueError("no layout without parallel.cp")
        return expected_layout(overrides, world, rank)

    assert witnesses("cp")
    assert witnesses("cp", needs_cp) == []


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
    """What CI runs under ``layout``: on two ranks the fewest of its pairwise rows that hold
    every option value (``md.value_rows``), on 4 and 8 the rows the compositions share; the
    rest of its pairwise rows runs in the rotating slices and under ``-m exhaustive``. (All of
    the two-rank pairwise designs in CI, 142 cells, took 560 s of a 32-minute suite on two
    AVX2 cores, tp2 + SP at 9 s a cell; 262 cells had taken 343 s earlier.)"""
    if layout.world > 2:
        return shared_value_rows(layout.world)[layout.name]
    return md.value_rows(layout)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_every_option_value_under_every_two_rank_layout() -> None:
    """Every option value valid under a two-rank layout meets it (``_ci_rows``); each pair of
    values meets it in the rotating slices."""
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


# ----------------------------------------------------------------------------- rotating slice

CELL_COST_S = {2: 1.5, 4: 6.0, 8: 12.0}
"""Estimated seconds of one exhaustive cell on two cores, by world size (two-rank cells
measured at 1.2 s, compositions 3-11 s: the docstrings above)."""
SLICE_BUDGET_S = 40
"""Estimated cell seconds of one rotating slice. With the single-process references and one
job per world size, about a minute on two idle cores. Measured before: 60 estimated seconds
took 135 s in a full run on two AVX2 cores, 80 took 111 s and 120 took 131 s on two idle
cores, and slice 0 at 150 (34 cells) passed in 12 minutes on a machine loaded twentyfold."""


def cell_id(layout: md.Layout, row: md.Row) -> str:
    """A short, stable name of a cell: the layout's name made a word, and a hash of the row's
    overrides (not its index: the design's rows move when factors are added)."""
    import hashlib

    slug = re.sub(r"[^a-z0-9]+", "-", layout.name.lower()).strip("-")
    digest = hashlib.sha1("\n".join(md.row_overrides(row)).encode()).hexdigest()[:8]
    return f"{slug}/{digest}"


@functools.cache
def exhaustive_cells() -> tuple[tuple[md.Layout, md.Row], ...]:
    """Every cell that only ``-m exhaustive`` runs: the rest of each layout's pairwise design
    and every row of the design under every layout where it is valid, in a fixed order
    that mixes layouts (sorted by a hash of the cell's name)."""
    design = md.design()
    cells = []
    for layout in md.LAYOUTS:
        ci = set(_ci_rows(layout))
        cells += [(layout, r) for r in design[layout] if r not in ci]
        cells += [
            (layout, r)
            for r in md.all_rows()
            if r not in design[layout] and md.refusal(r, layout) is None
        ]
    import hashlib

    return tuple(sorted(cells, key=lambda c: hashlib.sha1(cell_id(*c).encode()).hexdigest()))


@functools.cache
def slices() -> tuple[tuple[tuple[md.Layout, md.Row], ...], ...]:
    """The exhaustive cells cut, in ``exhaustive_cells`` order, into consecutive slices of
    about ``SLICE_BUDGET_S`` estimated seconds each."""
    out, current, spent = [], [], 0.0
    for cell in exhaustive_cells():
        cost = CELL_COST_S[cell[0].world]
        if current and spent + cost > SLICE_BUDGET_S:
            out.append(tuple(current))
            current, spent = [], 0.0
        current.append(cell)
        spent += cost
    if current:
        out.append(tuple(current))
    return tuple(out)


def slice_index() -> tuple[int, str]:
    """Which slice this commit runs: ``MOETRAIN_MATRIX_SLICE`` if set, else the commit's
    number in its history (``git rev-list --count HEAD``) modulo the number of slices, so
    that consecutive commits run consecutive slices and every cell runs once every
    ``len(slices())`` commits; slice 0 outside a git checkout."""
    import subprocess

    n = len(slices())
    if os.environ.get("MOETRAIN_MATRIX_SLICE"):
        return int(os.environ["MOETRAIN_MATRIX_SLICE"]) % n, "MOETRAIN_MATRIX_SLICE"
    try:
        count = subprocess.run(
            ["git", "rev-list", "--count", "HEAD"], cwd=ROOT, capture_output=True, text=True,
            check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
        return int(count) % n, f"commit number {count} modulo {n}"
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0, "not a git checkout"


def _cell_case(layout: md.Layout, row: md.Row) -> Case:
    return Case(
        f"{cell_id(layout, row)}: {layout.name} | {md.row_label(row)}",
        layout.overrides,
        md.BASE + md.row_overrides(row),
    )


RERUN = 'python -m pytest -m exhaustive "tests/parallel/test_matrix.py::test_exhaustive_cell[{}]"'


def run_cells(cells, timeout: float) -> None:
    """Run ``cells`` (one job per world size); a failure names each failing cell and the
    command that reruns it alone."""
    failures = []
    for world in WORLDS:
        mine = [c for c in cells if c[0].world == world]
        if not mine:
            continue
        try:
            check_cases(world, [_cell_case(*c) for c in mine], md.STEPS, timeout=timeout)
        except AssertionError as exc:
            failed = [cell_id(*c) for c in mine if f"{cell_id(*c)}: " in str(exc)]
            failures.append(
                str(exc)
                + "\n\nRerun a failing cell alone:\n"
                + "\n".join(f"  {RERUN.format(i)}" for i in failed)
            )
        except RankFailure as exc:  # a rank died: one of the job's cells, the trace says which
            failures.append(
                f"{exc}\n\nThe {world}-rank job of these cells died; rerun one alone:\n"
                + "\n".join(f"  {cell_id(*c)}: {RERUN.format(cell_id(*c))}" for c in mine)
            )
    assert not failures, "\n\n".join(failures)


def test_the_slices_cover_every_exhaustive_cell_once() -> None:
    cells = exhaustive_cells()
    sliced = [c for s in slices() for c in s]
    assert sorted(map(str, sliced)) == sorted(map(str, cells)) and len(sliced) == len(cells)
    ids = [cell_id(*c) for c in cells]
    assert len(set(ids)) == len(ids), "two cells share a name"
    for s in slices():
        assert sum(CELL_COST_S[layout.world] for layout, _ in s) <= SLICE_BUDGET_S
    index, why = slice_index()
    assert 0 <= index < len(slices()), (index, why)
    print(f"{len(cells)} exhaustive cells in {len(slices())} slices; this commit: slice "
          f"{index} ({why})")  # fmt: skip


def test_a_failing_cell_is_named_with_the_command_that_reruns_it(monkeypatch) -> None:
    cell = exhaustive_cells()[0]

    def fails(world, cases, steps, timeout):
        raise AssertionError(f"{cases[0].name} (rank 0):\n  layout planted: differs")

    monkeypatch.setitem(globals(), "check_cases", fails)
    with pytest.raises(AssertionError) as info:
        run_cells([cell], timeout=10)
    message = str(info.value)
    assert f"{cell_id(*cell)}: {cell[0].name} | " in message, message
    assert RERUN.format(cell_id(*cell)) in message, message


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_a_rotating_slice_of_the_exhaustive_matrix() -> None:
    """The cells only ``-m exhaustive`` runs, a slice a commit (``slice_index``): every
    cell runs once in ``len(slices())`` consecutive commits. A failure names the cell and
    the command that reruns it alone."""
    index, why = slice_index()
    cells = slices()[index]
    print(f"exhaustive slice {index} of {len(slices())} ({why}): {len(cells)} cells")
    run_cells(cells, timeout=880)


def pytest_generate_tests(metafunc) -> None:
    """Every exhaustive cell as a case of ``test_exhaustive_cell``, named by ``cell_id``:
    only when the run asks for exhaustive tests (the design is not computed otherwise)."""
    if metafunc.function.__name__ != "test_exhaustive_cell":
        return
    from selection import asks_for_exhaustive

    cells = exhaustive_cells() if asks_for_exhaustive(metafunc.config) else ()
    metafunc.parametrize("cell", list(cells), ids=[cell_id(*c) for c in cells])


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_exhaustive_cell(cell) -> None:
    """One exhaustive cell alone (the rotating slice's failures say which)."""
    run_cells([cell], timeout=880)


# ----------------------------------------------------------------------------- references


def _test_exists(node: str) -> bool:
    """Whether a node id (``tests/x.py``, ``tests/x.py::test_f`` or ``...::test_f[case]``)
    names a test module and a function it defines (read, not imported)."""
    import ast

    path, _, name = node.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    if not name:
        return True
    name = name.split("[")[0]
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def reference_problems(refs=None) -> list[str]:
    """Every key of ``references.SECTIONS`` without a row (or a ``NO_NUMBERS`` entry), every
    row of a key that does not exist, and every cited test that does not: one line each,
    saying what to add and where."""
    import dataclasses

    import references as R

    from moetrain.config import JobConfig

    refs = R.REFERENCES if refs is None else refs
    keys = [
        f"{section}.{f.name}"
        for section in R.SECTIONS
        for f in dataclasses.fields(type(getattr(JobConfig(), section)))
    ]
    out = []
    for key in keys:
        if key not in refs and key not in R.NO_NUMBERS and key not in R.GAPS:
            out.append(
                f"{key} has no independent reference. Add one line to REFERENCES in "
                f"tests/references.py:\n"
                f'    "{key}": ("<what checks its semantics without the code under test: a '
                f"hand computation, transformers' modeling code, a closed-form property>\", "
                f'"tests/<file>.py::<test that runs it>"),\n'
                f"  or, if it changes no trained number, to NO_NUMBERS with the reason."
            )
    for key, (what, test) in refs.items():
        if key not in keys:
            out.append(f"REFERENCES[{key!r}]: no such key in sections {R.SECTIONS}")
        if key in R.NO_NUMBERS or key in R.GAPS:
            out.append(f"{key}: in REFERENCES and in NO_NUMBERS or GAPS")
        node = R.TESTS.get(test, test)
        if not what or not _test_exists(node):
            out.append(f"REFERENCES[{key!r}]: {node!r} is not a test of the repository "
                       "(a node id, or a name of TESTS)")  # fmt: skip
    return out


def test_every_option_has_an_independent_reference() -> None:
    """The matrix compares layouts with one process running the same code: what that process
    shares, it cannot see. Every model, router, loss, data, optimizer and training option
    names its independent reference and the test running it (tests/references.py)."""
    problems = reference_problems()
    assert not problems, "\n".join(problems)
    # Every option the matrix crosses has one (its factors set keys of these sections).
    import references as R

    for values in FACTORS.values():
        for _, overrides in values:
            for o in overrides:
                key = o.split("=", 1)[0]
                assert key.startswith("parallel.") or key in R.REFERENCES, key


def test_a_new_option_without_a_row_fails_and_says_what_to_add() -> None:
    import references as R

    refs = {k: v for k, v in R.REFERENCES.items() if k != "moe.top_k"}
    problems = reference_problems(refs)
    assert problems and problems[0].startswith(
        "moe.top_k has no independent reference. Add one line to REFERENCES in "
        'tests/references.py:\n    "moe.top_k": ('
    ), problems
    bad = {**R.REFERENCES, "moe.top_k": ("a loop", "tests/model/test_router.py::test_nothing")}
    assert reference_problems(bad) == [
        "REFERENCES['moe.top_k']: 'tests/model/test_router.py::test_nothing' is not a test of "
        "the repository (a node id, or a name of TESTS)"
    ]


# ----------------------------------------------------------------------------- the page

PAGE = ROOT / "docs" / "matrix.md"


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
        "histograms, expert bias), every parameter's gradient at every step, the optimizer's",
        "state (AdamW's moments, Muon's momentum buffers), the final parameters, and that the",
        "layout really ran, within `TOLERANCES` of",
        "`tests/multirank.py`. A failing cell's report lists every diverging tensor, grouped",
        "by kind (router, experts, attention, norms, embeddings, ...), worst first, each with",
        "the first step at which it diverged (`tests/divergence.py`).",
        "",
        "The layout facts are observed from the run (`tests/layout_facts.py`): the order in",
        "which the micro-batches' forwards and backwards ran and in passes of how many, the",
        "shapes of the queries, keys and values each rank's attention saw, the RoPE positions",
        "each rank used, the groups of ranks every collective of the first step went over",
        "(each named by the axes of the requested mesh it spans; a group that is no",
        "combination of them fails), besides the built model's placements, FSDP units and",
        "resharding, ZeRO-1 shards, stages, the layers of each stage and the schedule,",
        "checkpoint wrappers, experts per rank and dispatcher. What they must be is computed",
        "from the raw request (the `parallel.*` overrides as written) by the test's own",
        "arithmetic, never through the config validation or `ParallelDims` the run uses: a",
        "breadth-first setting the engine ignores, `parallel.cp` forced to 1, or a stage given",
        "the wrong layers with the same total, changes the numbers of no cell but fails the",
        "facts (`tests/parallel/test_oracle.py` plants all three, `tests/faults.py`).",
        "",
        f"{len(md.NAMES)} option factors, {len(md.LAYOUTS)} layouts, "
        f"{len(md.all_rows())} distinct option rows. Each layout has a pairwise covering design",
        "(every pair of option values that validation accepts together meets the layout at",
        "least once). CI runs, for every layout of one axis, the fewest of its pairwise rows",
        "that hold every option value; the compositions of axes share such rows",
        "(`shared_value_rows`: every option value meets some composition on 4 and on 8 ranks,",
        "every composition runs). The rest of the pairwise designs and every row under every",
        "layout where it is valid (the exhaustive",
        f"cells, {len(exhaustive_cells())} of them) run under `-m exhaustive`, and in CI as a",
        f"rotating slice: cut into {len(slices())} slices of about {SLICE_BUDGET_S} s",
        f"(estimated), a commit runs slice `git rev-list --count HEAD` modulo {len(slices())}, so",
        f"every cell runs once in {len(slices())} consecutive commits",
        "(`test_a_rotating_slice_of_the_exhaustive_matrix`; `MOETRAIN_MATRIX_SLICE=k` runs",
        "slice k). A failure names the cell and the command that reruns it alone:",
        "`python -m pytest -m exhaustive "
        '"tests/parallel/test_matrix.py::test_exhaustive_cell[<cell>]"`.',
        "",
        "| layout | ranks | overrides | cells in CI | exhaustive cells |",
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
    return "\n".join(lines + _references_section()) + "\n"


def _references_section() -> list[str]:
    import references as R

    lines = [
        "",
        "## Independent references",
        "",
        "A layout is compared with one process running the same code, so a bug that process",
        "shares passes every cell. Each option therefore has a reference of its own, written",
        "without the code under test, and a test that runs it (`tests/references.py`;",
        "`test_every_option_has_an_independent_reference` fails for a key of the "
        + ", ".join(f"`{s}`" for s in R.SECTIONS),
        "sections without a row, and its message says the line to add). Golden curves",
        "(`tests/golden/`, `tests/test_golden.py`) pin the single-process numbers of a few",
        "configs on top: a change to them shows as a diff a commit must explain.",
        "",
        "| option | independent reference | test |",
        "|---|---|---|",
    ]
    for key, (what, test) in R.REFERENCES.items():
        lines.append(f"| `{key}` | {what} | `{R.TESTS.get(test, test)}` |")
    lines += ["", "Options without an independent check in the suite yet:", ""]
    lines += [f"- `{key}`: {why}" for key, why in R.GAPS.items()]
    lines += ["", "Keys that change no trained number:", ""]
    lines += [f"- `{key}`: {why}" for key, why in R.NO_NUMBERS.items()]
    return lines + _golden_section()


def _golden_section() -> list[str]:
    import golden_runs as G

    lines = [
        "",
        "## Golden curves",
        "",
        "Per step: the loss, the gradient norm, the learning rate and each MoE layer's token",
        "counts, drops, balancing losses and expert bias of a short fp32 run in one process",
        "on one thread, on a corpus and a word-level tokenizer generated from a fixed sequence",
        "(the same bytes on every machine: `tests/golden_runs.py`). In the environment a file",
        "was written in (torch version, CPU architecture, instruction set and processor",
        "model) every number",
        "must be equal, bit for bit; elsewhere losses and gradient norms must agree within",
        f"{G.BOUND['loss']:g} and {G.BOUND['grad_norm']:g} (relative; `BOUND`, measured with",
        "another instruction set's kernels) and counts are not compared. A change to the",
        "single process's numbers fails `tests/test_golden.py` and shows as a diff of the",
        "files; regenerating them is deliberate:",
        "`MOETRAIN_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py`.",
        "",
        "| golden file | config | steps | what it pins |",
        "|---|---|---|---|",
    ]
    for name, (path, overrides, steps) in G.CONFIGS.items():
        micro = path is None
        shown = [o for o in overrides if not micro or o not in (*G.MICRO, *G.HALF_ROPE)]
        base = (
            f"`{path}`"
            if path
            else "`MICRO` of `tests/golden_runs.py`"
            + (", rotate-half RoPE" if all(o in overrides for o in G.HALF_ROPE) else "")
        )
        lines.append(
            f"| `tests/golden/{name}.json` | {base} | {steps} | "
            + (" ".join(f"`{o}`" for o in shown) or "-")
            + " |"
        )
    return lines


def test_page_is_current() -> None:
    text = render_page()
    if os.environ.get("MOETRAIN_UPDATE_DOCS"):
        PAGE.write_text(text)
    assert PAGE.exists() and PAGE.read_text() == text, (
        "docs/matrix.md is stale: MOETRAIN_UPDATE_DOCS=1 python -m pytest "
        "tests/parallel/test_matrix.py -k page"
    )
