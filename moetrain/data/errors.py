"""The one exception type of the data layer."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset, split, column or tokenizer cannot be used. The message names the ``data.*`` key
    to change, so the error reads like a configuration error and is raised before training."""
