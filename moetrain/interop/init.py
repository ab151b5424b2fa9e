"""``model.init_from`` / ``model.upcycle_from``: a training run that starts from a Hugging
Face checkpoint. The trainer calls two functions, and imports this module only when one of
those keys is set:

    hf_start = prepare_hf_start(cfg)   before anything is built or any process group exists:
                                       config.json's architecture replaces the YAML's (each
                                       replaced value logged), the tokenizer is chosen and
                                       checked against the vocabulary, every tensor's shape
                                       is checked against config.json and every tensor of
                                       the checkpoint is accounted for (one the model would
                                       not use is refused unless
                                       model.allow_unused_tensors)
    hf_start.load(engine)              after the layout is applied: DCP reads, on every rank,
                                       only the slices of the tensors that rank holds
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch.distributed as dist

from moetrain.config import ConfigError, JobConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families import Family, family_of
from moetrain.interop.hf_files import HFDirectory
from moetrain.interop.load import checked_sources, load_sharded
from moetrain.interop.sources import Source
from moetrain.interop.upcycle import check_upcycle, upcycle_sources, warn_upcycle_routing

log = logging.getLogger("moetrain")


@dataclasses.dataclass
class HFStart:
    hf: HFDirectory
    sources: dict[str, Source]

    def names(self) -> set[str]:
        """Every tensor the checkpoint fills (the rest keeps the seed's initial values)."""
        return set(self.sources)

    def load(self, engine: Any) -> None:
        """Fill the engine's model from the checkpoint (collective under a process group)."""
        state = engine.model_state()
        load_sharded(state, self.hf, self.sources, distributed=dist.is_initialized())
        engine.load_model_state(state)
        log.info("initialised from %s (%d tensors)", self.hf.path, len(self.sources))


def _replace(section: Any, name: str, values: dict[str, Any], source: str) -> None:
    for key, value in values.items():
        old = getattr(section, key)
        if old != value:
            log.info("%s.%s: %r -> %r (from %s)", name, key, old, value, source)
            setattr(section, key, value)


def hf_architecture(cfg: JobConfig) -> tuple[HFDirectory, Family]:
    """Replace ``cfg``'s architecture keys (and tokenizer) with those of the checkpoint that
    ``model.init_from`` / ``model.upcycle_from`` names, each replaced value logged, and
    validate the result; raises HFCheckpointError (a ConfigError) naming the problem. What
    ``--print-config`` shows and what the run trains."""
    upcycle = cfg.model.upcycle_from is not None
    key = "model.upcycle_from" if upcycle else "model.init_from"
    hf = HFDirectory(cfg.model.upcycle_from if upcycle else cfg.model.init_from, key)
    family = family_of(hf.config, key)
    model_keys, moe_keys = family.to_moetrain(hf.config)
    model_keys["mtp_depth"] = family.hf_mtp_depth(hf.config, set(hf.tensors))
    source = f"{hf.path}/config.json"
    _replace(cfg.model, "model", model_keys, source)
    if upcycle:
        g = cfg.model.upcycle_granularity
        _replace(cfg.moe, "moe", {"expert_ffn_dim": cfg.model.ffn_dim // g}, source)
        check_upcycle(family, cfg.model, cfg.moe, key)
    else:
        _replace(cfg.moe, "moe", moe_keys, source)
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise HFCheckpointError(f"data.seq_len: {cfg.data.seq_len} exceeds the "
                                f"{cfg.model.max_seq_len} positions of {key}")  # fmt: skip
    try:
        cfg.validate()
    except HFCheckpointError:
        raise
    except ConfigError as exc:
        raise HFCheckpointError(f"{key}: with the architecture of {hf.path}: {exc}") from None
    if hf.has_tokenizer():
        _replace(cfg.data, "data", {"tokenizer": str(hf.path)}, key)
    return hf, family


def prepare_hf_start(cfg: JobConfig) -> HFStart:
    """``hf_architecture``, then the tokenizer against the vocabulary and every tensor's
    shape against config.json: everything checked before a process group starts."""
    hf, family = hf_architecture(cfg)
    upcycle = cfg.model.upcycle_from is not None
    key = "model.upcycle_from" if upcycle else "model.init_from"
    _check_vocabulary(cfg, key)
    sources = None
    if upcycle:
        warn_upcycle_routing(cfg.moe)
        sources = upcycle_sources(family, cfg.model, cfg.moe, cfg.train.seed)
    sources, account = checked_sources(
        hf, family, cfg.model, cfg.moe, sources=sources,
        allow_unused=cfg.model.allow_unused_tensors, accept="model.allow_unused_tensors=true",
    )  # fmt: skip
    log.info("%s %s: %s", key, hf.path, account.summary())
    return HFStart(hf, sources)


def _check_vocabulary(cfg: JobConfig, key: str) -> None:
    from moetrain.data import load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
    vocab = cfg.model.vocab_size or 0
    if tok.vocab_size > vocab:
        raise HFCheckpointError(
            f"{key}: data.tokenizer {cfg.data.tokenizer!r} has token ids up to "
            f"{tok.vocab_size - 1}, but the model's vocabulary has {vocab} entries (give the "
            "directory its own tokenizer.json, or use a tokenizer that fits)"
        )
