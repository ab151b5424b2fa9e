"""Job configuration: one dataclass per section, loaded from YAML plus dotted overrides.

The dataclasses here are the source of truth for every key (``docs/config.md`` lists
them). Every field has a docstring; each section validates its own fields in
``validate()``, and ``JobConfig.validate()`` checks what spans sections. All of it
runs before any model, dataset or process group is built, and every error names the
key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or impossible. The message names the key."""


def _fail(key: str, msg: str) -> None:
    raise ConfigError(f"{key}: {msg}")


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            _fail(f"{section}.{name}", f"must be > 0, got {value}")


@dataclass
class ModelConfig:
    vocab_size: int | None = None
    """Vocabulary size. null: taken from the tokenizer."""
    dim: int = 256
    """Model (residual stream) width D."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 8
    """Attention (query) heads; must divide ``dim``."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; must divide ``n_heads``. null: ``n_heads``."""
    ffn_dim: int = 688
    """Hidden width of the SwiGLU FFN in dense (non-MoE) layers."""
    max_seq_len: int = 256
    """Longest sequence the RoPE tables cover; ``data.seq_len`` must not exceed it."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    head_dim: int | None = None
    """Width of each attention head's q, k and v (grouped-query attention), independent of
    ``dim / n_heads`` (Qwen3 uses 128 with any width). null: ``dim // n_heads``."""
    rope_style: Literal["interleaved", "half"] = "interleaved"
    """Which dimensions RoPE rotates together: "interleaved" consecutive pairs (x0, x1),
    (x2, x3)... (moetrain's original layout, Meta's Llama and DeepSeek's reference code), or
    "half" the pairs (x_i, x_{i + Dh/2}) of transformers' rotate_half. The two differ by a
    permutation of the q/k projection rows, so a checkpoint is only valid with the style it
    was trained with (it is part of the checkpoint fingerprint)."""
    rope_scaling: Literal["none", "linear", "yarn", "llama3"] = "none"
    """RoPE frequency scaling for long contexts: "linear" (position interpolation), "yarn"
    (YaRN, DeepSeek-V3 and Qwen3 long-context), "llama3" (Llama 3.1's), or "none"."""
    rope_scaling_factor: float = 1.0
    """Context-extension factor of ``rope_scaling`` (transformers' ``factor``)."""
    rope_original_max_seq_len: int | None = None
    """Pretraining context of a yarn / llama3 scaled RoPE (``original_max_position_embeddings``).
    Required by those two."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is left unscaled (``beta_fast``)."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is fully interpolated (``beta_slow``)."""
    rope_yarn_mscale: float = 0.0
    """YaRN ``mscale``; with ``rope_yarn_mscale_all_dim`` both > 0 the cos/sin factor is
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (DeepSeek-V3), else
    0.1 * ln(factor) + 1. 0: unset."""
    rope_yarn_mscale_all_dim: float = 0.0
    """YaRN ``mscale_all_dim``; multi-head latent attention also multiplies its softmax scale
    by (0.1 * mscale_all_dim * ln(factor) + 1)^2 when it is > 0 (DeepSeek-V3). 0: unset."""
    rope_yarn_truncate: bool = True
    """YaRN: round the ramp's correction range out to whole dimensions (transformers'
    ``truncate``, on by default); false keeps its fractional ends (gpt-oss)."""
    rope_llama3_low_freq_factor: float = 1.0
    """llama3 RoPE scaling: ``low_freq_factor``."""
    rope_llama3_high_freq_factor: float = 4.0
    """llama3 RoPE scaling: ``high_freq_factor``."""
    partial_rotary_factor: float = 1.0
    """Fraction of each grouped-query attention head's q/k dims that RoPE rotates: the first
    int(factor * head dim), in the pairing of ``rope_style``; the rest carry no position
    (GLM-4.5: 0.5; MiniMax-M2: rotary_dim / head_dim). 1: every dim. Multi-head latent
    attention has its own split (``qk_rope_head_dim``)."""
    qk_norm: Literal["none", "head", "full"] = "none"
    """RMSNorm on queries and keys before RoPE: "head" normalises each head's Dh values with
    one weight shared by the heads (Qwen3); "full" normalises the whole q and k projections
    at once, one weight per channel (OLMoE; cannot be split over tensor-parallel ranks)."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2-MoE; transformers' ``attention_bias``
    sets both this and ``out_bias``)."""
    out_bias: bool = False
    """Bias on the attention output projection."""
    attention_sinks: bool = False
    """A learned logit per attention head in the softmax's denominator (gpt-oss's sinks): a
    query's weights over the keys sum to less than one, so a head may attend to almost
    nothing. Each starts at 0. Grouped-query attention with attention_backend=sdpa."""
    clip_qkv: float | None = None
    """Clamp q, k and v to [-clip_qkv, clip_qkv] after the projections (OLMoE). null: off."""
    attention: Literal["gqa", "mla"] = "gqa"
    """"gqa": grouped-query attention (``n_heads``, ``n_kv_heads``, ``head_dim``). "mla":
    DeepSeek's multi-head latent attention: queries through a ``q_lora_rank`` bottleneck,
    keys and values from one ``kv_lora_rank`` latent, RoPE on a separate ``qk_rope_head_dim``
    part shared by all heads."""
    q_lora_rank: int | None = None
    """MLA: rank of the query down-projection (followed by an RMSNorm). null: a full-rank
    query projection."""
    kv_lora_rank: int | None = None
    """MLA: width of the compressed key/value latent. Required with attention=mla."""
    qk_nope_head_dim: int | None = None
    """MLA: per-head query/key width without RoPE. Required with attention=mla."""
    qk_rope_head_dim: int | None = None
    """MLA: per-head query/key width that RoPE rotates (the key part is shared by all heads).
    Required with attention=mla."""
    v_head_dim: int | None = None
    """MLA: per-head value width. Required with attention=mla."""
    mtp_depth: int = 0
    """Multi-token prediction modules D (DeepSeek-V3, GLM-4.5; config.json's
    num_nextn_predict_layers): module k predicts each position's token k + 1 places ahead
    from module k - 1's hidden state and the embedding of the token k places ahead, through
    a transformer block of its own and the shared output head (docs/interop.md). Trained
    with ``mtp_loss_weight``; inference ignores them. 0: none."""
    mtp_loss_weight: float = 0.3
    """lambda of the multi-token-prediction loss lambda / D * sum_k L^k, added to the LM loss
    (DeepSeek-V3: 0.3, then 0.1)."""
    document_mask: bool = False
    """Block-causal attention over packed documents: a token attends only to the earlier
    tokens of its own document, and the separator that ends a document predicts nothing (its
    label, the next document's first token, is left out of the loss and of every router
    loss and statistic). Off: plain causal attention over the whole packed sequence
    (docs/attention.md)."""
    document_positions: bool = False
    """RoPE (and YaRN) positions restart at 0 at every document's first token, and at every
    sequence's, instead of running on over the packed sequence. Needs document_mask."""
    sliding_window: int | None = None
    """Sliding-window attention: a token attends to the ``sliding_window`` latest positions,
    its own included (Mistral, gpt-oss), on the layers ``sliding_window_layers`` names.
    null: every layer attends to every earlier position."""
    sliding_window_layers: list[int] | None = None
    """Layers (0-based) that use ``sliding_window``; the others attend to every earlier
    position (gpt-oss alternates sliding and full layers: [0, 2, 4, ...]). null: every
    layer."""
    attention_backend: Literal["sdpa", "flex"] = "sdpa"
    """How masked attention runs: "sdpa" (``scaled_dot_product_attention``: ``is_causal``
    for plain causal attention, an explicit boolean mask for documents and windows) or
    "flex" (FlexAttention with a block mask, compiled; fully masked blocks are skipped).
    Both give the same numbers; docs/attention.md measures them."""
    init_from: str | None = None
    """A local directory saved by transformers (config.json + safetensors) to start from: its
    architecture replaces this section's and the moe section's architecture keys (each
    replaced value is logged), its weights are read, each rank reading only the slices it
    holds, and its tokenizer is used when it has one (docs/interop.md)."""
    upcycle_from: str | None = None
    """A dense transformers checkpoint (Llama, Mistral, Qwen2, Qwen3) to upcycle: attention,
    norms and embeddings are copied, and every MoE layer's experts are copies of the dense
    FFN (split into ``upcycle_granularity`` parts). The moe section says how many experts."""
    upcycle_granularity: int = 1
    """Sparse upcycling: split each dense FFN into this many parts of ``ffn_dim / g`` hidden
    units; expert e copies part e % g (moe.expert_ffn_dim must be ffn_dim / g). 1: every
    expert is a whole copy, which reproduces the dense model at step 0 with renormalised
    top-k."""
    upcycle_router_std: float = 0.0
    """Sparse upcycling: standard deviation of the router's normal initialisation (0: a zero
    router, every expert scored alike)."""
    upcycle_noise: float = 0.0
    """Sparse upcycling: multiply every copied expert weight by (1 + N(0, noise^2)) so that
    the copies can diverge (0: exact copies)."""
    allow_unused_tensors: bool = False
    """``init_from`` / ``upcycle_from``: start even when some tensors of the checkpoint would
    not be used (a layer beyond its config.json's count, a module its family does not have,
    a copy of a shared embedding or head that differs from it); the log names each. false:
    such a start is refused before anything is written, naming the tensors and why
    (docs/interop.md). It decides whether a start may drop tensors, not what the model
    computes from those it reads, so it has no cell in the equivalence matrix."""

    def validate(self) -> None:
        _positive("model", self, "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                  "ffn_dim", "max_seq_len", "rope_theta", "norm_eps", "init_std", "head_dim",
                  "rope_scaling_factor", "rope_original_max_seq_len", "clip_qkv",
                  "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "upcycle_granularity")
        if self.head_dim is None and self.dim % self.n_heads:
            _fail("model.dim", f"{self.dim} is not divisible by model.n_heads={self.n_heads} "
                  "(or set model.head_dim)")
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) is None:
                    _fail(f"model.{name}", "required with model.attention=mla")
            if self.qk_rope_head_dim % 2:
                _fail("model.qk_rope_head_dim", f"{self.qk_rope_head_dim} must be even for "
                      "RoPE")
            if self.partial_rotary_factor != 1:
                _fail("model.partial_rotary_factor", "applies to attention=gqa only; multi-head "
                      "latent attention rotates model.qk_rope_head_dim")
            for name in ("qk_norm", "qkv_bias", "out_bias", "clip_qkv", "head_dim",
                         "attention_sinks"):
                if getattr(self, name) not in (None, False, "none"):
                    _fail(f"model.{name}", "applies to attention=gqa only; multi-head latent "
                          "attention has its own latent norms and no biases")
        elif not 0 < self.partial_rotary_factor <= 1:
            _fail("model.partial_rotary_factor", f"must be in (0, 1], got "
                  f"{self.partial_rotary_factor}")
        elif self.partial_rotary_factor != 1 and (self.rope_dim % 2 or self.rope_dim == 0):
            _fail("model.partial_rotary_factor", f"rotates {self.rope_dim} dims of each head; "
                  "RoPE needs an even number > 0")
        elif self.rope_dim % 2:
            key = "model.head_dim" if self.head_dim is not None else "model.dim"
            _fail(key, f"head dim {self.rope_dim} must be even for RoPE")
        kv = self.kv_heads
        if self.n_heads % kv:
            _fail("model.n_kv_heads", f"{kv} does not divide model.n_heads={self.n_heads}")
        if self.rope_scaling in ("yarn", "llama3") and self.rope_original_max_seq_len is None:
            _fail("model.rope_original_max_seq_len", f"required with "
                  f"model.rope_scaling={self.rope_scaling!r}")
        if self.rope_scaling != "none" and self.rope_scaling_factor < 1:
            _fail("model.rope_scaling_factor", f"must be >= 1 with model.rope_scaling="
                  f"{self.rope_scaling!r}, got {self.rope_scaling_factor}")
        if self.mtp_depth:
            for name in ("document_mask", "sliding_window"):
                if getattr(self, name) not in (None, False):
                    _fail(f"model.{name}", "is not supported with model.mtp_depth > 0 (the "
                          "multi-token-prediction modules attend causally over the whole "
                          "sequence)")
        for name in ("rope_yarn_mscale", "rope_yarn_mscale_all_dim", "upcycle_router_std",
                     "upcycle_noise", "mtp_depth", "mtp_loss_weight"):
            if getattr(self, name) < 0:
                _fail(f"model.{name}", f"must be >= 0, got {getattr(self, name)}")
        if self.rope_llama3_high_freq_factor <= self.rope_llama3_low_freq_factor:
            _fail("model.rope_llama3_high_freq_factor", f"must exceed "
                  f"model.rope_llama3_low_freq_factor={self.rope_llama3_low_freq_factor}")
        if self.attention_sinks and self.attention_backend == "flex":
            _fail("model.attention_backend", "flex does not run model.attention_sinks (the "
                  "sink is a key FlexAttention's block mask has no column for); use sdpa")
        if self.document_positions and not self.document_mask:
            _fail("model.document_positions", "needs model.document_mask=true (positions "
                  "restart at documents that the attention keeps apart)")
        if self.sliding_window is not None and self.sliding_window < 1:
            _fail("model.sliding_window", f"must be >= 1 or null, got {self.sliding_window}")
        if self.sliding_window_layers is not None:
            if self.sliding_window is None:
                _fail("model.sliding_window_layers", "needs model.sliding_window")
            bad = [i for i in self.sliding_window_layers
                   if not isinstance(i, int) or not 0 <= i < self.n_layers]
            if bad:
                _fail("model.sliding_window_layers", f"{bad} are not layers of a "
                      f"model.n_layers={self.n_layers} model")
        if self.init_from is not None and self.upcycle_from is not None:
            _fail("model.upcycle_from", "model.init_from is set too; start from one of them")
        if self.allow_unused_tensors and self.init_from is None and self.upcycle_from is None:
            _fail("model.allow_unused_tensors", "applies to model.init_from and "
                  "model.upcycle_from, and neither is set")
        for name in ("init_from", "upcycle_from"):
            path = getattr(self, name)
            if path is not None and not Path(path).expanduser().is_dir():
                _fail(f"model.{name}", f"{path!r} is not a directory (a local directory saved "
                      "by transformers' save_pretrained)")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def attn_head_dim(self) -> int:
        """Per-head q/k/v width of grouped-query attention."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def window(self, layer_id: int) -> int | None:
        """The sliding window of layer ``layer_id`` (None: it attends to every position)."""
        layers = self.sliding_window_layers
        return self.sliding_window if layers is None or layer_id in layers else None

    @property
    def rope_dim(self) -> int:
        """Width of the part of each head that RoPE rotates."""
        if self.attention == "mla":
            assert self.qk_rope_head_dim is not None
            return self.qk_rope_head_dim
        return int(self.attn_head_dim * self.partial_rotary_factor)


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


@dataclass
class DataConfig:
    dataset: str = "default"
    """"default" (the embedded corpus), a Hugging Face hub dataset name, local files (a file,
    a directory or a glob of .txt/.json/.jsonl/.parquet files), or a prepared dataset: a
    directory written by ``moetrain prepare-data``, read through memory maps (the keys that
    say what to read and how to split it were applied when it was prepared)."""
    dataset_config: str | None = None
    """Hub dataset configuration name (the second argument of ``load_dataset``)."""
    format: Literal["text", "json", "parquet"] | None = None
    """Format of local files. null: inferred from the file extension."""
    split: str = "train"
    """Split to train on."""
    eval_split: str | None = None
    """Split for the held-out eval loss. null: the default corpus's own eval split; for any
    other dataset, ``eval_fraction`` of ``split``'s documents, held out by index (training
    then skips them)."""
    eval_fraction: float = 0.02
    """Fraction of ``split``'s documents held out for eval when ``eval_split`` is null (unused
    with the default corpus, which has its own eval split)."""
    text_column: str = "text"
    """Column holding the text."""
    domain_column: str | None = None
    """Column naming each document's domain (e.g. "web", "code"), for the expert-
    specialization view: each expert's share of every domain's eval tokens. null: "domain"
    for the embedded corpus (prose and code), none for other datasets. Not available with
    prepared datasets, mixtures or streaming (their documents keep only the text)."""
    streaming: bool = False
    """Stream the dataset instead of downloading/materialising it. Every rank reads and
    tokenizes the whole stream (in a background thread); for large corpora use
    ``moetrain prepare-data`` instead. Not used for prepared datasets."""
    trust_remote_code: bool = False
    """Allow a hub dataset to run its own loading script. Off: nothing loaded runs code."""
    tokenizer: str = "default"
    """"default" (byte-level BPE trained once on the embedded corpus and cached), a
    tokenizer.json file, or a local Hugging Face tokenizer folder."""
    seq_len: int = 256
    """Tokens per packed training sequence."""
    literal_special_tokens: Literal["text", "special"] = "text"
    """How the text of a special token inside a document (such as "<|endoftext|>") is
    encoded: "text", as the ordinary text it is (its characters' tokens), so that only the
    separator moetrain appends after each document carries the end-of-text id; "special",
    as the special token's id (moetrain's earlier behaviour, and what a tokenizer's plain
    encode does: such text then reads as a document boundary)."""
    seed: int = 0
    """Seed of the document shuffle; the data order depends on it alone."""
    cache_dir: str | None = None
    """Where the default corpus, tokenizer and token caches live. null: ~/.cache/moetrain."""
    mix: str | None = None
    """Train on several prepared datasets (``moetrain prepare-data`` directories) mixed by
    weight: "DIR:WEIGHT,DIR:WEIGHT,...". Each training sequence comes from one of them, drawn
    with probability weight / sum of weights from (``seed``, sequence index); eval mixes their
    eval splits the same way. null: train on ``dataset`` (which must then stay "default")."""

    def mix_entries(self) -> list[tuple[str, float]]:
        """``mix`` parsed: [(directory, weight), ...]; empty when ``mix`` is null."""
        if self.mix is None:
            return []
        entries = []
        for item in self.mix.split(","):
            path, sep, weight = item.strip().rpartition(":")
            try:
                value = float(weight)
            except ValueError:
                value = math.nan
            if not sep or not path or not (value > 0 and math.isfinite(value)):
                _fail("data.mix", f"{item.strip()!r} is not DIR:WEIGHT with a weight > 0; "
                      "write e.g. 'data/web:0.7,data/code:0.3'")
            entries.append((path, value))
        return entries

    def validate(self) -> None:
        _positive("data", self, "seq_len")
        if not self.dataset:
            _fail("data.dataset", "must be 'default', a hub dataset name or a local path")
        if self.mix is not None:
            entries = self.mix_entries()
            paths = [p for p, _ in entries]
            dup = next((p for p in paths if paths.count(p) > 1), None)
            if dup is not None:
                _fail("data.mix", f"{dup!r} is listed twice; give each dataset one weight")
            missing = next((p for p in paths if not Path(p).expanduser().is_dir()), None)
            if missing is not None:
                _fail("data.mix", f"{missing!r} is not a directory; list prepared datasets "
                      "(made by `moetrain prepare-data`)")
            if self.dataset != "default":
                _fail("data.mix", f"set, and data.dataset={self.dataset!r} too: the mixture "
                      "replaces data.dataset; leave data.dataset unset")
        if not 0 < self.eval_fraction < 1:
            _fail("data.eval_fraction", f"must be in (0, 1), got {self.eval_fraction}")
        if not self.text_column:
            _fail("data.text_column", "must be a non-empty column name")
        if self.domain_column is not None:
            if not self.domain_column:
                _fail("data.domain_column", "must be a non-empty column name or null")
            if self.mix is not None or self.streaming:
                _fail("data.domain_column", "needs a map-style dataset: not available with "
                      "data.mix or data.streaming (their documents keep only the text)")
        tok = self.tokenizer
        if tok != "default" and not Path(tok).expanduser().exists():
            _fail("data.tokenizer", f"{tok!r} does not exist; use 'default', a tokenizer.json "
                  "file or a local Hugging Face tokenizer folder")


BF16_MOMENT_MAX_BETA = 0.99
"""Largest AdamW beta with bf16 moments: 1 - beta = 0.01 stays above bf16's relative
half-ulp (2^-9 .. 2^-8), so that a decaying moment still moves."""


MUON_ONLY_KEYS = ("muon_momentum", "muon_ns_steps", "muon_ns_dtype", "muon_update_rms",
                  "muon_embedding", "muon_output", "muon_router")
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
    (not applied to norms, 1-D biases and the router's expert bias)."""
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
    is gathered in this dtype."""
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

    def validate(self) -> None:
        _positive("optim", self, "lr", "eps", "grad_clip")
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
        if self.muon_ns_dtype not in ("bf16", "fp32"):
            _fail("optim.muon_ns_dtype", f"expected bf16 or fp32, got {self.muon_ns_dtype!r}")
        _positive("optim", self, "muon_update_rms")


@dataclass
class TrainConfig:
    steps: int = 300
    """Optimizer steps to train for. 0: save the starting model as checkpoint step 0 and stop
    (a model upcycled or initialised from a Hugging Face checkpoint, written directly for
    ``moetrain export-hf`` or ``generate``; a later run with more steps resumes from it)."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one data-parallel rank. Gradient accumulation
    steps = global_batch_size / (micro_batch_size * data-parallel degree)."""
    seed: int = 0
    """Seed of parameter initialisation and of router jitter."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train. auto: CUDA when available, else CPU."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute dtype: bf16 runs every GEMM on bf16 operands, forward and backward (autocast
    around the forward, the routed experts cast at their grouped GEMMs), with fp32 master
    weights, fp32 router gates and embeddings, and one policy under every layout (FSDP2
    mixed precision under ZeRO-2/3: blocks gathered in bf16, fp32 gradient reduction;
    docs/kernels.md), on CUDA or CPU; auto is bf16 on CUDA and fp32 on CPU. Parameters and
    optimizer state stay fp32."""
    output_dir: str = "outputs/run"
    """Run directory: TensorBoard events in <output_dir>/tb, checkpoints in
    <output_dir>/checkpoints."""
    eval_every: int = 50
    """Compute the held-out eval loss every N steps (and at the end). 0: only at the end."""
    eval_batches: int = 8
    """Micro-batches of the eval split per evaluation."""
    checkpoint_every: int = 100
    """Save a checkpoint every N steps (and at the end). 0: only at the end."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a newer one is verified."""
    resume: str = "auto"
    """"auto": resume from the checkpoint ``<output_dir>/checkpoints/latest`` names, or else
    the newest one that verifies; start fresh when there is none; refuse when checkpoints
    exist but none verifies. "never": start fresh; refuse when ``<output_dir>/checkpoints``
    holds any checkpoint. Or the path of a checkpoint (or of a checkpoints directory: its
    latest) to resume from. A resume with nothing to train (the checkpoint is at
    ``steps`` or past it) is refused, and so is one whose config changes a key that changes
    what the model computes (``resume_allow_changes``; docs/checkpoints.md). A refused start
    exits with status 2 and writes nothing."""
    compile: bool = False
    """Compile each transformer block with torch.compile (inductor). Blocks of one shape
    share a compiled graph (one more for evaluation), with no graph break on
    ``torch._grouped_mm``'s path (docs/architecture.md)."""
    nonfinite_policy: Literal["skip", "halt"] = "skip"
    """A step whose loss or gradient norm is not finite: "skip" leaves the parameters and
    optimizer untouched, counts the step (``train/skipped_steps``) and goes on; "halt" stops
    with an error (the last checkpoint holds the last good state)."""
    max_nonfinite_skips: int = 10
    """Halt anyway once more than this many steps have been skipped."""
    collective_timeout_s: int = 600
    """Seconds a collective may wait for a rank before failing the job (dead-rank bound)."""
    routing_replay: str | None = None
    """Routing replay (reinforcement-learning fine-tuning: train the policy that generated the
    rollouts): a directory of per-step files ``step_<8-digit step>.pt`` in the routing-trace
    format (docs/dashboards.md) holding each token's expert ids per MoE layer for the step's
    global batch (and its input_ids, checked against the data). Those ids replace the
    router's top-k in the training forward; combine weights and balancing losses still come
    from the router's scores. null: the router chooses."""
    benchmark: bool = False
    """This run measures speed, not a model: allows options that make the trained model
    useless (``moe.force_load_balancing``), which training refuses otherwise. Marks the run in
    its logs and TensorBoard."""
    memory_check: bool = True
    """Before building anything, compare this rank's planned memory peak
    (``moetrain plan``) with the memory it has (``memory_per_rank_gb``) and refuse to start,
    with both figures and the plan's advice, when it does not fit. false: start anyway."""
    memory_per_rank_gb: float | None = None
    """Memory one rank may use, in GB (10^9 bytes), for ``memory_check``. null: the GPU's
    memory on CUDA; on CPU the machine's available memory (MemAvailable) divided among the
    ranks of this node."""
    record_routing: bool = False
    """Write every training step's routing (the global batch's expert ids per MoE layer) to
    ``<output_dir>/routing/train/step_<8-digit step>.pt``, the format ``routing_replay``
    reads."""
    resume_allow_changes: list[str] = field(default_factory=list)
    """Keys whose value may differ from the resumed checkpoint's although the change alters
    what the model computes or the data stream its position belongs to (``moe.top_k``,
    ``moe.score_func``, ``model.rope_theta``, ``data.dataset``, ...): a resume that changes
    such a key is refused, naming it, unless it is listed here, e.g. ``[moe.top_k]``. Each
    accepted change is logged. Which keys need it: ``RESUME_KEYS`` in moetrain/config.py and
    docs/checkpoints.md. Shape changes (the checkpoint fingerprint) are refused whatever
    this says."""
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    """FP8 GEMMs (docs/fp8.md): the forward and input-gradient GEMMs of the blocks' linear
    layers (attention, dense and shared-expert FFNs) and of the routed experts take FP8
    inputs; the router, the embeddings, the output head, norms and the optimizer stay in
    high precision. "tensorwise": one scale per weight (per expert), e4m3 forward and e5m2
    output gradients; "rowwise": a scale per weight row along the contraction dim,
    power-of-two scales, e4m3 throughout. Activations and output gradients get a scale per
    token in both, so the numbers do not depend on the parallel layout. On top of
    ``train.dtype`` (whose dtype the GEMM outputs keep). Checkpoints are unchanged: a run
    resumes with another value. "none": off."""
    fp8_experts: bool = True
    """With ``train.fp8``: the routed experts' grouped GEMMs in FP8 too. false: only the
    linear layers."""
    fp8_backend: Literal["auto", "emulated", "scaled_mm"] = "auto"
    """How FP8 GEMMs run: "scaled_mm" on FP8 tensor cores (``torch._scaled_mm``,
    ``torch._scaled_grouped_mm`` on CUDA sm90; torch's CPU kernel for linears),
    "emulated" (cast to FP8 and back, then an fp32 GEMM: the same numbers up to the GEMM's
    rounding, on any device), "auto": scaled_mm on CUDA sm89+, emulated elsewhere."""

    def validate(self) -> None:
        _positive("train", self, "global_batch_size", "micro_batch_size", "eval_batches",
                  "keep_last", "collective_timeout_s", "memory_per_rank_gb")
        if self.steps < 0:
            _fail("train.steps", f"must be >= 0, got {self.steps}")
        if self.max_nonfinite_skips < 0:
            _fail("train.max_nonfinite_skips", f"must be >= 0, got {self.max_nonfinite_skips}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                _fail(f"train.{name}", f"must be >= 0, got {getattr(self, name)}")
        if self.routing_replay is not None and not Path(self.routing_replay).expanduser().is_dir():
            _fail("train.routing_replay", f"{self.routing_replay!r} is not a directory of "
                  "per-step routing files (step_00000001.pt, ...)")
        if self.global_batch_size % self.micro_batch_size:
            _fail("train.global_batch_size", f"{self.global_batch_size} is not divisible by "
                  f"train.micro_batch_size={self.micro_batch_size}")


@dataclass
class LogConfig:
    log_every: int = 10
    """Print a log line every N steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to <train.output_dir>/tb."""
    progress_bar: bool = True
    """Show a tqdm progress bar with loss and tokens/s (off when stderr is not a tty)."""
    heatmap_every: int = 50
    """Log the layer x expert token-share heatmap image every N steps. 0: never."""
    histogram_every: int = 50
    """Log router-score histograms every N steps. 0: never."""
    dead_expert_window: int = 20
    """An expert is dead when it received no tokens over the last N steps: the
    ``dead_experts`` scalar counts them, and a warning is logged when one dies."""
    imbalance_warn_threshold: float | None = 3.0
    """Log a warning when a layer's load imbalance (max/mean tokens per expert over a step)
    rises past this value; again only after it has come back under. null: never warn."""

    collapse_fraction: float | None = 0.9
    """Warn of router collapse when the same expert of a layer receives at least this
    fraction of the tokens for ``collapse_steps`` consecutive steps, and of one expert per
    batch when in each of those steps some expert does, not always the same one (the router
    does not tell tokens apart yet). null: never warn."""
    collapse_steps: int = 10
    """Consecutive steps of collapse before the warning."""
    specialization: bool = True
    """At every evaluation, record which experts each eval token is routed to: per MoE layer
    and expert the most frequent tokens and the share of each data domain, expert
    co-activation (TensorBoard text and images), saved to ``<output_dir>/routing/``; at the
    end of training, routing stability (per layer, the fraction of eval tokens whose top-1
    expert at each evaluation equals the final one's)."""
    specialization_top_tokens: int = 8
    """Tokens listed per expert in the specialization view."""

    def validate(self) -> None:
        _positive("log", self, "log_every", "dead_expert_window", "collapse_steps",
                  "specialization_top_tokens")
        if self.collapse_fraction is not None and not 0 < self.collapse_fraction <= 1:
            _fail("log.collapse_fraction", f"must be in (0, 1] or null, got "
                  f"{self.collapse_fraction}")
        for name in ("heatmap_every", "histogram_every"):
            if getattr(self, name) < 0:
                _fail(f"log.{name}", f"must be >= 0, got {getattr(self, name)}")
        t = self.imbalance_warn_threshold
        if t is not None and not (t >= 1 and math.isfinite(t)):
            _fail("log.imbalance_warn_threshold", f"must be a finite number >= 1 (max/mean is "
                  f"never below 1) or null, got {t}")


@dataclass
class ParallelConfig:
    """Parallel layout over the ``torchrun`` world: pp x dp_replicate x dp_shard x cp x tp
    ranks.

    Rank order (``moetrain.parallel.dims``): tp varies fastest, then cp, dp_shard,
    dp_replicate, and pp slowest, so tensor-parallel groups are consecutive ranks (one node)
    and pipeline stages are the farthest apart. The data-parallel degree is what the world
    size leaves (``dp_shard: -1``), as in Fast-LLM. The cross-section checks (heads, layers,
    batch) run before any process group exists, in ``ParallelDims.validate``.
    """

    dp_replicate: int = 1
    """Data-parallel replica groups: gradients are all-reduced across them (HSDP's outer
    dimension when zero_stage >= 1)."""
    dp_shard: int = -1
    """Data-parallel ranks within a replica group, over which ZeRO shards optimizer state,
    gradients and parameters (together with the cp ranks). -1: world size / (pp *
    dp_replicate * cp * tp)."""
    cp: int = 1
    """Context-parallel degree: every sequence is split over cp ranks along the sequence,
    load-balanced for the causal mask (rank c holds chunks c and 2 cp - 1 - c of 2 cp equal
    chunks); attention all-gathers keys and values over the cp ranks, MoE layers gather the
    routing decisions so that capacity and the balancing losses stay those of whole
    sequences. Parameters are replicated over cp and their gradients averaged with dp
    (docs/parallel.md). data.seq_len must divide into 2 cp chunks."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and SwiGLU split column/row-wise, vocabulary-
    parallel embedding and loss. Must divide model.n_heads and the kv heads."""
    sequence_parallel: bool = False
    """Megatron-style sequence parallelism: norms and residuals hold 1/tp of the sequence
    (needs tp > 1 and data.seq_len divisible by tp)."""
    pp: int = 1
    """Pipeline-parallel stages (physical, one per pp rank)."""
    pp_schedule: Literal[
        "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "looped_bfs", "zbv", "dualpipev"
    ] = "interleaved_1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b (Megatron's, the default),
    zero_bubble (interleaved zero-bubble, ZB-H1-style split of the weight gradients),
    looped_bfs (breadth-first: every micro-batch through a rank's first chunk before its
    next), zbv (zero-bubble V: two chunks per rank placed in a V) or dualpipev (DeepSeek's
    DualPipe-V: the same V placement, a forward and a backward overlapped in steady state).
    zbv and dualpipev need pp_virtual_stages = 2."""
    pp_microbatches: int | None = None
    """Pipeline micro-batches per step and data-parallel rank. null: global_batch_size /
    (dp * micro_batch_size); otherwise it sets the micro-batch size to global_batch_size /
    (dp * pp_microbatches). Needs pp > 1."""
    pp_virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedules); the model splits into
    pp * pp_virtual_stages stages, of equal layer counts unless pp_stage_layers says
    otherwise. Looped placement (rank r holds stages r, r + pp, ...) except zbv and
    dualpipev: V placement (rank r holds r and 2 pp - 1 - r)."""
    pp_stage_layers: list[int] | None = None
    """Transformer layers of each pipeline stage, in stage order (stage s on the rank the
    schedule's placement gives it), one count per stage: pp * pp_virtual_stages of them,
    summing to model.n_layers; each stage takes the next layers in order. The first stage
    also holds the embedding and the last the final norm and output head (and the
    multi-token-prediction modules), so published recipes give them fewer layers: DeepSeek-V3
    on PP16 x 2 stages, [1, 2, ..., 2, 0] (Megatron-Core's layout "Et|(tt|)*30mL"). The first
    and the last stage may hold 0 layers (the embedding alone, the head alone); a stage in
    between may not (it would only pass its input on). null: equal stages
    (model.n_layers / stages each, which must divide). Needs pp > 1."""
    breadth_first_micro_batches: int | None = None
    """Micro-batches that one pass holds in flight (Fast-LLM's key of that name): with pp > 1
    the micro-batches of one run of the pipeline schedule, without a pipeline micro-batches
    whose forwards all run before their backwards. null: all of a step's micro-batches with
    pp > 1, 1 without (or the step's micro-batches / depth_first_micro_batches)."""
    depth_first_micro_batches: int | None = None
    """Passes per optimizer step, one after the other, gradients accumulated between them
    (Fast-LLM's key of that name): breadth_first_micro_batches * depth_first_micro_batches
    = the step's micro-batches per data-parallel rank. null: whatever breadth-first leaves."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """0: replicas with gradient all-reduce; 1: optimizer state sharded over dp_shard;
    2: gradients too (FSDP2, reshard_after_forward=False); 3: parameters too (FSDP2)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (the attention of every block), or
    full (every block)."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts are split over ep data-parallel ranks
    (ep innermost among them), tokens travel to their experts and back. Must divide
    moe.num_experts and dp_replicate * dp_shard (docs/expert_parallel.md)."""
    ep_dispatcher: Literal["all_to_all", "all_gather"] = "all_to_all"
    """How tokens reach their experts under ep > 1: all_to_all (sends only the rows routed to
    another rank; one host sync per layer for the split sizes unless moe.pad_to_capacity) or
    all_gather (every rank gathers the EP group's tokens, static shapes, no host sync; ep x
    the MoE input memory: for ep = 2 or tiny batches)."""
    expert_tp: bool = True
    """With tp > 1 (any ep): split every expert's FFN width, routed and shared, over the
    tensor-parallel ranks (expert tensor parallelism, Megatron-Core's default), so that each
    expert row is computed once per tp group; the partial outputs are summed once per layer.
    false: every tp rank holds whole experts and computes all of them on all of its tokens
    (tp x the expert FLOPs, no expert communication). No effect with tp = 1.
    moe.expert_ffn_dim (and the shared experts' width) must divide by tp."""
    overlap_shared_experts: bool = False
    """Compute the shared experts while the expert-parallel all-to-all carries the routed
    tokens (an asynchronous all_to_all_single, waited for after the shared experts), instead
    of after the combine. The same numbers in another order; needs ep > 1, the all_to_all
    dispatcher and moe.num_shared_experts > 0."""

    def validate(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "pp_virtual_stages", "ep", "pp_microbatches",
                     "cp", "breadth_first_micro_batches", "depth_first_micro_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                _fail(f"parallel.{name}", f"must be >= 1, got {value}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            _fail("parallel.dp_shard", f"must be >= 1 or -1 (derived), got {self.dp_shard}")
        if self.sequence_parallel and self.tp == 1:
            _fail("parallel.sequence_parallel", "needs parallel.tp > 1, got parallel.tp=1")
        if self.pp_microbatches is not None and self.pp == 1:
            _fail("parallel.pp_microbatches", f"{self.pp_microbatches} set but parallel.pp=1; "
                  "without a pipeline use train.micro_batch_size")
        if self.ep_dispatcher not in ("all_to_all", "all_gather"):
            _fail("parallel.ep_dispatcher", "expected all_to_all or all_gather, got "
                  f"{self.ep_dispatcher!r}")
        if self.pp_virtual_stages > 1 and self.pp_schedule in ("gpipe", "1f1b"):
            _fail("parallel.pp_virtual_stages", f"{self.pp_virtual_stages} needs an interleaved "
                  f"schedule; parallel.pp_schedule={self.pp_schedule!r} runs one stage per rank")
        if self.pp > 1 and self.pp_schedule in V_SCHEDULES and self.pp_virtual_stages != 2:
            _fail("parallel.pp_virtual_stages", f"{self.pp_virtual_stages}, but parallel."
                  f"pp_schedule={self.pp_schedule!r} places exactly 2 stages on each rank in a V "
                  "(rank r holds stages r and 2 pp - 1 - r): set parallel.pp_virtual_stages=2")
        if self.pp_stage_layers is not None:
            self._validate_stage_layers(self.pp_stage_layers)
        if self.overlap_shared_experts and (self.ep == 1 or self.ep_dispatcher != "all_to_all"):
            _fail("parallel.overlap_shared_experts", "overlaps the shared experts with the "
                  "expert-parallel all-to-all: needs parallel.ep > 1 and parallel.ep_dispatcher="
                  f"all_to_all, got parallel.ep={self.ep}, parallel.ep_dispatcher="
                  f"{self.ep_dispatcher}")


    def _validate_stage_layers(self, counts: list[int]) -> None:
        """``pp_stage_layers`` on its own: one count per stage, none negative, 0 only at
        either end (the layers' total is checked against model.n_layers in
        ``ParallelDims.validate``)."""
        key = "parallel.pp_stage_layers"
        if self.pp == 1:
            _fail(key, f"{counts} set but parallel.pp=1: without a pipeline every rank holds "
                  "every layer; set parallel.pp_stage_layers=null")
        stages = self.pp * self.pp_virtual_stages
        if len(counts) != stages:
            _fail(key, f"{len(counts)} counts {counts}, but parallel.pp * parallel."
                  f"pp_virtual_stages = {self.pp} * {self.pp_virtual_stages} = {stages} "
                  "stages: give one layer count per stage")
        if any(c < 0 for c in counts):
            _fail(key, f"layer counts must be >= 0, got {counts}")
        empty = [s for s, c in enumerate(counts) if c == 0 and 0 < s < stages - 1]
        if empty:
            _fail(key, f"stages {empty} of {counts} hold no layer: only the first stage (the "
                  "embedding) and the last (the output head) may be empty; a stage in between "
                  "would only pass its input on")


V_SCHEDULES = ("zbv", "dualpipev")
"""Pipeline schedules with the V-shaped stage placement (two stages per rank)."""


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
        if self.model.upcycle_from is not None and moe.num_experts == 0:
            _fail("model.upcycle_from", "needs MoE layers: set moe.num_experts > 0")
        if moe.token_group_seqs is not None and moe.num_experts:
            if self.train.micro_batch_size % moe.token_group_seqs:
                _fail("moe.token_group_seqs", f"{moe.token_group_seqs} does not divide "
                      f"train.micro_batch_size={self.train.micro_batch_size}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- resuming

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


def flat_keys(cfg: JobConfig) -> dict[str, Any]:
    """Every key of ``cfg`` as ``section.key`` -> value."""
    return {f"{section}.{k}": v for section, values in cfg.to_dict().items()
            for k, v in values.items()}  # fmt: skip


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


# ----------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                continue
    elif origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept what float() accepts.
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, list):
            return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    else:  # pragma: no cover - only the types above are used in this file
        raise TypeError(f"unsupported config type {tp}")
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A section's resolved field types (``get_type_hints`` evaluates every annotation string
    again on each call: most of a config load's time without the cache)."""
    return typing.get_type_hints(cls)


def _build_section(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown key; {prefix.rstrip('.') or 'top level'} "
                              f"has {', '.join(names)}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{key}: expected a mapping of keys, got {value!r}")
            kwargs[key] = _build_section(hints[key], value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(f"{prefix}{key}", value, hints[key])
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: where the YAML broke and why (PyYAML's own message spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{where}: {problem}"


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["moe.top_k=2", "train.output_dir=x"]`` into a nested dict (YAML-typed values)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item!r}: an override is written section.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: cannot parse value {raw!r}{_yaml_problem(exc)}") from None
        _set_dotted(tree, key.lstrip("-"), value)
    return tree


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML file (safe loader), apply dotted overrides, type-check and validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: no such file {str(path)!r}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config: {path} is not valid YAML{_yaml_problem(exc)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config: {path} must hold a mapping of sections")
        tree = loaded
    tree = _merge(tree, parse_overrides(overrides or []))
    return _build_section(JobConfig, tree, "").validate()


def config_to_yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
