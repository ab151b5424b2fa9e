"""The adapter base class: config.json <-> moetrain sections, state-dict names <-> tensors.

Every adapter fills *all* architecture keys (``ARCH_MODEL_KEYS``, ``ARCH_MOE_KEYS``): what a
family does not have takes moetrain's default, so no stale YAML value survives an import.
The llama-style names (``self_attn.q_proj``, ``mlp.gate_proj``, per-expert
``mlp.experts.{e}.gate_proj``) are the default; families override what differs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.sources import Rows, Source, Stacked
from moetrain.model.transformer import is_moe_layer

ARCH_MODEL_KEYS = (
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
    "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings", "rope_style", "rope_scaling",
    "rope_scaling_factor", "rope_original_max_seq_len", "rope_yarn_beta_fast",
    "rope_yarn_beta_slow", "rope_yarn_mscale", "rope_yarn_mscale_all_dim",
    "rope_llama3_low_freq_factor", "rope_llama3_high_freq_factor", "qk_norm", "qkv_bias",
    "out_bias", "clip_qkv", "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "partial_rotary_factor", "mtp_depth",
    "rope_yarn_truncate", "attention_sinks", "sliding_window", "sliding_window_layers",
)  # fmt: skip
"""Keys of the model section an HF config decides (the rest are training choices)."""

ARCH_MOE_KEYS = (
    "num_experts", "top_k", "every_n_layers", "dense_layers", "expert_ffn_dim",
    "num_shared_experts", "shared_expert_ffn_dim", "shared_expert_gate", "score_func",
    "renormalize", "route_with_bias", "n_groups", "topk_groups", "routed_scaling_factor",
    "group_score", "router_bias", "expert_ffn_bias", "expert_activation", "swiglu_alpha",
    "swiglu_limit",
)  # fmt: skip
"""Keys of the moe section an HF config decides. Capacity, dropping, balancing losses,
jitter, token groups and kernels stay the YAML's."""


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def need(hf: dict, key: str, family: str) -> Any:
    if hf.get(key) is None:
        raise HFCheckpointError(f"config.json: {family} needs {key!r}")
    return hf[key]


# ---------------------------------------------------------------------------- RoPE


def rope_from_hf(hf: dict, family: str) -> dict[str, Any]:
    """RoPE keys from a config.json in either format: transformers 5's ``rope_parameters``
    or the older ``rope_theta`` + ``rope_scaling``."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    out: dict[str, Any] = {"rope_theta": float(theta), "partial_rotary_factor": float(partial)}
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_scaling_factor": float(params["factor"])}
    original = params.get("original_max_position_embeddings")
    if kind == "llama3":
        return {
            **out,
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(params["factor"]),
            "rope_original_max_seq_len": int(original),
            "rope_llama3_low_freq_factor": float(params.get("low_freq_factor", 1.0)),
            "rope_llama3_high_freq_factor": float(params.get("high_freq_factor", 4.0)),
        }
    if kind == "yarn":
        if params.get("attention_factor") is not None:
            raise HFCheckpointError(
                f"config.json: {family}: yarn attention_factor is not "
                "supported (it is derived from factor and mscale)"
            )
        original = original or hf.get("max_position_embeddings")
        factor = params.get("factor") or hf["max_position_embeddings"] / original
        return {
            **out,
            "rope_scaling": "yarn",
            "rope_scaling_factor": float(factor),
            "rope_original_max_seq_len": int(original),
            "rope_yarn_beta_fast": float(params.get("beta_fast") or 32),
            "rope_yarn_beta_slow": float(params.get("beta_slow") or 1),
            "rope_yarn_mscale": float(params.get("mscale") or 0.0),
            "rope_yarn_mscale_all_dim": float(params.get("mscale_all_dim") or 0.0),
            "rope_yarn_truncate": bool(params.get("truncate", True)),
        }
    raise HFCheckpointError(
        f"config.json: {family}: RoPE type {kind!r} is not supported (default, linear, yarn "
        "and llama3 are)"
    )


def rope_to_hf(m: ModelConfig) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` in the format every transformers version reads."""
    scaling: dict[str, Any] | None = None
    if m.rope_scaling == "linear":
        scaling = {"rope_type": "linear", "factor": m.rope_scaling_factor}
    elif m.rope_scaling == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": m.rope_scaling_factor,
            "original_max_position_embeddings": m.rope_original_max_seq_len,
            "low_freq_factor": m.rope_llama3_low_freq_factor,
            "high_freq_factor": m.rope_llama3_high_freq_factor,
        }
    elif m.rope_scaling == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": m.rope_scaling_factor,
            "original_max_position_embeddings": m.rope_original_max_seq_len,
            "beta_fast": m.rope_yarn_beta_fast,
            "beta_slow": m.rope_yarn_beta_slow,
        }
        if m.rope_yarn_mscale:
            scaling["mscale"] = m.rope_yarn_mscale
        if m.rope_yarn_mscale_all_dim:
            scaling["mscale_all_dim"] = m.rope_yarn_mscale_all_dim
        if not m.rope_yarn_truncate:
            scaling["truncate"] = False
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling}


# ---------------------------------------------------------------------------- families


class Family:
    """Config and tensor-name mapping of one transformers model family."""

    model_type = ""
    architecture = ""
    moe = True
    prefix = "model.layers"
    moe_block = "mlp"  # Mixtral: block_sparse_moe
    expert_names = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    mtp = False
    """Whether the family's checkpoints carry multi-token-prediction layers (read and
    written by moetrain; transformers drops them)."""
    partial_rotary = False
    """Whether transformers' modeling of the family rotates part of each head only."""
    keeps_rope_style = False
    """False: transformers' rotate-half pairing (export permutes interleaved q/k rows)."""
    remote_files: tuple[str, ...] = ()
    """Modeling files written beside the weights (loaded with trust_remote_code=True)."""
    ignored: tuple[tuple[str, str], ...] = (
        (r"(^|\.)rotary_emb\.inv_freq$", "RoPE's inverse frequencies, computed from config.json"),
        (r"(^|\.)rotary_emb\.(cos|sin)_cached$", "a RoPE cache, computed from config.json"),
    )
    """Checkpoint tensors that hold no weight of the model, as (regular expression, why):
    an import lists them as ignored instead of refusing them as unused
    (``moetrain.interop.accounting``). Older transformers versions saved the RoPE buffers;
    a family adds the leftovers its published checkpoints are known to carry."""

    # -- config -------------------------------------------------------------------------

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model keys, moe keys): every architecture key of both sections."""
        self.check_hf(hf)
        model = {k: _defaults(ModelConfig)[k] for k in ARCH_MODEL_KEYS}
        moe = {k: _defaults(MoEConfig)[k] for k in ARCH_MOE_KEYS}
        heads = need(hf, "num_attention_heads", self.model_type)
        dim = need(hf, "hidden_size", self.model_type)
        head_dim = hf.get("head_dim")
        model.update(
            vocab_size=need(hf, "vocab_size", self.model_type),
            dim=dim,
            n_layers=need(hf, "num_hidden_layers", self.model_type),
            n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim if head_dim and head_dim * heads != dim else None,
            ffn_dim=need(hf, "intermediate_size", self.model_type),
            max_seq_len=need(hf, "max_position_embeddings", self.model_type),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_style="half",
            **rope_from_hf(hf, self.model_type),
        )
        if model["n_kv_heads"] == heads:
            model["n_kv_heads"] = None
        if model["partial_rotary_factor"] != 1.0 and not self.partial_rotary:
            raise HFCheckpointError(f"config.json: {self.model_type}: partial_rotary_factor is "
                                    "not supported")  # fmt: skip
        window = self.sliding_window(hf)
        if window is not None and window < model["max_seq_len"]:
            # Sliding-window attention equals full causal attention on sequences no longer
            # than the window: moetrain keeps to those.
            model["max_seq_len"] = window
        if not self.moe:
            moe["num_experts"] = 0
        return model, moe

    def check_hf(self, hf: dict) -> None:
        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        if act != "silu":
            raise HFCheckpointError(
                f"config.json: hidden_act {act!r} is not supported (moetrain's FFNs are SwiGLU)"
            )

    def sliding_window(self, hf: dict) -> int | None:
        return hf.get("sliding_window") if hf.get("use_sliding_window", True) else None

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        """config.json for moetrain sections this family can express (see ``problems``)."""
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": m.vocab_size,
            "hidden_size": m.dim,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.kv_heads,
            "head_dim": m.attn_head_dim,
            "intermediate_size": m.ffn_dim,
            "max_position_embeddings": m.max_seq_len,
            "rms_norm_eps": m.norm_eps,
            "tie_word_embeddings": m.tie_embeddings,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": m.init_std,
            "use_cache": True,
            **rope_to_hf(m),
        }

    def cannot_express(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        """Why this family cannot express the architecture (empty: it can): its own
        ``problems`` and the options only some families have (``option_problems``)."""
        return self.problems(m, e) + self.option_problems(m, e)

    gpt_oss_options = False
    """Whether the family expresses gpt-oss's options: attention sinks, sliding-window
    layers, router and expert biases, the clamped SwiGLU."""

    def option_problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        """The options no family but gpt-oss (and moetrain's own) writes."""
        if self.gpt_oss_options:
            return []
        out = []
        if m.attention_sinks:
            out.append("attention sinks")
        if m.sliding_window is not None:
            out.append("sliding-window attention")
        if e.num_experts and e.router_bias:
            out.append("a router bias")
        if e.num_experts and e.expert_ffn_bias:
            out.append("expert biases")
        if e.num_experts and e.expert_activation != "swiglu":
            out.append(f"the {e.expert_activation} expert activation")
        return out

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        """Why this family cannot express the architecture's main options (empty: it can).
        The rope pairing is not a problem: the exporter converts interleaved q/k rows."""
        out = []
        if m.attention != "gqa":
            out.append("multi-head latent attention")
        if m.partial_rotary_factor != 1.0 and not self.partial_rotary:
            out.append("partial rotary")
        if m.mtp_depth and not self.mtp:
            out.append("multi-token prediction")
        if (e.num_experts > 0) != self.moe:
            out.append("MoE layers" if e.num_experts else "no MoE layers")
        if e.num_experts:
            if e.n_groups > 1:
                out.append("group-limited routing")
            elif e.group_score != "top2":
                out.append(f"group_score={e.group_score}")
            if e.routed_scaling_factor != 1.0:
                out.append("routed_scaling_factor")
            if e.selects_with_bias:
                out.append("an expert selection bias")
            if e.score_func != "softmax":
                out.append(f"{e.score_func} router scores")
        return out

    # -- tensors --------------------------------------------------------------------------

    def ignored_reason(self, name: str) -> str | None:
        """Why checkpoint tensor ``name`` holds no weight of the model (None: it may)."""
        for pattern, why in self.ignored:
            if re.search(pattern, name):
                return why
        return None

    def attention_sources(self, i: int, m: ModelConfig) -> dict[str, Source]:
        p, q = f"{self.prefix}.{i}.self_attn", f"layers.{i}.attention"
        hd = m.attn_head_dim
        qo, kvo = m.n_heads * hd, m.kv_heads * hd
        out: dict[str, Source] = {
            f"{q}.wq.weight": Rows(f"{p}.q_proj.weight", (qo, m.dim)),
            f"{q}.wk.weight": Rows(f"{p}.k_proj.weight", (kvo, m.dim)),
            f"{q}.wv.weight": Rows(f"{p}.v_proj.weight", (kvo, m.dim)),
            f"{q}.wo.weight": Rows(f"{p}.o_proj.weight", (m.dim, qo)),
        }
        if m.qkv_bias:
            out[f"{q}.wq.bias"] = Rows(f"{p}.q_proj.bias", (qo,))
            out[f"{q}.wk.bias"] = Rows(f"{p}.k_proj.bias", (kvo,))
            out[f"{q}.wv.bias"] = Rows(f"{p}.v_proj.bias", (kvo,))
        if m.out_bias:
            out[f"{q}.wo.bias"] = Rows(f"{p}.o_proj.bias", (m.dim,))
        if m.qk_norm != "none":
            per_head = m.qk_norm == "head"
            out[f"{q}.q_norm.weight"] = Rows(f"{p}.q_norm.weight", (hd if per_head else qo,))
            out[f"{q}.k_norm.weight"] = Rows(f"{p}.k_norm.weight", (hd if per_head else kvo,))
        return out

    def dense_ffn_sources(self, i: int, m: ModelConfig) -> dict[str, Source]:
        p, q = f"{self.prefix}.{i}.mlp", f"layers.{i}.ffn"
        return {
            f"{q}.w1.weight": Rows(f"{p}.gate_proj.weight", (m.ffn_dim, m.dim)),
            f"{q}.w3.weight": Rows(f"{p}.up_proj.weight", (m.ffn_dim, m.dim)),
            f"{q}.w2.weight": Rows(f"{p}.down_proj.weight", (m.dim, m.ffn_dim)),
        }

    def moe_sources(self, i: int, m: ModelConfig, e: MoEConfig) -> dict[str, Source]:
        p, q = f"{self.prefix}.{i}.{self.moe_block}", f"layers.{i}.ffn"
        E, D, F = e.num_experts, m.dim, e.expert_ffn_dim
        gate, up, down = self.expert_names

        def keys(name: str) -> tuple[str, ...]:
            return tuple(f"{p}.experts.{x}.{name}.weight" for x in range(E))

        out: dict[str, Source] = {
            f"{q}.router.gate.weight": Rows(f"{p}.gate.weight", (E, D)),
            f"{q}.experts.w1": Stacked(keys(gate), (E, D, F)),
            f"{q}.experts.w3": Stacked(keys(up), (E, D, F)),
            f"{q}.experts.w2": Stacked(keys(down), (E, F, D)),
        }
        out.update(self.shared_sources(i, m, e))
        return out

    def shared_sources(self, i: int, m: ModelConfig, e: MoEConfig) -> dict[str, Source]:
        return {}

    def sources(self, m: ModelConfig, e: MoEConfig) -> dict[str, Source]:
        """moetrain state-dict name -> source, for every parameter and persistent buffer
        this family's checkpoint provides."""
        V, D = m.vocab_size, m.dim
        assert V is not None
        out: dict[str, Source] = {
            "tok_embeddings.weight": Rows("model.embed_tokens.weight", (V, D)),
            "norm.weight": Rows("model.norm.weight", (D,)),
            "output.weight": Rows(
                "model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight", (V, D)
            ),
        }
        mtp = range(m.n_layers, m.n_layers + m.mtp_depth)
        for i in [*range(m.n_layers), *mtp]:
            p = f"{self.prefix}.{i}"
            out[f"layers.{i}.attention_norm.weight"] = Rows(f"{p}.input_layernorm.weight", (D,))
            out[f"layers.{i}.ffn_norm.weight"] = Rows(f"{p}.post_attention_layernorm.weight", (D,))
            out.update(self.attention_sources(i, m))
            if is_moe_layer(i, e):
                out.update(self.moe_sources(i, m, e))
            else:
                out.update(self.dense_ffn_sources(i, m))
        if m.mtp_depth:
            out.update(self.mtp_sources(m, out))
        return out

    def read_sources(self, m: ModelConfig, e: MoEConfig, tensors: set[str]) -> dict[str, Source]:
        """The sources to read a directory holding ``tensors`` with: ``sources``, unless the
        family stores some tensors otherwise in some checkpoints (gpt-oss's MXFP4 experts)."""
        return self.sources(m, e)

    def mtp_sources(self, m: ModelConfig, out: dict[str, Source]) -> dict[str, Source]:
        """The multi-token-prediction modules' own tensors (DeepSeek-V3's names: the extra
        layers n_layers.. after the main ones, each with ``enorm``, ``hnorm``, ``eh_proj``,
        ``shared_head.norm`` and copies of the embedding and the head, which moetrain
        shares with the main model: read from the main ones, written to both)."""
        D, V = m.dim, m.vocab_size
        assert V is not None
        mine: dict[str, Source] = {}
        layers = [f"{self.prefix}.{i}" for i in range(m.n_layers, m.n_layers + m.mtp_depth)]
        for i, p in zip(range(m.n_layers, m.n_layers + m.mtp_depth), layers, strict=True):
            q = f"layers.{i}"
            mine[f"{q}.enorm.weight"] = Rows(f"{p}.enorm.weight", (D,))
            mine[f"{q}.hnorm.weight"] = Rows(f"{p}.hnorm.weight", (D,))
            mine[f"{q}.eh_proj.weight"] = Rows(f"{p}.eh_proj.weight", (D, 2 * D))
            mine[f"{q}.head_norm.weight"] = Rows(f"{p}.shared_head.norm.weight", (D,))
        emb, head = out["tok_embeddings.weight"], out["output.weight"]
        assert isinstance(emb, Rows) and isinstance(head, Rows)
        mine["tok_embeddings.weight"] = Rows(
            emb.key, (V, D), copies=tuple(f"{p}.embed_tokens.weight" for p in layers)
        )
        mine["output.weight"] = Rows(
            head.key, (V, D), copies=tuple(f"{p}.shared_head.head.weight" for p in layers)
        )
        return mine

    def hf_mtp_depth(self, hf: dict, tensors: set[str]) -> int:
        """Multi-token-prediction layers config.json declares and the shards hold (transformers'
        own save_pretrained writes the count but not the layers)."""
        declared = int(hf.get("num_nextn_predict_layers") or 0) if self.mtp else 0
        n = int(hf.get("num_hidden_layers") or 0)
        held = 0
        while held < declared and f"{self.prefix}.{n + held}.eh_proj.weight" in tensors:
            held += 1
        return held
