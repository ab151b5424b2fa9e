"""Hugging Face model families in and out: config and state-dict adapters per family,
import/export, sparse upcycling, generation (docs/interop.md).

Uses model/ and the checkpoints of train/; nothing below imports it (the trainer calls it
only when ``model.init_from`` / ``model.upcycle_from`` is set).
"""

from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families import FAMILIES, export_family, family_of
from moetrain.interop.hf_model import from_hf

__all__ = ["FAMILIES", "HFCheckpointError", "export_family", "family_of", "from_hf"]
