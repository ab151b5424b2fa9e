"""The one error of the interop layer: a Hugging Face directory that cannot be used."""

from __future__ import annotations

from moetrain.config import ConfigError


class HFCheckpointError(ConfigError):
    """A Hugging Face directory is missing, incomplete, of an unsupported family or disagrees
    with its own config.json. A ConfigError: raised before any process group starts, and the
    command line reports it as one line."""
