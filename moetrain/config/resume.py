"""The resume policy: what changing each key does to a resumed run (``RESUME_KEYS``), and
the changes between a checkpoint's saved config and this run's (``resume_changes``).
``moetrain/train/resume.py`` acts on them; docs/checkpoints.md is the user's version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from moetrain.config.job import JobConfig, flat_keys

ResumeKind = Literal["free", "saved", "function", "optimizer"]

RESUME_KEYS: dict[str, tuple[ResumeKind, str]] = {
    # What changing a key does to a resumed run: the one table of it. A key, or "section.*"
    # for every key of a section (an exact key wins). Kinds:
    #   free      the model computes the same function and the data stream is the same
    #             (precision, compute path, layout, logging, cadence, run length): accepted;
    #   saved     restored from the checkpoint (the optimizer's hyperparameters and the
    #             learning-rate schedule): accepted, and the log says the value is not used;
    #   function  the model would compute something else from the same weights, or read
    #             another data stream than the one its saved position belongs to: refused,
    #             naming the keys, unless train.resume_allow_changes lists them.
    #   optimizer the checkpoint's optimizer state does not fit the optimizer the run
    #             builds (another optimizer, or parameters moved between Muon and AdamW):
    #             refused, naming the keys, even when train.resume_allow_changes lists them
    #             (a new run can start from the weights: docs/checkpoints.md).
    # A key this table does not name is "function": a new key is refused on resume until it
    # is classified here, and tests/test_config.py fails for any key the table leaves out.
    "model.*": ("function", "architecture, attention and positions"),
    "model.attention_backend": ("free", "compute path: sdpa and flex give the same numbers"),
    "model.init_from": ("free", "where a run's first weights come from; a resume reads the "
                        "checkpoint's"),
    "model.upcycle_from": ("free", "where a run's first weights come from"),
    "model.upcycle_granularity": ("free", "how a run's first weights are made"),
    "model.upcycle_router_std": ("free", "how a run's first weights are made"),
    "model.upcycle_noise": ("free", "how a run's first weights are made"),
    "model.allow_unused_tensors": ("free", "whether a run's first weights may leave tensors of "
                                   "their checkpoint unused"),
    "model.mtp_loss_weight": ("free", "a loss weight: the objective of the next steps"),
    "moe.*": ("function", "routing, scores, capacity and experts"),
    "moe.kernels": ("free", "compute path: Triton and torch give the same numbers"),
    "moe.aux_loss_coef": ("free", "a loss weight: the objective of the next steps"),
    "moe.seq_aux_loss_coef": ("free", "a loss weight: the objective of the next steps"),
    "moe.global_aux_loss_coef": ("free", "a loss weight: the objective of the next steps"),
    "moe.z_loss_coef": ("free", "a loss weight: the objective of the next steps"),
    "data.*": ("function", "the data stream: the saved position is a position in it"),
    "data.tokenizer": ("function", "what the token ids mean"),
    "data.literal_special_tokens": ("function", "what the token ids mean"),
    "data.domain_column": ("free", "reporting: the specialization view's domains"),
    "data.cache_dir": ("free", "where caches live"),
    "data.trust_remote_code": ("free", "a permission"),
    "optim.*": ("saved", "the optimizer state and the learning-rate schedule are the "
                "checkpoint's"),
    "optim.grad_clip": ("free", "applied at every step from the config"),
    "optim.qk_clip": ("free", "applied after every step from the config"),
    "optim.muon_distributed": ("free", "who computes Newton-Schulz; the same bits either way"),
    "optim.moments_dtype": ("free", "precision: the saved moments are loaded and rounded to "
                            "this dtype"),
    "optim.name": ("optimizer", "the checkpoint's optimizer state is another optimizer's"),
    "optim.muon_embedding": ("optimizer", "moves the embedding to another optimizer, whose "
                             "state the checkpoint does not hold"),
    "optim.muon_output": ("optimizer", "moves the output head to another optimizer, whose "
                          "state the checkpoint does not hold"),
    "optim.muon_router": ("optimizer", "moves the router gates to another optimizer, whose "
                          "state the checkpoint does not hold"),
    "train.steps": ("free", "run length"),
    "train.global_batch_size": ("function", "the saved data position counts steps of this "
                                "many sequences"),
    "train.micro_batch_size": ("free", "gradient accumulation: the same numbers"),
    "train.seed": ("function", "the router jitter's noise is drawn from it"),
    "train.device": ("free", "precision and compute"),
    "train.dtype": ("free", "precision"),
    "train.fp8": ("free", "precision: checkpoints hold the high-precision weights"),
    "train.fp8_experts": ("free", "precision"),
    "train.fp8_backend": ("free", "compute path: the same FP8 values"),
    "train.output_dir": ("free", "where the run writes"),
    "train.eval_every": ("free", "evaluation cadence"),
    "train.eval_batches": ("free", "evaluation size"),
    "train.checkpoint_every": ("free", "checkpoint cadence"),
    "train.keep_last": ("free", "checkpoint retention"),
    "train.checkpoint_async": ("free", "how checkpoints are written"),
    "train.resume": ("free", "which checkpoint"),
    "train.resume_allow_changes": ("free", "this list"),
    "train.compile": ("free", "compute path"),
    "train.nonfinite_policy": ("free", "failure policy"),
    "train.max_nonfinite_skips": ("free", "failure policy"),
    "train.collective_timeout_s": ("free", "failure policy"),
    "train.routing_replay": ("function", "the routing of the training forward"),
    "train.record_routing": ("free", "logging"),
    "train.benchmark": ("free", "a permission (moe.force_load_balancing is refused on its own)"),
    "train.memory_check": ("free", "a start-up check"),
    "train.memory_per_rank_gb": ("free", "a start-up check's figure"),
    "log.*": ("free", "logging and warnings"),
    "parallel.*": ("free", "layout: checkpoints reshard, and every layout gives one "
                   "process's numbers"),
}  # fmt: skip



def resume_kind(key: str) -> tuple[ResumeKind, str] | None:
    """``RESUME_KEYS``'s entry for ``key`` (exact, else its section's), or None."""
    return RESUME_KEYS.get(key) or RESUME_KEYS.get(key.split(".")[0] + ".*")


@dataclass
class ResumeChange:
    key: str
    saved: Any
    now: Any
    kind: ResumeKind
    why: str

    def __str__(self) -> str:
        return f"{self.key} {self.saved!r} -> {self.now!r}"


def resume_changes(saved: dict[str, Any], cfg: JobConfig) -> list[ResumeChange]:
    """The keys whose value in ``cfg`` differs from the checkpoint's config ``saved`` (a
    ``JobConfig.to_dict()``), with their kind. A key the checkpoint's config lacks (added
    since it was written) counts with its default, the behaviour before it existed."""
    defaults = flat_keys(JobConfig())
    before = {f"{section}.{k}": v for section, values in saved.items()
              if isinstance(values, dict) for k, v in values.items()}  # fmt: skip
    changes = []
    for key, now in flat_keys(cfg).items():
        was = before.get(key, defaults[key])
        if _plain(was) != _plain(now):
            kind, why = resume_kind(key) or ("function", "not classified in RESUME_KEYS")
            changes.append(ResumeChange(key, was, now, kind, why))
    return changes


def _plain(value: Any) -> Any:
    """Tuples as lists and ints as floats, as YAML and JSON round trips give them back."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value
