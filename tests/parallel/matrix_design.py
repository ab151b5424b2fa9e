"""The equivalence matrix's design: which option rows run under which layout.

Factors (tests/parallel/matrix_options.py) x layouts (``LAYOUTS`` below). A row picks one
value of every factor; its overrides are the union of the values' overrides, and it is
*valid* under a layout when no two values set one key differently and config validation
(``load_config`` + ``ParallelDims.validate`` for the layout's world size) accepts it.

- ``covering_rows(layout)``: rows such that every pair of option values that can meet
  under the layout (some valid row holds both) does meet in one of them -- a pairwise
  covering design per layout, built greedily (AETG-style: many candidate rows, keep the one
  covering most uncovered pairs), deterministic, reusing rows already chosen for other
  layouts first so that layouts share their single-process references.
- ``all_rows()``: the union of every layout's covering rows; the slow part runs each of
  them under every layout where it is valid (the full cross product of the design's rows
  and the layouts).

Everything here is cheap (config objects only): the tests below run the rows.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass

from matrix_options import FACTORS, FORBIDDEN, STEPS  # noqa: F401 - md.STEPS for the tests
from multirank import MICRO

BASE = (
    # The micro MoE of tests/multirank.py made smaller (dim 32, 16 tokens a sequence) to keep
    # hundreds of runs inside the budget; 4 layers so pp=2 x 2 virtual stages works.
    "model.dim=32",
    "model.ffn_dim=64",
    "moe.expert_ffn_dim=32",
    "data.seq_len=16",
)
# STEPS (matrix_options.py): two optimizer steps: gradients of both, AdamW's moments after
# the second, the expert bias moved by the first step's counts and used by the second's
# routing (and two steps of routing-replay files).
VOCAB = 4096  # the default tokenizer's vocabulary (validation checks it divides tp)


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    overrides: tuple[str, ...]


LAYOUTS: list[Layout] = [
    # one axis, 2 ranks
    Layout("dp2 zero0", 2, ("parallel.zero_stage=0",)),
    Layout("dp2 zero1", 2, ("parallel.zero_stage=1",)),
    Layout("dp2 zero2", 2, ("parallel.zero_stage=2",)),
    Layout("dp2 zero3", 2, ("parallel.zero_stage=3",)),
    Layout("tp2", 2, ("parallel.tp=2",)),
    Layout("tp2 SP", 2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
    Layout("tp2 SP replicated experts", 2,
           ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.expert_tp=false")),
    Layout("pp2 gpipe", 2, ("parallel.pp=2", "parallel.pp_schedule=gpipe")),
    Layout("pp2 1f1b", 2, ("parallel.pp=2", "parallel.pp_schedule=1f1b")),
    Layout("pp2 interleaved_1f1b v2", 2, ("parallel.pp=2", "parallel.pp_virtual_stages=2")),
    Layout("pp2 zero_bubble v2", 2,
           ("parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.pp_virtual_stages=2")),
    Layout("ep2 all_to_all", 2, ("parallel.ep=2",)),
    Layout("ep2 all_gather zero3", 2,
           ("parallel.ep=2", "parallel.ep_dispatcher=all_gather", "parallel.zero_stage=3")),
    Layout("ep2 shared experts overlapped with the all-to-all", 2,
           ("parallel.ep=2", "parallel.overlap_shared_experts=true")),
    Layout("ep2, halves of each micro-batch interleaved (parallel.ep_overlap)", 2,
           ("parallel.ep=2", "parallel.ep_overlap=halves")),
    Layout("ep2, dropless rows in static slots (parallel.ep_dropless_transport)", 2,
           ("parallel.ep=2", "parallel.ep_dropless_transport=slots")),
    Layout("cp2", 2, ("parallel.cp=2",)),
    Layout("cp2 zero3, breadth-first passes of 2", 2,
           ("parallel.cp=2", "parallel.zero_stage=3", "parallel.breadth_first_micro_batches=2")),
    Layout("pp2 looped_bfs v2, 2 depth-first passes", 2,
           ("parallel.pp=2", "parallel.pp_schedule=looped_bfs", "parallel.pp_virtual_stages=2",
            "parallel.depth_first_micro_batches=2")),
    Layout("pp2 zbv, 2 pipeline micro-batches of 4", 2,
           ("parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=2")),
    Layout("pp2 dualpipev, 4 micro-batches", 2,
           ("parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=4")),
    # uneven stages (parallel.pp_stage_layers): a heavy first stage, and the V with a last
    # stage of the output head alone (DeepSeek-V3's layout in small: rank 0 holds the first
    # and the last stage, 1 layer and the head; rank 1 the 3 layers between)
    Layout("pp2 1f1b, stages of 3 + 1 layers", 2,
           ("parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_stage_layers=[3,1]")),
    Layout("pp2 dualpipev, stages of 1, 2, 1, 0 layers (the head alone)", 2,
           ("parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=4", "parallel.pp_stage_layers=[1,2,1,0]")),
    # two axes, 4 ranks
    Layout("hsdp 2x2 zero3", 4, ("parallel.dp_replicate=2", "parallel.zero_stage=3")),
    Layout("hsdp 2x2 zero1", 4, ("parallel.dp_replicate=2", "parallel.zero_stage=1")),
    Layout("dp2 x tp2 SP zero2", 4,
           ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=2")),
    Layout("pp2 x dp2 zero1 1f1b, 2 pipeline micro-batches of 2", 4,
           ("parallel.pp=2", "parallel.zero_stage=1", "parallel.pp_schedule=1f1b",
            "parallel.pp_microbatches=2")),
    Layout("pp2 x tp2 SP interleaved v2", 4,
           ("parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
            "parallel.pp_virtual_stages=2")),
    Layout("ep2 x tp2 expert TP", 4, ("parallel.ep=2", "parallel.tp=2")),
    Layout("ep4 zero2 all_gather", 4,
           ("parallel.ep=4", "parallel.ep_dispatcher=all_gather", "parallel.zero_stage=2")),
    Layout("ep2 x edp2 zero1", 4, ("parallel.ep=2", "parallel.zero_stage=1")),
    Layout("ep2 x tp2 SP expert TP, halves interleaved", 4,
           ("parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
            "parallel.ep_overlap=halves")),
    Layout("cp4", 4, ("parallel.cp=4",)),
    Layout("cp2 x tp2 SP", 4,
           ("parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true")),
    Layout("cp2 x ep2 (EP over the cp ranks) x dp2 zero1", 4,
           ("parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=1")),
    Layout("cp2 x pp2 interleaved v2", 4,
           ("parallel.cp=2", "parallel.pp=2", "parallel.pp_virtual_stages=2")),
    # uneven stages under tp: in ZB-V's V, rank 0 holds the first and the last stage, the
    # embedding alone and the output head alone (no block at all), rank 1 the 4 layers
    Layout("pp2 x tp2 SP zbv, stages of 0, 2, 2, 0 layers (rank 0: no block)", 4,
           ("parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
            "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2",
            "parallel.pp_stage_layers=[0,2,2,0]")),
    # three axes, 8 ranks
    Layout("pp2 x dp2 x tp2 zero3 SP interleaved v2", 8,
           ("parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
            "parallel.zero_stage=3", "parallel.pp_virtual_stages=2")),
    Layout("ep4 x tp2 expert TP (tiny_ep)", 8, ("parallel.ep=4", "parallel.tp=2")),
    Layout("pp2 x ep2 x tp2 expert TP zero1 interleaved v2", 8,
           ("parallel.pp=2", "parallel.ep=2", "parallel.tp=2", "parallel.zero_stage=1",
            "parallel.pp_virtual_stages=2")),
    Layout("cp2 x dp2 x tp2 SP zero2", 8,
           ("parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
            "parallel.zero_stage=2")),
]  # fmt: skip

Row = tuple[int, ...]
"""One value index per factor, in FACTORS order."""

NAMES = list(FACTORS)
LEVELS = [len(FACTORS[n]) for n in NAMES]


_OVERRIDES = [[tuple(value[1]) for value in FACTORS[name]] for name in NAMES]
_SETTINGS = [[tuple(o.partition("=")[::2] for o in ovs) for ovs in f] for f in _OVERRIDES]
# FORBIDDEN's combinations as (factor index, value index) pairs
_FORBIDDEN = [
    (tuple((NAMES.index(n), [lab for lab, _ in FACTORS[n]].index(label))
           for n, label in values.items()), reason)
    for values, reason in FORBIDDEN
]  # fmt: skip


def row_overrides(row: Row) -> tuple[str, ...]:
    return tuple(o for k, v in enumerate(row) for o in _OVERRIDES[k][v])


def row_label(row: Row) -> str:
    """The values that differ from the baseline (value 0 of every factor)."""
    parts = [FACTORS[n][v][0] for n, v in zip(NAMES, row, strict=True) if v]
    return ", ".join(parts) or "baseline"


def conflict(row: Row) -> str | None:
    """Why the row's values cannot go together before validation, or None."""
    seen: dict[str, str] = {}
    for k, v in enumerate(row):
        for key, value in _SETTINGS[k][v]:
            if seen.setdefault(key, value) != value:
                return f"{key} set to {seen[key]} and {value}"
    for values, reason in _FORBIDDEN:
        if all(row[k] == v for k, v in values):
            return reason
    return None


def value_bits(settings) -> tuple[list[list[int]], list[list[int]]]:
    """Each option value as a bit of one integer (``bit[k][v]``), and the other factors'
    values it cannot go with (``clash[k][v]``: they set one of its keys differently), for
    ``settings[k][v]`` = the (key, value) pairs of value v of factor k (``_SETTINGS``), so
    that ``_conflicts`` tests a row with a few integer operations: the design tests ~10^6."""
    bit, n = [], 0
    for factor in settings:
        bit.append([1 << (n + v) for v in range(len(factor))])
        n += len(factor)
    clash = [[0] * len(factor) for factor in settings]
    for k, j in itertools.permutations(range(len(settings)), 2):
        for a, b in itertools.product(range(len(settings[k])), range(len(settings[j]))):
            theirs = dict(settings[j][b])
            if any(theirs.get(key, value) != value for key, value in settings[k][a]):
                clash[k][a] |= bit[j][b]
    return bit, clash


_BIT, _CLASH = value_bits(_SETTINGS)
_FORBIDDEN_BITS = [sum(_BIT[k][v] for k, v in values) for values, _ in _FORBIDDEN]


def _conflicts(row: Row) -> bool:
    """Whether ``conflict(row)`` is not None: two values set one key differently, or the row
    holds a ``FORBIDDEN`` combination."""
    bits = clash = 0
    for k, v in enumerate(row):
        bits |= _BIT[k][v]
        clash |= _CLASH[k][v]
    return bool(bits & clash) or any(bits & f == f for f in _FORBIDDEN_BITS)


@functools.cache
def refusal(row: Row, layout: Layout) -> str | None:
    """Why the row is not valid under the layout (a conflict or config validation's error
    message), or None when it is."""
    return conflict(row) if _conflicts(row) else _validation_error(row, layout)


def _valid(row: Row, layout: Layout) -> bool:
    """``refusal(row, layout) is None``, without the message of a conflicting row."""
    return not _conflicts(row) and _validation_error(row, layout) is None


@functools.cache
def _validation_error(row: Row, layout: Layout) -> str | None:
    """Config validation's message for a row with no conflict under the layout, or None."""
    from moetrain.config import ConfigError
    from moetrain.parallel.dims import ParallelDims

    try:
        settings = [s for k, v in enumerate(row) for s in _parsed(k, v)]
        cfg = _load([*settings, *map(_setting, layout.overrides)])
        ParallelDims.from_config(cfg.parallel, layout.world).validate(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


@functools.cache
def _parsed(k: int, v: int) -> tuple[tuple[str, str, object], ...]:
    """The typed settings of value ``v`` of factor ``k`` (``_setting`` of each override)."""
    return tuple(map(_setting, _OVERRIDES[k][v]))


@functools.cache
def _setting(override: str) -> tuple[str, str, object]:
    """(section, key, typed value) of one ``section.key=value`` override, parsed and
    type-checked once (YAML parsing is most of a config load)."""
    from moetrain.config import JobConfig, parse_overrides
    from moetrain.config.loading import _coerce, _hints

    ((section, inner),) = parse_overrides([override]).items()
    ((key, value),) = inner.items()
    cls = _hints(JobConfig)[section]
    return section, key, _coerce(f"{section}.{key}", value, _hints(cls)[key])


@functools.cache
def _base():
    from moetrain.config import load_config

    return load_config(None, [*MICRO, *BASE, f"model.vocab_size={VOCAB}"])


def _load(settings: list[tuple[str, str, object]]):
    """``load_config(None, [*MICRO, *BASE, *overrides])`` -- what a cell runs, with the
    default tokenizer's vocabulary -- from the overrides' parsed ``settings`` (``_setting``),
    set on a shallow copy of the base config: the design validates ~10^5 rows."""
    cfg = _clone(_base())
    sections = {}
    for section, key, value in settings:
        if section not in sections:
            sections[section] = _clone(getattr(cfg, section))
            setattr(cfg, section, sections[section])
        setattr(sections[section], key, value)
    return cfg.validate()


def _clone(obj):
    """A shallow copy of a config dataclass (``copy.copy`` without its ``__reduce_ex__``)."""
    out = object.__new__(type(obj))
    out.__dict__.update(obj.__dict__)
    return out


def _pairs(row: Row) -> set[tuple[int, int, int, int]]:
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def _draw_row(rng: random.Random) -> list[int]:
    """A random value of every factor, each drawn as Python 3.11's ``rng.randrange(levels)``
    draws it (rejection sampling over ``getrandbits``)."""
    bits = rng.getrandbits
    row = []
    for levels, width in _WIDTHS:
        r = bits(width)
        while r >= levels:
            r = bits(width)
        row.append(r)
    return row


_WIDTHS = [(levels, levels.bit_length()) for levels in LEVELS]


def _random_valid_rows(layout: Layout, n: int, rng: random.Random) -> list[Row]:
    out = []
    for _ in range(n * 20):
        row = tuple(_draw_row(rng))
        if _valid(row, layout):
            out.append(row)
            if len(out) == n:
                break
    return out


@functools.cache
def coverable_pairs(layout: Layout) -> frozenset[tuple[int, int, int, int]]:
    """Pairs of option values some valid row holds (found by completing each pair)."""
    out = set()
    rng = random.Random(0)
    for i, j in itertools.combinations(range(len(LEVELS)), 2):
        for a in range(LEVELS[i]):
            for b in range(LEVELS[j]):
                if _complete(layout, {i: a, j: b}, rng) is not None:
                    out.add((i, a, j, b))
    return frozenset(out)


def _complete(layout: Layout, fixed: dict[int, int], rng: random.Random) -> Row | None:
    """A valid row with the ``fixed`` values: baseline first, then random completions."""
    base = [fixed.get(k, 0) for k in range(len(LEVELS))]
    if _valid(tuple(base), layout):
        return tuple(base)
    for _ in range(40):
        row = _draw_row(rng)
        for k, v in fixed.items():
            row[k] = v
        if _valid(tuple(row), layout):
            return tuple(row)
    return None


@functools.cache
def design() -> dict[Layout, tuple[Row, ...]]:
    """Every layout's pairwise covering rows (see the module doc), chosen in ``LAYOUTS``
    order, each layout reusing the rows earlier ones chose where they help."""
    chosen: list[Row] = []
    out = {}
    for index, layout in enumerate(LAYOUTS):
        out[layout] = _cover(layout, chosen, random.Random(index))
    return out


def _cover(layout: Layout, chosen: list[Row], rng: random.Random) -> tuple[Row, ...]:
    uncovered = set(coverable_pairs(layout))
    rows: list[Row] = []
    while uncovered:
        reusable = [r for r in chosen if r not in rows and _valid(r, layout)]
        best = max(reusable, key=lambda r: len(_pairs(r) & uncovered), default=None)
        if best is None or not _pairs(best) & uncovered:
            # A new row: seed it with an uncovered pair, then fill the rest greedily.
            cands = []
            for i, a, j, b in sorted(uncovered)[:8]:
                for _ in range(4):
                    row = _complete(layout, {i: a, j: b}, rng)
                    if row is not None:
                        cands.append(_improve(row, layout, uncovered, rng))
            cands += _random_valid_rows(layout, 20, rng)
            best = max(cands, key=lambda r: len(_pairs(r) & uncovered))
            chosen.append(best)
        rows.append(best)
        uncovered -= _pairs(best)
    return tuple(rows)


def _improve(row: Row, layout: Layout, uncovered: set, rng: random.Random) -> Row:
    """Hill-climb one factor at a time while the row stays valid and covers more."""
    best, score = row, len(_pairs(row) & uncovered)
    for k in rng.sample(range(len(LEVELS)), len(LEVELS)):
        for v in range(LEVELS[k]):
            cand = best[:k] + (v,) + best[k + 1 :]
            if cand == best or not _valid(cand, layout):
                continue
            s = len(_pairs(cand) & uncovered)
            if s > score:
                best, score = cand, s
    return best


def all_rows() -> list[Row]:
    """Every row any layout's covering design chose (the slow part runs each everywhere)."""
    return list(dict.fromkeys(r for rows in design().values() for r in rows))


@functools.cache
def value_rows(layout: Layout) -> tuple[Row, ...]:
    """The fewest of the layout's covering rows that still hold every option value valid
    under it (each value meets the layout at least once): the CI part for compositions of
    several axes, whose cells cost 3-8 s each on two cores (see tests/parallel/test_matrix.py).
    """
    rows = design()[layout]
    singles = {(k, r[k]) for r in rows for k in range(len(LEVELS))}
    out: list[Row] = []
    while singles:
        best = max(rows, key=lambda r: len({(k, r[k]) for k in range(len(LEVELS))} & singles))
        out.append(best)
        singles -= {(k, best[k]) for k in range(len(LEVELS))}
    return tuple(out)
