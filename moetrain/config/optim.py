"""The ``optim`` section: AdamW or Muon, their hyperparameters, the learning-rate schedule
and the dtype of the optimizer's state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.config.errors import _fail, _positive

BF16_MOMENT_MAX_BETA = 0.99
"""Largest AdamW beta with bf16 moments: 1 - beta = 0.01 stays above bf16's relative
half-ulp (2^-9 .. 2^-8), so that a decaying moment still moves."""


MUON_ONLY_KEYS = ("muon_momentum", "muon_ns_steps", "muon_ns_dtype", "muon_update_rms",
                  "muon_embedding", "muon_output", "muon_router", "muon_distributed")
"""The ``optim`` keys that only ``optim.name=muon`` reads."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """The optimizer. adamw: AdamW on every parameter. muon: Muon (docs/optim.md) on every
    hidden weight matrix -- attention and dense-FFN projections, shared experts, the
    multi-token-prediction projection, and each routed expert's matrices, orthogonalized one
    expert at a time -- and AdamW on the rest: embeddings, the output head and the router
    gates (``muon_embedding``, ``muon_output``, ``muon_router``), norms and biases. Both share
    ``lr``, the schedule and ``weight_decay``: Muon's update is scaled to AdamW's update RMS
    (``muon_update_rms``), as Moonlight does, so AdamW's values transfer."""
    lr: float = 3e-3
    """Peak learning rate (of AdamW, and of Muon through ``muon_update_rms``)."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule as a fraction of ``lr``."""
    warmup_steps: int = 20
    """Linear warm-up steps from 0 to ``lr``. At least ``train.steps`` is allowed (the lr then
    rises for the whole run) and warned about when training starts."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Decay after warm-up."""
    weight_decay: float = 0.1
    """Decoupled weight decay, p -= lr x weight_decay x p each step, of AdamW and Muon alike
    (not applied to norms, biases of any shape -- the routed experts' (E, F) and (E, D) ones
    included --, attention sinks and the router's expert bias)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value. null: no clipping."""
    moments_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of AdamW's two moments (exp_avg, exp_avg_sq): fp32 (torch's AdamW), or bf16
    (half their bytes: 12 instead of 16 bytes of model state per parameter under ZeRO-0;
    the update computed in fp32, each moment rounded to nearest once a step; needs beta1
    and beta2 <= 0.99, or a decaying moment would round back to itself). Master weights
    stay fp32 either way (docs/fp8.md). Checkpoints hold the moments in this dtype; a run
    resumes from a checkpoint of either dtype. Under ``name=muon`` Muon's one momentum buffer
    takes this dtype too."""
    muon_momentum: float = 0.95
    """Muon: momentum of the Nesterov update (the buffer is an exponential average of the
    gradients with this decay, as torch.optim.Muon keeps it)."""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations of the quintic (3.4445, -4.7750, 2.0315) that
    orthogonalizes each update matrix."""
    muon_ns_dtype: Literal["bf16", "fp32"] = "bf16"
    """Muon: the dtype Newton-Schulz runs in: bf16 as the reference implementations
    (Keller Jordan's, Moonlight's, torch.optim.Muon) do, or fp32. A matrix split over ranks
    is moved in this dtype."""
    muon_distributed: Literal["owners", "gather"] = "owners"
    """Muon: who orthogonalizes a matrix that ranks hold in slices (ZeRO-2/3 and HSDP
    shards, TP blocks, expert-TP slices). owners: one rank of its holders, the matrices
    shared out by Newton-Schulz FLOPs; the slices are sent to it and the result's slices
    returned (all-to-alls: 1 / n of gather's FLOPs per rank, 2 / n of its bytes).
    gather: every holder gathers it whole and repeats the iteration (Moonlight's
    distributed Muon). Both give the same bits. ZeRO-1's flat slices are always gathered."""
    muon_update_rms: float = 0.2
    """Muon: the update of an A x B matrix is scaled by this x sqrt(max(A, B)), which gives
    it about this RMS -- AdamW's typical update RMS (Moonlight's 0.2), so that ``lr`` and
    ``weight_decay`` tuned for AdamW transfer."""
    muon_embedding: bool = False
    """Muon: update the token embedding with Muon too (false: AdamW, as Moonlight does; a
    tied embedding counts as the embedding)."""
    muon_output: bool = False
    """Muon: update the output head with Muon too (false: AdamW, as Moonlight does)."""
    muon_router: bool = False
    """Muon: update the router gates (each MoE layer's expert router and the shared
    experts' gate) with Muon too (false: AdamW). Router biases and the expert-selection bias
    are never Muon's: one is a bias, the other a buffer the balancing rule moves."""

    qk_clip: float | None = None
    """QK-clip (Kimi K2's MuonClip, docs/optim.md): the threshold tau. Every attention head
    whose largest pre-softmax logit (q.k x the softmax scale) in a step's training forwards,
    over every rank, exceeded tau gets its query and key projections rescaled after the
    optimizer step, by gamma = tau / that maximum in all, so that the same logits would end
    at tau. With AdamW or Muon; not with ``model.qk_norm`` or ``model.clip_qkv``, which come
    after the projections. ``.inf``: record and log the maxima, rescale nothing. null: off
    (nothing recorded)."""

    def validate(self) -> None:
        _positive("optim", self, "lr", "eps", "grad_clip", "qk_clip")
        if self.name not in ("adamw", "muon"):
            _fail("optim.name", f"expected adamw or muon, got {self.name!r}")
        if self.name == "adamw":
            default = OptimConfig(name="muon")
            for key in MUON_ONLY_KEYS:
                if getattr(self, key) != getattr(default, key):
                    _fail(f"optim.{key}", f"{getattr(self, key)!r} is a Muon setting, but "
                          "optim.name is adamw; set optim.name=muon or leave it out")
        else:
            self._validate_muon()
        if self.moments_dtype not in ("fp32", "bf16"):
            _fail("optim.moments_dtype", f"expected fp32 or bf16, got {self.moments_dtype!r}")
        if self.moments_dtype == "bf16":
            for name in ("beta1", "beta2"):
                if getattr(self, name) > BF16_MOMENT_MAX_BETA:
                    _fail(f"optim.{name}", f"{getattr(self, name)} with optim.moments_dtype=bf16: "
                          f"must be <= {BF16_MOMENT_MAX_BETA} (a bf16 moment that decays by "
                          "1 - beta < 2^-8 a step rounds back to itself); use "
                          "optim.moments_dtype=fp32")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail("optim.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            _fail("optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(f"optim.{name}", f"must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0:
            _fail("optim.weight_decay", f"must be >= 0, got {self.weight_decay}")

    def _validate_muon(self) -> None:
        if not 0 <= self.muon_momentum < 1:
            _fail("optim.muon_momentum", f"must be in [0, 1), got {self.muon_momentum}")
        if self.moments_dtype == "bf16" and self.muon_momentum > BF16_MOMENT_MAX_BETA:
            _fail("optim.muon_momentum", f"{self.muon_momentum} with optim.moments_dtype=bf16: "
                  f"must be <= {BF16_MOMENT_MAX_BETA} (a bf16 buffer that decays by "
                  "1 - momentum < 2^-8 a step rounds back to itself)")
        if not 1 <= self.muon_ns_steps < 100:
            _fail("optim.muon_ns_steps", f"must be in [1, 99], got {self.muon_ns_steps}")
        if self.muon_distributed not in ("owners", "gather"):
            _fail("optim.muon_distributed",
                  f"expected owners or gather, got {self.muon_distributed!r}")
        if self.muon_ns_dtype not in ("bf16", "fp32"):
            _fail("optim.muon_ns_dtype", f"expected bf16 or fp32, got {self.muon_ns_dtype!r}")
        _positive("optim", self, "muon_update_rms")
