"""Golden curves: single-process training numbers pinned in tests/golden/ (tests/golden_runs.py).

A change to the single process's numerics fails here and shows as a diff of the files that
its commit must explain. Regenerate deliberately:

    MOETRAIN_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import os

import pytest
from golden_runs import CONFIGS, differences, environment, load, path_of, run, save

UPDATE = "MOETRAIN_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_golden_curves(name: str) -> None:
    got = run(name)
    if os.environ.get("MOETRAIN_UPDATE_GOLDEN"):
        save(got)
    assert path_of(name).is_file(), f"no golden file for {name}: {UPDATE} -k {name}"
    diffs = differences(got, load(name))
    assert not diffs, (
        f"{name}: this run differs from tests/golden/{name}.json\n  "
        + "\n  ".join(diffs[:16])
        + f"\nIf the change is intended, regenerate ({UPDATE} -k {name}) and say why in the "
        "commit."
    )


def test_per_micro_batch_balancing_counts_move_a_golden_curve(monkeypatch) -> None:
    """The escape of tests/faults.py that every layout shares: the global-batch balancing
    loss with each micro-batch's own counts. It changes no forward, so the first loss
    stays; the first gradient norm and every later step move. Compared bit for bit with
    the file where it was written in this environment, else with this environment's own
    unplanted run (what the file would hold here)."""
    from faults import plant

    name = "deepseek_v3_micro"  # 2 micro-batches a step, global-batch balancing loss on
    want = load(name)
    if want["environment"] != environment():
        want = run(name)
    plant("per_micro_batch_counts", monkeypatch.setattr)
    diffs = differences(run(name), want)
    assert diffs, "the planted error left the golden curve unchanged"
    assert diffs[1].startswith("step 0 grad_norm:"), diffs
    assert not any(d.startswith("step 0 loss") for d in diffs), diffs


def test_other_environments_compare_within_the_bound() -> None:
    """Bit for bit in the file's environment, within ``BOUND`` elsewhere (counts then not
    compared): both modes can fail."""
    from golden_runs import BOUND

    want = load("mixtral_micro")
    same = {**want, "loss": [want["loss"][0] * (1 + 1e-9), *want["loss"][1:]]}
    assert differences(same, want)[1].startswith("step 0 loss:")
    elsewhere = {**want, "environment": {**want["environment"], "cpu_capability": "other"}}
    near = {**elsewhere, "loss": [x * (1 + BOUND["loss"] / 10) for x in want["loss"]]}
    counts = [{k: {**v, "tokens_per_expert": [0]} for k, v in m.items()} for m in want["moe"]]
    assert differences({**near, "moe": counts}, want) == []
    far = {**elsewhere, "grad_norm": [*want["grad_norm"][:2], want["grad_norm"][2] * 1.01,
                                      *want["grad_norm"][3:]]}  # fmt: skip
    diffs = differences(far, want)
    assert len(diffs) == 2 and diffs[1].startswith("step 2 grad_norm:"), diffs
