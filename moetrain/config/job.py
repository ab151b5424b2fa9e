"""The whole job's config, ``JobConfig``: one field per section, the checks that span
sections, and its keys as ``section.key`` (``flat_keys``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moetrain.config.data import DataConfig
from moetrain.config.errors import _fail
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.optim import OptimConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.config.train import LogConfig, TrainConfig


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Transformer shape."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts layers: routing, capacity, balancing."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset, tokenizer and packing."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch sizes, evaluation and checkpoints."""
    log: LogConfig = field(default_factory=LogConfig)
    """Console and TensorBoard logging."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""

    def validate(self) -> JobConfig:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        if self.data.seq_len > self.model.max_seq_len:
            _fail("data.seq_len", f"{self.data.seq_len} exceeds model.max_seq_len="
                  f"{self.model.max_seq_len}")
        moe = self.moe
        late = [i for i in moe.dense_layers if i >= self.model.n_layers]
        if late:
            _fail("moe.dense_layers", f"{late} are not layers of a model.n_layers="
                  f"{self.model.n_layers} model")
        if self.model.mtp_depth:
            for key, value in (("train.routing_replay", self.train.routing_replay is not None),
                               ("train.record_routing", self.train.record_routing)):  # fmt: skip
                if value:
                    _fail(key, "is not supported with model.mtp_depth > 0 (routing files "
                          "hold the main layers' routing)")
        if moe.force_load_balancing:
            if moe.num_experts == 0:
                _fail("moe.force_load_balancing", "needs MoE layers: moe.num_experts is 0")
            if not self.train.benchmark:
                _fail("moe.force_load_balancing", "routes every token by its position, not by "
                      "the router: the trained model is useless. It is a benchmark mode; set "
                      "train.benchmark=true to run it as one")
            if self.train.routing_replay is not None:
                _fail("moe.force_load_balancing", "and train.routing_replay both replace the "
                      "router's choice; set one of them")
        if self.train.resume_allow_changes:  # flat_keys copies the whole config: only if asked
            keys = flat_keys(self)
            unknown = [k for k in self.train.resume_allow_changes if k not in keys]
            if unknown:
                _fail("train.resume_allow_changes", f"{unknown} are not config keys (write "
                      "them as section.key, e.g. moe.top_k)")
        if self.optim.qk_clip is not None:
            for key, value in (("model.qk_norm", self.model.qk_norm != "none"),
                               ("model.clip_qkv", self.model.clip_qkv is not None)):  # fmt: skip
                if value:
                    _fail("optim.qk_clip", f"cannot bound the logits with {key} set: it acts "
                          "on q and k after the projections QK-clip rescales, so the rescale "
                          f"no longer scales the logits; leave out {key} or optim.qk_clip")
        if self.model.upcycle_from is not None and moe.num_experts == 0:
            _fail("model.upcycle_from", "needs MoE layers: set moe.num_experts > 0")
        if moe.token_group_seqs is not None and moe.num_experts:
            if self.train.micro_batch_size % moe.token_group_seqs:
                _fail("moe.token_group_seqs", f"{moe.token_group_seqs} does not divide "
                      f"train.micro_batch_size={self.train.micro_batch_size}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)



def flat_keys(cfg: JobConfig) -> dict[str, Any]:
    """Every key of ``cfg`` as ``section.key`` -> value."""
    return {f"{section}.{k}": v for section, values in cfg.to_dict().items()
            for k, v in values.items()}  # fmt: skip
