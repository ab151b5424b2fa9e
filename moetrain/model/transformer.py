"""Decoder-only transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU, MoE FFNs.

Single-device code: no process groups here. Parallelism is applied from outside by
``moetrain.parallel``; the layout of this file keeps that easy (layers in a ModuleDict so a
pipeline stage can delete the ones it does not own; attention reshapes with
``view(B, S, -1, head_dim)`` so a tensor-parallel rank sees only its local heads).

Shape legend: B batch, S sequence, D model dim, H heads, Hkv kv heads, Dh head dim, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model.experts import FeedForward, GroupedExperts
from moetrain.model.moe import MoELayer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 sums of squares lose too much precision.
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x_BSHDh: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1) of each head by position-dependent angles."""
    x = x_BSHDh.float().unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    cos, sin = cos_SR[:, None, :], sin_SR[:, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x_BSHDh)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        # view(B, S, -1, Dh): under tensor parallelism each rank holds only its own heads.
        q = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        q, k = apply_rope(q, cos[:S], sin[:S]), apply_rope(k, cos[:S], sin[:S])
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, cfg: ModelConfig, moe_cfg: MoEConfig):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe_enabled = is_moe_layer(layer_id, moe_cfg)
        self.ffn: nn.Module = (
            MoELayer(cfg.dim, moe_cfg) if self.moe_enabled else FeedForward(cfg.dim, cfg.ffn_dim)
        )

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x_BSD + self.attention(self.attention_norm(x_BSD), cos, sin)
        return h + self.ffn(self.ffn_norm(h))


def is_moe_layer(layer_id: int, moe_cfg: MoEConfig) -> bool:
    n = moe_cfg.every_n_layers
    return moe_cfg.num_experts > 0 and layer_id % n == n - 1


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError(
                "model.vocab_size must be set (build_model fills it from the tokenizer)"
            )
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by layer index: a pipeline stage deletes the layers it does not own
        # and keeps the original names, so checkpoints stay layout-independent.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, cfg, moe_cfg) for i in range(cfg.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere; residual output projections scaled by 1/sqrt(2L)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm weights stay at one
            residual_out = name.endswith(("attention.wo.weight", "w2.weight", "experts.w2"))
            nn.init.normal_(p, mean=0.0, std=out_std if residual_out else std)
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) int64 -> logits (B, S, V). A pipeline stage without the embedding
        takes hidden states (B, S, D) instead, and one without the output returns them."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def moe_layers(self) -> dict[int, MoELayer]:
        """The MoE layers this module holds, by layer index (a pipeline stage holds some)."""
        return {int(i): b.ffn for i, b in self.layers.items() if isinstance(b.ffn, MoELayer)}

    def set_aux_loss_scale(self, scale: float) -> None:
        """Scale of the balancing losses' injected gradient: 1 / gradient-accumulation steps,
        so that aux losses are averaged over micro-batches exactly like the LM loss."""
        for layer in self.moe_layers().values():
            layer.aux_loss_scale = scale

    def num_params(self, active: bool = False) -> int:
        """Parameter count (tied weights once). active=True counts only the top_k routed
        experts of each MoE layer: the parameters one token actually uses."""
        seen: set[int] = set()
        total = 0
        for module in self.modules():
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                n = p.numel()
                if active and isinstance(module, GroupedExperts):
                    n = n * module.top_k // module.num_experts
                total += n
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * active non-embedding params + causal attention."""
        n_active = self.num_params(active=True)
        if self.tok_embeddings is not None:
            n_active -= self.tok_embeddings.weight.numel() if not self.cfg.tie_embeddings else 0
        attn = 6 * self.cfg.n_layers * self.cfg.dim * seq_len  # 12*L*D*S / 2 for causal
        return 6 * n_active + attn


def build_model(
    cfg: ModelConfig, moe_cfg: MoEConfig, *, seed: int, device: torch.device | str = "cpu"
) -> Transformer:
    """Build and initialise the model deterministically from ``seed`` (on CPU, then moved)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(cfg, moe_cfg)
    return model.to(device)
