"""Each test starts from a random state of its own (``tests/conftest.py``), whatever ran
before it in the same process: xdist changes that from run to run."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


@pytest.mark.parametrize("run", ["first", "second"])
def test_a_test_starts_from_the_seed_of_its_id(request, run: str) -> None:
    seed = zlib.crc32(request.node.nodeid.encode())
    expected = (
        random.Random(seed).random(),
        float(np.random.RandomState(seed).rand()),
        float(torch.rand(1, generator=torch.Generator().manual_seed(seed))),
    )
    assert _draws() == expected
    for _ in range(100):  # whatever this draws, the next test starts from its own seed
        _draws()
