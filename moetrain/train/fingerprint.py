"""What a checkpoint must agree on to load into a run's model: the shapes and the options that
change what the weights mean (``model_fingerprint``, saved in every checkpoint and compared
on resume, import and export)."""

from __future__ import annotations

from typing import Any

from moetrain.config import JobConfig


def model_fingerprint(cfg: JobConfig, vocab_size: int) -> dict[str, Any]:
    """What a checkpoint must agree on to be loadable into this run's model."""
    m, e = cfg.model, cfg.moe
    return {
        "vocab_size": vocab_size,
        "dim": m.dim,
        "n_layers": m.n_layers,
        "n_heads": m.n_heads,
        "n_kv_heads": m.kv_heads,
        "ffn_dim": m.ffn_dim,
        "tie_embeddings": m.tie_embeddings,
        "num_experts": e.num_experts,
        "expert_ffn_dim": e.expert_ffn_dim,
        "every_n_layers": e.every_n_layers,
        "num_shared_experts": e.num_shared_experts,
        "shared_expert_ffn_dim": e.shared_expert_ffn_dim,
        # Options of the HF families that change the weights' shapes or meaning; recorded
        # only when set, so that checkpoints saved before they existed stay loadable.
        **{k: v for k, v in _family_options(cfg).items() if v not in (None, False, [], "none")},
    }


def _family_options(cfg: JobConfig) -> dict[str, Any]:
    m, e = cfg.model, cfg.moe
    return {
        "head_dim": m.head_dim,
        "rope_style": m.rope_style if m.rope_style != "interleaved" else None,
        "qk_norm": m.qk_norm,
        "qkv_bias": m.qkv_bias,
        "out_bias": m.out_bias,
        "attention": m.attention if m.attention != "gqa" else None,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "dense_layers": list(e.dense_layers),
        "shared_expert_gate": e.shared_expert_gate,
        "sliding_window": m.sliding_window,
        "sliding_window_layers": m.sliding_window_layers,
    }
