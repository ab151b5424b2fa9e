"""Realistic bugs that the oracle's own tests plant into moetrain, one at a time.

Each fault changes the code the way a plausible mistake would, and each once slipped past a
check that compared a layout with one process (the single process shared the bug, or the
layout facts read the configuration instead of the run). ``plant(name, setattr)`` installs
one: ``setattr`` is ``pytest``'s ``monkeypatch.setattr`` in the test process (undone after
the test), the builtin in a spawned rank (``Case.fault = ("plant", rank, name)`` in
tests/multirank.py).

- ``per_micro_batch_counts``: the global-batch balancing loss uses each micro-batch's own
  expert counts instead of the step's (in every layout, one process included). Caught by
  the hand computation of tests/train/test_global_aux_loss.py and the golden curves.
- ``breadth_first_ignored``: the engine's loop (outside pipelines) runs every micro-batch's
  backward right after its forward whatever ``parallel.breadth_first_micro_batches`` says;
  the engine's attribute still holds the configured value. Same numbers; caught by the
  observed order of forwards and backwards.
- ``cp_forced_to_1``: config validation sets ``parallel.cp`` to 1 (a cp2 job silently
  becomes dp2). Same numbers; caught by the positions and attention shapes each rank
  observed against the raw request.
- ``stage_layers_misassigned``: the pipeline split reads ``parallel.pp_stage_layers`` in
  reverse (the same layers in all, each stage the wrong count of them: 3 + 1 built as
  1 + 3). The model computes the same function, so the numbers equal one process's; caught
  by the layers each rank's chunks hold against the raw request.
- ``embedding_copies_unsynced``: under a pipeline with multi-token prediction, the first
  stage's embedding and the last stage's copy keep the gradients of their own uses (the
  engine never sums them): both copies step, apart. Caught by the embedding's gradient
  (tests/parallel/test_mtp_layouts.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _per_micro_batch_counts(setattr_: Callable[..., None]) -> None:
    from moetrain.model.moe import MoELayer

    # The engine's step-wide counts never reach the layers: each backward falls back to the
    # counts of its own forward (MoELayer._global_f).
    setattr_(MoELayer, "set_global_counts", lambda self, counts_E: None)


def _breadth_first_ignored(setattr_: Callable[..., None]) -> None:
    from moetrain.train.engine import Engine

    forward_backward = Engine.forward_backward

    def depth_first(self: Any, *args: Any, **kwargs: Any) -> float:
        if self.schedule is not None:
            return forward_backward(self, *args, **kwargs)
        configured, self.breadth = self.breadth, 1  # the loop's pass size, not the attribute
        try:
            return forward_backward(self, *args, **kwargs)
        finally:
            self.breadth = configured

    setattr_(Engine, "forward_backward", depth_first)


def _cp_forced_to_1(setattr_: Callable[..., None]) -> None:
    from moetrain.config import ParallelConfig

    validate = ParallelConfig.validate

    def forced(self: Any) -> None:
        validate(self)
        self.cp = 1

    setattr_(ParallelConfig, "validate", forced)


def _embedding_copies_unsynced(setattr_: Callable[..., None]) -> None:
    from moetrain.train.engine import Engine

    setattr_(Engine, "_sync_embedding_copies", lambda self: None)


def _stage_layers_misassigned(setattr_: Callable[..., None]) -> None:
    from moetrain.parallel import pipeline

    counts = pipeline.stage_layer_counts

    def reversed_counts(n_layers: int, num_stages: int, explicit: Any = None) -> list[int]:
        return counts(n_layers, num_stages, explicit)[::-1]

    setattr_(pipeline, "stage_layer_counts", reversed_counts)


FAULTS: dict[str, Callable[[Callable[..., None]], None]] = {
    "stage_layers_misassigned": _stage_layers_misassigned,
    "embedding_copies_unsynced": _embedding_copies_unsynced,
    "per_micro_batch_counts": _per_micro_batch_counts,
    "breadth_first_ignored": _breadth_first_ignored,
    "cp_forced_to_1": _cp_forced_to_1,
}


def plant(name: str, setattr_: Callable[..., None] = setattr) -> None:
    """Install the fault ``name`` (a key of ``FAULTS``)."""
    FAULTS[name](setattr_)
