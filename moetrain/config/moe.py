"""The ``moe`` section: the MoE layers' routing, capacity and dropping, balancing losses,
expert shapes and the compute path of their kernels."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from moetrain.config.errors import _fail, _positive


@dataclass
class MoEConfig:
    num_experts: int = 8
    """Routed experts E per MoE layer. 0 makes every layer dense."""
    top_k: int = 2
    """Experts each token is sent to (K); 1 <= top_k <= num_experts."""
    every_n_layers: int = 1
    """Layer i (0-based) is an MoE layer when i % every_n_layers == every_n_layers - 1;
    the others use the dense FFN. 1: every layer is MoE."""
    expert_ffn_dim: int = 256
    """Hidden width F of each routed expert's SwiGLU."""
    num_shared_experts: int = 0
    """Shared experts every token goes through (one SwiGLU of width
    ``num_shared_experts * expert_ffn_dim`` unless ``shared_expert_ffn_dim`` is set)."""
    shared_expert_ffn_dim: int | None = None
    """Hidden width of the shared-expert SwiGLU. null: ``num_shared_experts * expert_ffn_dim``."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router score function applied to the fp32 gate logits."""
    renormalize: bool = True
    """Rescale the K selected scores of each token to sum to 1 before combining."""
    jitter_eps: float = 0.0
    """Multiplicative input jitter: during training the router input is scaled by
    U(1 - eps, 1 + eps) per element (Switch Transformer). 0: off."""
    capacity_factor: float | None = None
    """null: dropless. Otherwise each expert accepts at most
    ceil(capacity_factor * group_tokens * top_k / num_experts) tokens per token group."""
    drop_policy: Literal["probs", "position"] = "probs"
    """Which assignments an over-full expert keeps: the highest router scores ("probs")
    or the earliest tokens in the group ("position")."""
    pad_to_capacity: bool = False
    """Pad every expert's rows to exactly its capacity (static shapes). Needs a capacity_factor."""
    token_group_seqs: int | None = None
    """Sequences per token group: the unit over which capacity is applied and the switch
    load-balancing statistics are taken. null: the whole local micro-batch. A fixed value
    makes dropping and the loss independent of micro-batching and data-parallel layout."""
    aux_loss_coef: float = 0.01
    """Coefficient of the switch load-balancing loss E * sum_e f_e * P_e (per token group)."""
    seq_aux_loss_coef: float = 0.0
    """Coefficient of the sequence-level balancing loss (the same statistic per sequence)."""
    global_aux_loss_coef: float = 0.0
    """Coefficient of the global-batch balancing loss (Qwen's "Demons in the Detail",
    Megatron-Core's global_aux_loss): E * sum_e f_e * P_e with f_e counted over every
    micro-batch and data-parallel rank of the optimizer step (no gradient through f) and P_e
    the micro-batch's mean probability. Exact under every layout: with more than one forward
    per rank and step (gradient accumulation, pipelines) the step's counts come from a
    no-grad counting pass over its micro-batches first (one extra forward); docs/moe.md."""
    z_loss_coef: float = 0.001
    """Coefficient of the router z-loss mean(logsumexp(logits)^2)."""
    expert_bias_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): after each optimizer step every expert's
    selection bias moves by this rate toward balance (+rate if under-loaded, -rate if
    over-loaded). 0: off."""
    quantile_balancing: bool = False
    """Quantile balancing (Megatron-Core's ``quantile_balancing``, Kimi K3): loss-free
    balancing through the same selection bias as ``expert_bias_rate``, set rather than
    nudged. Each training token t records, for every expert e, the bias e would need to
    enter its top-k: r_te = c_t - s_te, where s are the router's scores and c_t the (k+1)-th
    highest biased score of t. After each optimizer step an expert's bias becomes the K/E
    quantile of its r over the step's tokens (every micro-batch and data-parallel rank), the
    bias at which exactly T*K/E of the step's T tokens would have chosen it, mean-centred.
    The quantile is read from a histogram of ``quantile_balancing_bins`` bins over
    [min(bias) - 1, max(bias) + 1] (where every r lies), interpolated within its bin: counts
    summed exactly, so every layout computes the same bias. Exclusive with
    ``expert_bias_rate`` and group-limited routing; needs top_k < num_experts. docs/moe.md."""
    quantile_balancing_ema: float = 0.0
    """Memory of quantile balancing: the new bias is ema * previous + (1 - ema) * the
    step's estimate. 0: the step's estimate alone."""
    quantile_balancing_bins: int = 1000
    """Histogram bins per expert of quantile balancing: the estimate's resolution (about
    (max(bias) - min(bias) + 2) / bins) against the bytes every step sums over the ranks
    (8 * num_experts * bins per MoE layer)."""
    kernels: Literal["auto", "torch", "triton"] = "auto"
    """Compute path of the MoE layer: "triton" kernels, pure "torch" (each forced for every
    op), or "auto": on CUDA each op (grouped GEMM forward/dgrad/wgrad, router, permute,
    unpermute) on the implementation measured faster on this GPU for the layer's shape, Triton
    where nothing is measured, logged at start-up (docs/kernels.md); torch elsewhere."""
    dense_layers: list[int] = field(default_factory=list)
    """Layers (0-based) that use the dense FFN whatever ``every_n_layers`` says: DeepSeek-V3's
    first_k_dense_replace = k is [0, ..., k-1], Qwen-MoE's mlp_only_layers is itself."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x . w), a learned per-token gate
    (Qwen2-MoE's shared_expert_gate). Needs num_shared_experts > 0."""
    route_with_bias: bool = False
    """Select experts by score + ``expert_bias`` even when ``expert_bias_rate`` is 0: a loaded,
    frozen selection bias (DeepSeek-V3's e_score_correction_bias). expert_bias_rate > 0
    implies it."""
    n_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts form this many equal groups,
    each scored by the sum of its two highest (bias-corrected) scores, and a token picks its
    top_k experts among the ``topk_groups`` best groups only. 1: off. The Triton router does
    not implement it: the routing step then runs the torch router."""
    topk_groups: int = 1
    """Groups a token may route to under group-limited routing (DeepSeek-V3's topk_group)."""
    group_score: Literal["top2", "max"] = "top2"
    """How group-limited routing scores a group: "top2" the sum of its two highest
    (bias-corrected) scores (DeepSeek-V3's noaux_tc, GLM-4.5), "max" its highest
    (DeepSeek-V2's group_limited_greedy)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' combine weights, after renormalisation
    (DeepSeek-V3's routed_scaling_factor)."""
    router_bias: bool = False
    """A learned bias on the router logits (gpt-oss): it moves the choice and the combine
    weights alike and is trained like the gate, unlike the selection-only ``expert_bias``.
    Starts at 0."""
    expert_ffn_bias: bool = False
    """Biases on the routed experts' projections (gpt-oss's gate_up_proj_bias and
    down_proj_bias): each expert adds its own to its gate, up and down outputs. The down
    bias is added after the combine, weighted like the expert's output (the same sum).
    Start at 0."""
    expert_activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    """How a routed expert joins its gate g and up u projections: "swiglu" silu(g) * u;
    "clamped_swiglu" gpt-oss's (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')
    with g' = min(g, limit) (``swiglu_alpha``, ``swiglu_limit``). Shared experts and dense
    layers stay plain SwiGLU."""
    swiglu_alpha: float = 1.702
    """clamped_swiglu: the sigmoid's gain alpha (gpt-oss: 1.702)."""
    swiglu_limit: float = 7.0
    """clamped_swiglu: the clamp of the gate (above) and of the up projection (both sides)
    (gpt-oss: 7.0)."""
    force_load_balancing: bool = False
    """Benchmark mode: ignore the router's choice and send every token to experts in turn,
    token t (its index in the step's global batch, sequence x seq_len + position) to experts
    (t K + j) mod E, j < K, so that every expert gets exactly its share of each sequence's
    assignments when seq_len K divides by E: the routing that published MoE performance
    tables assume (Megatron-Core's moe_router_force_load_balancing, torchtitan's balanced
    benchmarks), and the routing ``moetrain plan`` prices exactly. Combine
    weights and balancing losses still come from the router's scores. The trained model is
    useless: training refuses it unless ``train.benchmark`` is set, and the run is marked so
    in its logs and TensorBoard (docs/plan.md)."""

    @property
    def selects_with_bias(self) -> bool:
        """Whether experts are selected by score + ``expert_bias`` (a bias that is updated,
        by ``expert_bias_rate`` or quantile balancing, or one loaded and frozen)."""
        return self.route_with_bias or self.expert_bias_rate > 0 or self.quantile_balancing

    def validate(self) -> None:
        if self.num_experts < 0:
            _fail("moe.num_experts", f"must be >= 0, got {self.num_experts}")
        if any(not isinstance(i, int) or i < 0 for i in self.dense_layers):
            _fail("moe.dense_layers", f"must be layer indices >= 0, got {self.dense_layers}")
        if self.num_experts == 0:
            return
        if self.routed_scaling_factor <= 0:
            _fail("moe.routed_scaling_factor", f"must be > 0, got {self.routed_scaling_factor}")
        _positive("moe", self, "swiglu_alpha", "swiglu_limit")
        if self.shared_expert_gate and self.num_shared_experts == 0:
            _fail("moe.shared_expert_gate", "needs moe.num_shared_experts > 0")
        if self.n_groups < 1 or self.num_experts % self.n_groups:
            _fail("moe.n_groups", f"must be >= 1 and divide moe.num_experts="
                  f"{self.num_experts}, got {self.n_groups}")
        if self.n_groups > 1:
            per_group = self.num_experts // self.n_groups
            if per_group < 2 and self.group_score == "top2":
                _fail("moe.n_groups", f"{self.n_groups} groups leave {per_group} expert per "
                      "group; a group is scored by its two best experts")
            if not 1 <= self.topk_groups <= self.n_groups:
                _fail("moe.topk_groups", f"must be in [1, moe.n_groups={self.n_groups}], got "
                      f"{self.topk_groups}")
            if self.top_k > self.topk_groups * per_group:
                _fail("moe.top_k", f"{self.top_k} exceeds the {self.topk_groups * per_group} "
                      f"experts of moe.topk_groups={self.topk_groups} groups")
        elif self.topk_groups != 1:
            _fail("moe.topk_groups", f"needs moe.n_groups > 1, got {self.topk_groups}")
        if not 1 <= self.top_k <= self.num_experts:
            _fail("moe.top_k", f"must be in [1, moe.num_experts={self.num_experts}], "
                  f"got {self.top_k}")
        _positive("moe", self, "every_n_layers", "expert_ffn_dim", "shared_expert_ffn_dim",
                  "token_group_seqs")
        if self.capacity_factor is not None and not (
            self.capacity_factor > 0 and math.isfinite(self.capacity_factor)
        ):
            _fail("moe.capacity_factor", f"must be a finite number > 0 or null (dropless), "
                  f"got {self.capacity_factor}")
        if self.pad_to_capacity and self.capacity_factor is None:
            _fail("moe.pad_to_capacity", "needs moe.capacity_factor (dropless has no capacity)")
        if self.num_shared_experts < 0:
            _fail("moe.num_shared_experts", f"must be >= 0, got {self.num_shared_experts}")
        if not 0 <= self.jitter_eps < 1:
            _fail("moe.jitter_eps", f"must be in [0, 1), got {self.jitter_eps}")
        for name in ("aux_loss_coef", "seq_aux_loss_coef", "global_aux_loss_coef", "z_loss_coef",
                     "expert_bias_rate"):
            if getattr(self, name) < 0:
                _fail(f"moe.{name}", f"must be >= 0, got {getattr(self, name)}")
        if self.quantile_balancing:
            self._validate_quantile_balancing()

    def _validate_quantile_balancing(self) -> None:
        if self.expert_bias_rate > 0:
            _fail("moe.quantile_balancing", "sets the expert bias that moe.expert_bias_rate "
                  f"would also move ({self.expert_bias_rate}): choose one")
        if self.n_groups > 1:
            _fail("moe.quantile_balancing", "is not defined for group-limited routing "
                  f"(moe.n_groups={self.n_groups}): a token's cutoff would depend on its groups")
        if self.top_k >= self.num_experts:
            _fail("moe.quantile_balancing", f"needs moe.top_k < moe.num_experts (got top_k "
                  f"{self.top_k} of {self.num_experts}): every token takes every expert")
        if not 0 <= self.quantile_balancing_ema < 1:
            _fail("moe.quantile_balancing_ema",
                  f"must be in [0, 1), got {self.quantile_balancing_ema}")
        if self.quantile_balancing_bins < 2:
            _fail("moe.quantile_balancing_bins",
                  f"must be >= 2, got {self.quantile_balancing_bins}")
