"""The ``model`` section: the transformer's shape, attention and positions (RoPE and its
scalings), multi-token prediction, document masking and sliding windows, and where a run's
first weights come from (``init_from``, ``upcycle_from``).

The RoPE keys stay flat (``rope_theta``, ``rope_scaling``, ``rope_yarn_*``, ...,
``partial_rotary_factor``), not a nested ``model.rope`` section: ``rope_theta`` and
``partial_rotary_factor`` are transformers' config.json names; every checkpoint's saved
config and every run directory's config.yaml hold the flat keys (a nested section would
translate them forever); and the equivalence matrix, its references and the golden runs
name options as two-level ``section.key`` overrides."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moetrain.config.errors import _fail, _positive


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
