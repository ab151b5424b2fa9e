"""The engine's declared parts (moetrain/train/engine.py): each collaborator is handed what it
reads when the engine builds it, and none holds the engine or one of its methods -- the
mixins sharing one ``self`` they replace let any part read anything of any other. The model
reads the step through the context the engine took from it."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
from multirank import micro_config

from moetrain.train.trainer import Trainer

PARTS = ("routing", "stats", "grads", "views", "full", "inputs")


def engine_references(engine: Any) -> list[str]:
    """``part.attribute`` of every collaborator attribute that is the engine or one of its
    bound methods."""
    found = []
    for name in PARTS:
        for attr, value in vars(getattr(engine, name)).items():
            if value is engine or getattr(value, "__self__", None) is engine:
                found.append(f"{name}.{attr}")
    return found


@pytest.fixture(scope="module")
def engine() -> Any:
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(micro_config(out, "train.steps=1"))
        yield trainer.engine
        trainer.close()


def test_no_collaborator_holds_the_engine(engine: Any) -> None:
    assert not engine_references(engine)


def test_a_collaborator_holding_the_engine_is_seen(engine: Any) -> None:
    """The check above can fail: a part handed the engine (or a method of it) is named."""
    engine.routing.owner = engine
    engine.stats.pop_loss = engine.pop_mtp_loss
    try:
        assert engine_references(engine) == ["routing.owner", "stats.pop_loss"]
    finally:
        del engine.routing.owner, engine.stats.pop_loss


def test_the_model_reads_the_context_the_engine_writes(engine: Any) -> None:
    layers = [m for part in engine.parts for m in part.modules() if hasattr(m, "global_balance")]
    assert layers and all(m.step_context is engine.step_context for m in layers)
    assert engine.step_context.aux_loss_scale == 1.0 / engine.n_micro
    assert engine.routing.context is engine.step_context
