"""Reading a transformers directory into moetrain: config sections, a shape check of every
tensor against config.json, and the weights (whole, or the slices a rank holds via DCP).

    sections(hf)            -> ModelConfig, MoEConfig, the family adapter
    checked_sources(...)    -> moetrain name -> Source, every tensor checked up front and
                               accounted for (read, a verified copy, ignored or refused)
    load_model(model, ...)  one process: fill a Transformer
    load_sharded(state, .)  any layout: dcp.load through HFStorageReader (collective)
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.accounting import TensorAccount, account_tensors
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families import ARCH_MODEL_KEYS, ARCH_MOE_KEYS, Family, family_of
from moetrain.interop.hf_files import HFDirectory
from moetrain.interop.sources import HFStorageReader, Source, read_full


def sections(
    hf: HFDirectory, model: ModelConfig | None = None, moe: MoEConfig | None = None
) -> tuple[ModelConfig, MoEConfig, Family]:
    """The model and moe sections of ``hf``'s architecture: its architecture keys on top of
    ``model`` / ``moe`` (defaults when None), validated."""
    family = family_of(hf.config, hf.key)
    model_keys, moe_keys = family.to_moetrain(hf.config)
    model_keys["mtp_depth"] = family.hf_mtp_depth(hf.config, set(hf.tensors))
    m = dataclasses.replace(model or ModelConfig(), **model_keys)
    e = dataclasses.replace(moe or MoEConfig(), **moe_keys)
    try:
        m.validate()
        e.validate()
    except HFCheckpointError:
        raise
    except ValueError as exc:
        raise HFCheckpointError(
            f"{hf.key}: config.json maps to an invalid moetrain architecture: {exc}"
        ) from None
    return m, e, family


def arch_values(m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
    """The architecture keys of both sections, dotted (``model.dim`` ...)."""
    out = {f"model.{k}": getattr(m, k) for k in ARCH_MODEL_KEYS}
    out.update({f"moe.{k}": getattr(e, k) for k in ARCH_MOE_KEYS})
    return out


def check_sources(hf: HFDirectory, sources: dict[str, Source]) -> None:
    """Every tensor the sources read exists with the shape config.json implies; else one
    error naming the tensor, both shapes and the file."""
    tensors = hf.tensors
    for name, src in sources.items():
        for key, shape in src.hf_shapes().items():
            if key not in tensors:
                raise HFCheckpointError(
                    f"{hf.key}: tensor {key} (for moetrain's {name}) is in no safetensors "
                    f"shard of {hf.path}"
                )
            have = tensors[key].shape
            if shape is not None and have != tuple(shape):
                raise HFCheckpointError(
                    f"{hf.key}: tensor {key} has shape {list(have)} in "
                    f"{tensors[key].file.name}, but config.json implies {list(shape)}"
                )


def checked_sources(
    hf: HFDirectory,
    family: Family,
    m: ModelConfig,
    e: MoEConfig,
    *,
    allow_unused: bool = False,
    accept: str = "allow_unused=True",
    sources: dict[str, Source] | None = None,
) -> tuple[dict[str, Source], TensorAccount]:
    """The sources to fill a model of ``m`` / ``e`` from ``hf`` (the family's, unless
    ``sources`` are given: upcycling's), after the two checks every import makes before it
    reads or writes anything: each tensor they read exists with its shape
    (``check_sources``), and each tensor of the directory is accounted for
    (``accounting.account_tensors``): a tensor that would be lost refuses the import unless
    ``allow_unused`` (``accept`` names how the caller's user says so). Returns the sources
    and the account, whose ``summary()`` the caller prints or logs."""
    if sources is None:
        sources = family.read_sources(m, e, set(hf.tensors))
    check_sources(hf, sources)
    account = account_tensors(hf, family, m, sources)
    account.refuse_unless(allow_unused, hf.key, hf.path, accept)
    return sources, account


def _missing(model: nn.Module, sources: dict[str, Source]) -> list[str]:
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return sorted(params - set(sources))


@torch.no_grad()
def load_model(model: nn.Module, hf: HFDirectory, sources: dict[str, Source]) -> None:
    """Fill every parameter (and sourced buffer) of a single-device model from ``hf``."""
    missing = _missing(model, sources)
    if missing:
        raise HFCheckpointError(f"{hf.key}: no source for {missing[:3]} (adapter bug)")
    for name, t in model.state_dict(keep_vars=True).items():
        if name in sources:
            t.data.copy_(read_full(hf, sources[name]))


def load_sharded(
    state: dict[str, Any], hf: HFDirectory, sources: dict[str, Source], *, distributed: bool
) -> None:
    """Fill a (possibly sharded) model state dict in place through DCP: each rank reads only
    the regions its tensors hold. Keys without a source (e.g. the expert bias of a family
    that has none) keep their value. Collective when ``distributed``."""
    import torch.distributed.checkpoint as dcp

    wanted = {k: v for k, v in state.items() if k in sources}
    with warnings.catch_warnings():
        # One process: DCP warns that it assumes so, which is the point.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, storage_reader=HFStorageReader(hf, sources), no_dist=not distributed)


def read_tokenizer_dir(hf: HFDirectory) -> Path | None:
    return hf.path if hf.has_tokenizer() else None
