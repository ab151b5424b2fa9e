"""Attention: grouped-query attention with the options of the Hugging Face MoE families, and
DeepSeek's multi-head latent attention. Both keep an optional KV cache for generation.

Grouped-query attention (``model.attention: gqa``): q/k/v projections (optional biases,
Qwen2), per-head or whole-projection q/k RMSNorm (Qwen3, OLMoE), q/k/v clamping (OLMoE),
RoPE in either pairing, SDPA. Under tensor parallelism each rank holds whole heads; every
reshape is ``view(B, S, -1, Dh)`` so that a rank sees only its local heads.

Multi-head latent attention (``model.attention: mla``): queries through an optional low-rank
bottleneck ``wq_a -> q_norm -> wq_b``; keys and values from one latent ``wkv_a -> kv_norm ->
wkv_b``; a RoPE part of the key, ``wk_rope``, shared by every head (transformers' fused
``kv_a_proj_with_mqa`` is ``wkv_a`` and ``wk_rope`` stacked). Names follow DeepSeek's
reference code.

The attention core is the module's ``attend`` attribute, ``moetrain.model.masks.attend`` by
default: it takes the ``AttentionMask`` that ``Transformer.forward`` built for the layer
(causal, block-causal per document, sliding window: ``moetrain.model.masks``) and never
builds one itself. It is the seam where context parallelism plugs in
(``moetrain.parallel.context_parallel`` installs a function that gathers the keys and
values of the whole sequence over the ranks holding parts of it, then calls the same core
with the same mask), as the dispatcher is the MoE layer's seam for expert parallelism. Keys
and values reach it with their own (kv) head count: a function that exchanges them sends the
un-repeated heads.

QK-clip (``optim.qk_clip``): both keep their heads' largest logits of a step's training
forwards (``MaxLogits``) and say which rows of their query and key projections its rescale
multiplies by what (``qk_clip_scales``); ``moetrain.train.qk_clip`` does the rest.

RoPE: ``cos`` / ``sin`` are the rows of this call's tokens, (S, R/2), or (B, S, R/2) when
positions restart at every document (``model.document_positions``).

Shape legend: B batch, S new positions, L cached + new positions, D model dim, H heads,
Hkv kv heads, Dh head dim, R rotated width, C latent width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moetrain.config import ModelConfig
from moetrain.model.experts import local_part
from moetrain.model.masks import AttentionMask, attend
from moetrain.model.norm import RMSNorm
from moetrain.model.rope import apply_rope, rope_rows, softmax_scale_factor
from moetrain.model.step_context import StepContext

MLA_LATENT_NORM_EPS = 1e-6
"""Epsilon of MLA's latent norms: fixed in DeepSeek's reference code and in transformers,
whatever ``rms_norm_eps`` says."""


class KVCache:
    """Keys and values of every position seen so far, per layer (for generation). ``length``
    is the number of positions cached; ``Transformer.forward`` advances it."""

    def __init__(self) -> None:
        self.length = 0
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(
        self, layer_id: int, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values of ``layer_id``; return all of them (B, L, H, Dh)."""
        if layer_id in self.layers:
            k_old, v_old = self.layers[layer_id]
            k_BSHD, v_BSHD = torch.cat((k_old, k_BSHD), 1), torch.cat((v_old, v_BSHD), 1)
        self.layers[layer_id] = (k_BSHD, v_BSHD)
        return k_BSHD, v_BSHD


Attend = Callable[..., Any]
"""``attend(q_BSHD, k_BLHD, v_BLHD, scale, mask, sinks_H=None, max_logits=False) ->
(B, S, H*Dv)``, or with ``max_logits`` ``(out, max_H)``: the attention core
(``moetrain.model.masks.attend``)."""


class MaxLogits:
    """What QK-clip (``optim.qk_clip``) reads of an attention module: the largest pre-softmax
    logit of each of its (local) query heads over a step's training forwards.

    The module records while its step context says so (``StepContext.max_logits``) in
    training forwards without a KV cache, except the pipeline's shape-inference forwards
    (``zero_stage_input``); a recomputed forward (activation checkpointing) or a counting
    pass sees the same logits again, which the maximum ignores. ``pop_max_logits`` hands
    the step's maxima over (None: nothing recorded) and starts the next step's."""

    step_context: StepContext | None
    max_logit_H: torch.Tensor | None
    attend: Attend

    def _recording(self, cache: KVCache | None) -> bool:
        ctx = self.step_context
        return (ctx is not None and ctx.max_logits and cache is None
                and self.training and not ctx.zero_stage_input)  # fmt: skip

    def _attend(self, record: bool, *args: Any) -> torch.Tensor:
        """``self.attend(*args)``, keeping the heads' maxima when ``record``."""
        if not record:
            return self.attend(*args)
        out, max_H = self.attend(*args, max_logits=True)
        seen = self.max_logit_H
        self.max_logit_H = max_H if seen is None else torch.maximum(seen, max_H)
        return out

    def pop_max_logits(self) -> torch.Tensor | None:
        max_H, self.max_logit_H = self.max_logit_H, None
        return max_H


class Attention(MaxLogits, nn.Module):
    """Grouped-query attention. ``context``: the step context it reads (None: it never records
    its logits' maxima)."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0, context: StepContext | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.step_context = context
        self.max_logit_H = None
        self.n_heads, self.kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.attn_head_dim
        self.rope_dim = cfg.rope_dim  # partial rotary: the first rope_dim dims of each head
        self.rope_style = cfg.rope_style
        self.clip = cfg.clip_qkv
        q_out, kv_out = cfg.n_heads * self.head_dim, cfg.kv_heads * self.head_dim
        self.wq = nn.Linear(cfg.dim, q_out, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, kv_out, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, kv_out, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_out, cfg.dim, bias=cfg.out_bias)
        self.attend: Attend = attend
        # gpt-oss: a logit per head in the softmax's denominator (split with the heads under
        # tensor parallelism: a DTensor sharded over them).
        self.sinks: nn.Parameter | None = (
            nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention_sinks else None
        )
        self.qk_norm = cfg.qk_norm
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else q_out, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim if per_head else kv_out, cfg.norm_eps)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q, k, v = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        if self.qk_norm == "full":  # OLMoE: over the whole projection, before the head split
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        # view(B, S, -1, Dh): under tensor parallelism each rank holds only its own heads.
        q = q.view(B, S, -1, self.head_dim)
        k = k.view(B, S, -1, self.head_dim)
        v = v.view(B, S, -1, self.head_dim)
        if self.qk_norm == "head":  # Qwen3: each head's Dh values, one shared weight
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_rows(cos, sin, S)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if cache is not None:
            k, v = cache.extend(self.layer_id, k, v)
        if mask is None:  # causal attention of the new positions over all of them
            mask = AttentionMask.causal(S, x_BSD.device, start=k.shape[1] - S)
        sinks = None if self.sinks is None else local_part(self.sinks)
        return self.wo(self._attend(self._recording(cache), q, k, v, None, mask, sinks))

    def qk_clip_scales(self, gamma_H: torch.Tensor) -> dict[str, torch.Tensor]:
        """QK-clip's rescale of the whole (unsharded) projections, given each query head's
        factor ``gamma_H`` (1: the head is left alone): per parameter name, the factor of
        each of its rows. Every logit of head h is scaled by exactly gamma_h. A key head
        that serves one query head shares the factor with it, sqrt(gamma) each (Kimi K2's
        q_C / k_C); one that serves several is left alone and each query head takes its
        whole gamma, as K2 treats MLA's rotary key shared by every head."""
        per_q_head = gamma_H if self.n_heads > self.kv_heads else gamma_H.sqrt()
        q_rows = per_q_head.repeat_interleave(self.head_dim)
        rows = {"wq.weight": q_rows}
        if self.n_heads == self.kv_heads:
            rows["wk.weight"] = q_rows
        if self.wq.bias is not None:
            rows.update({name.replace("weight", "bias"): r for name, r in rows.items()})
        return rows

    def _rope(self, x_BSHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on each head's first ``rope_dim`` dims (all of them unless partial)."""
        if self.rope_dim == self.head_dim:
            return apply_rope(x_BSHD, cos, sin, self.rope_style)
        rot, rest = x_BSHD.split((self.rope_dim, self.head_dim - self.rope_dim), dim=-1)
        return torch.cat((apply_rope(rot, cos, sin, self.rope_style), rest), dim=-1)


class LatentAttention(MaxLogits, nn.Module):
    """DeepSeek's multi-head latent attention (MLA). ``context``: as ``Attention``'s."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0, context: StepContext | None = None):
        super().__init__()
        assert cfg.kv_lora_rank and cfg.qk_nope_head_dim and cfg.qk_rope_head_dim
        assert cfg.v_head_dim
        self.layer_id = layer_id
        self.step_context = context
        self.max_logit_H = None
        self.rope_style = cfg.rope_style
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        self.scale = qk_dim**-0.5 * softmax_scale_factor(cfg)
        H, D, C = cfg.n_heads, cfg.dim, cfg.kv_lora_rank
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(D, H * qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, MLA_LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * qk_dim, bias=False)
        self.wkv_a = nn.Linear(D, C, bias=False)
        self.kv_norm = RMSNorm(C, MLA_LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(C, H * (self.nope_dim + self.v_dim), bias=False)
        self.wk_rope = nn.Linear(D, self.rope_dim, bias=False)
        self.wo = nn.Linear(H * self.v_dim, D, bias=False)
        self.attend: Attend = attend

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        if self.wq is not None:
            q = self.wq(x_BSD)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        # Local heads only under tensor parallelism (wq / wq_b and wkv_b are split by head).
        q_BSHQ = q.view(B, S, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q_BSHQ.split((self.nope_dim, self.rope_dim), dim=-1)
        kv_BSHE = self.wkv_b(self.kv_norm(self.wkv_a(x_BSD))).view(
            B, S, -1, self.nope_dim + self.v_dim
        )
        k_nope, v = kv_BSHE.split((self.nope_dim, self.v_dim), dim=-1)
        k_rope_BS1R = self.wk_rope(x_BSD).view(B, S, 1, self.rope_dim)
        cos, sin = rope_rows(cos, sin, S)
        q_rope = apply_rope(q_rope, cos, sin, self.rope_style)
        k_rope_BS1R = apply_rope(k_rope_BS1R, cos, sin, self.rope_style)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope_BS1R.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        if cache is not None:
            k, v = cache.extend(self.layer_id, k, v)
        if mask is None:  # causal attention of the new positions over all of them
            mask = AttentionMask.causal(S, x_BSD.device, start=k.shape[1] - S)
        return self.wo(self._attend(self._recording(cache), q, k, v, self.scale, mask))

    def qk_clip_scales(self, gamma_H: torch.Tensor) -> dict[str, torch.Tensor]:
        """QK-clip's rescale (``Attention.qk_clip_scales``) as Kimi K2 gives it for MLA: each
        head's query and key content parts (q_C in ``wq`` / ``wq_b``, k_C in ``wkv_b``) by
        sqrt(gamma_h), its query rotary part q_R by gamma_h, the rotary key ``wk_rope``,
        shared by every head, and the values left alone."""
        root = gamma_H.sqrt()[:, None]
        ones = torch.ones_like(root)
        q = torch.cat((root.expand(-1, self.nope_dim), gamma_H[:, None].expand(-1, self.rope_dim)),
                      dim=1)  # fmt: skip
        kv = torch.cat((root.expand(-1, self.nope_dim), ones.expand(-1, self.v_dim)), dim=1)
        q_name = "wq.weight" if self.wq is not None else "wq_b.weight"
        return {q_name: q.reshape(-1), "wkv_b.weight": kv.reshape(-1)}


def build_attention(
    cfg: ModelConfig, layer_id: int, context: StepContext | None = None
) -> nn.Module:
    kind = LatentAttention if cfg.attention == "mla" else Attention
    return kind(cfg, layer_id, context)
