"""The transformers model of a checkpoint exported by ``moetrain export-hf`` when no Hugging
Face family expresses its architecture: ``AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True)``, ``generate`` and ``pipeline`` run it.

Self-contained: torch and transformers only, never moetrain (a user without moetrain loads
it). It computes what moetrain's model computes, op for op in the same order, so that the
logits agree with moetrain's: RMSNorm in fp32, RoPE tables in float64 (plain, linear, YaRN,
llama3; interleaved or rotate-half pairs), grouped-query attention (q/k norms per head or
over the whole projection, biases, clamping, attention sinks, sliding-window layers) or
multi-head latent attention, and MoE layers with an fp32 router (softmax or sigmoid scores, a
logit bias, a selection bias, group-limited top-k, renormalisation, a scaling factor), SwiGLU
experts (with biases, or gpt-oss's clamped SwiGLU) and shared experts (optionally gated).
Routing is dropless (inference has no capacity limit). Tensor names are moetrain's inside
each layer; ``model.embed_tokens``, ``model.norm`` and ``lm_head`` around them.

Shape legend: B batch, S new positions, L cached + new positions, D model dim, H heads,
Dh head dim, T tokens, E experts, K top-k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moetrain import MoetrainConfig

try:  # transformers 5: initialisers that leave loaded tensors alone
    from transformers import initialization as init
except ImportError:  # pragma: no cover - transformers 4
    init = nn.init

MLA_LATENT_NORM_EPS = 1e-6
_CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else ("past_key_values")
)


# ----------------------------------------------------------------------------- RoPE


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_dim(m: dict) -> int:
    if m["attention"] == "mla":
        return m["qk_rope_head_dim"]
    return int((m["head_dim"] or m["dim"] // m["n_heads"]) * m.get("partial_rotary_factor", 1.0))


def rope_inv_freq(m: dict) -> tuple[torch.Tensor, float]:
    """float64 inverse frequencies and the factor the cos/sin tables carry."""
    dim, base, factor = rope_dim(m), m["rope_theta"], m["rope_scaling_factor"]
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    kind = m["rope_scaling"]
    if kind == "none":
        return inv, 1.0
    if kind == "linear":
        return inv / factor, 1.0
    original = m["rope_original_max_seq_len"]
    if kind == "llama3":
        low, high = m["rope_llama3_low_freq_factor"], m["rope_llama3_high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > original / low, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, smoothed, scaled), 1.0
    mscale, mscale_all = m["rope_yarn_mscale"], m["rope_yarn_mscale_all_dim"]
    if mscale and mscale_all:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(m["rope_yarn_beta_fast"])
    high = correction_dim(m["rope_yarn_beta_slow"])
    if m.get("rope_yarn_truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
    return inv, attention_factor


def rope_cos_sin(m: dict, positions_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin (B, S, R/2) of the positions, scaled by the attention factor."""
    inv, attention_factor = rope_inv_freq(m)
    angles = positions_BS.to("cpu", torch.float64)[..., None] * inv
    cos = (angles.cos() * attention_factor).float().to(positions_BS.device)
    sin = (angles.sin() * attention_factor).float().to(positions_BS.device)
    return cos, sin


def apply_rope(x_BSHR: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str):
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x = x_BSHR.float()
    if style == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x_BSHR)
    x = x.unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x_BSHR)


def softmax_scale_factor(m: dict) -> float:
    if m["attention"] == "mla" and m["rope_scaling"] == "yarn" and m["rope_yarn_mscale_all_dim"]:
        return _yarn_mscale(m["rope_scaling_factor"], m["rope_yarn_mscale_all_dim"]) ** 2
    return 1.0


# ----------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def attend(q_BSHD, k_BLHD, v_BLHD, mask_B1SL, scale, sinks_H=None):
    """SDPA over keys with fewer (kv) heads than queries; (B, S, H * Dv). ``sinks_H``: a
    logit per head in the softmax's denominator (attention sinks), computed eagerly."""
    B, S, H = q_BSHD.shape[:3]
    rep = H // k_BLHD.shape[2]
    if rep > 1:
        k_BLHD = k_BLHD.repeat_interleave(rep, dim=2)
        v_BLHD = v_BLHD.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BLHD, v_BLHD))
    if sinks_H is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SL, scale=scale)
    else:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = (q @ k.transpose(-1, -2)).float() * scale
        scores = scores.masked_fill(~mask_B1SL, float("-inf"))
        sink = sinks_H.float().view(1, H, 1, 1).expand(B, H, S, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        out = probs.to(v.dtype) @ v
    return out.transpose(1, 2).reshape(B, S, -1)


def window(m: dict, layer_id: int):
    """The sliding window of a layer (moetrain's model.sliding_window_layers), or None."""
    layers = m.get("sliding_window_layers")
    w = m.get("sliding_window")
    return w if layers is None or layer_id in layers else None


def _cached(cache, layer_id: int, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor):
    """This step's keys/values appended to the layer's cache; all of them, (B, L, H, D)."""
    if cache is None:
        return k_BSHD, v_BSHD
    k, v = cache.update(k_BSHD.transpose(1, 2), v_BSHD.transpose(1, 2), layer_id)
    return k.transpose(1, 2), v.transpose(1, 2)


class Attention(nn.Module):
    """Grouped-query attention (moetrain's ``model.attention: gqa``)."""

    def __init__(self, m: dict, layer_id: int):
        super().__init__()
        self.m, self.layer_id = m, layer_id
        self.head_dim = m["head_dim"] or m["dim"] // m["n_heads"]
        self.rope_dim = rope_dim(m)  # partial rotary: the first rope_dim dims of each head
        kv_heads = m["n_kv_heads"] or m["n_heads"]
        q_out, kv_out = m["n_heads"] * self.head_dim, kv_heads * self.head_dim
        self.wq = nn.Linear(m["dim"], q_out, bias=m["qkv_bias"])
        self.wk = nn.Linear(m["dim"], kv_out, bias=m["qkv_bias"])
        self.wv = nn.Linear(m["dim"], kv_out, bias=m["qkv_bias"])
        self.wo = nn.Linear(q_out, m["dim"], bias=m["out_bias"])
        self.sinks = nn.Parameter(torch.zeros(m["n_heads"])) if m.get("attention_sinks") else None
        self.q_norm = self.k_norm = None
        if m["qk_norm"] != "none":
            per_head = m["qk_norm"] == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else q_out, m["norm_eps"])
            self.k_norm = RMSNorm(self.head_dim if per_head else kv_out, m["norm_eps"])

    def forward(self, x_BSD, cos, sin, mask, cache):
        B, S, _ = x_BSD.shape
        q, k, v = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        if self.m["qk_norm"] == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        clip = self.m["clip_qkv"]
        if clip is not None:
            q, k, v = (t.clamp(-clip, clip) for t in (q, k, v))
        q = q.view(B, S, -1, self.head_dim)
        k = k.view(B, S, -1, self.head_dim)
        v = v.view(B, S, -1, self.head_dim)
        if self.m["qk_norm"] == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        k, v = _cached(cache, self.layer_id, k, v)
        return self.wo(attend(q, k, v, mask, None, self.sinks))

    def _rope(self, x, cos, sin):
        if self.rope_dim == self.head_dim:
            return apply_rope(x, cos, sin, self.m["rope_style"])
        rot, rest = x.split((self.rope_dim, self.head_dim - self.rope_dim), dim=-1)
        return torch.cat((apply_rope(rot, cos, sin, self.m["rope_style"]), rest), dim=-1)


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (moetrain's ``model.attention: mla``)."""

    def __init__(self, m: dict, layer_id: int):
        super().__init__()
        self.m, self.layer_id = m, layer_id
        self.nope, self.rope, self.v_dim = (
            m["qk_nope_head_dim"],
            m["qk_rope_head_dim"],
            m["v_head_dim"],
        )
        qk = self.nope + self.rope
        self.scale = qk**-0.5 * softmax_scale_factor(m)
        H, D, C = m["n_heads"], m["dim"], m["kv_lora_rank"]
        self.wq = self.wq_a = self.q_norm = self.wq_b = None
        if m["q_lora_rank"] is None:
            self.wq = nn.Linear(D, H * qk, bias=False)
        else:
            self.wq_a = nn.Linear(D, m["q_lora_rank"], bias=False)
            self.q_norm = RMSNorm(m["q_lora_rank"], MLA_LATENT_NORM_EPS)
            self.wq_b = nn.Linear(m["q_lora_rank"], H * qk, bias=False)
        self.wkv_a = nn.Linear(D, C, bias=False)
        self.kv_norm = RMSNorm(C, MLA_LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(C, H * (self.nope + self.v_dim), bias=False)
        self.wk_rope = nn.Linear(D, self.rope, bias=False)
        self.wo = nn.Linear(H * self.v_dim, D, bias=False)

    def forward(self, x_BSD, cos, sin, mask, cache):
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        q_nope, q_rope = q.view(B, S, -1, self.nope + self.rope).split((self.nope, self.rope), -1)
        kv = self.wkv_b(self.kv_norm(self.wkv_a(x_BSD))).view(B, S, -1, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        k_rope = self.wk_rope(x_BSD).view(B, S, 1, self.rope)
        q_rope = apply_rope(q_rope, cos, sin, self.m["rope_style"])
        k_rope = apply_rope(k_rope, cos, sin, self.m["rope_style"])
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        k, v = _cached(cache, self.layer_id, k, v)
        return self.wo(attend(q, k, v, mask, self.scale))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    def __init__(self, dim: int, e: dict):
        super().__init__()
        self.e = e
        self.gate = nn.Linear(dim, e["num_experts"], bias=bool(e.get("router_bias")))
        self.register_buffer("expert_bias", torch.zeros(e["num_experts"]))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (T, K) fp32, expert ids (T, K))."""
        e = self.e
        bias_E = self.gate.bias.float() if self.gate.bias is not None else None
        logits_TE = F.linear(x_TD.float(), self.gate.weight.float(), bias_E)
        if e["score_func"] == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1)
        else:
            scores_TE = torch.sigmoid(logits_TE)
        select_TE = scores_TE
        if e["route_with_bias"]:
            select_TE = select_TE + self.expert_bias.float()
        if e["n_groups"] > 1:
            T, E = select_TE.shape
            G = e["n_groups"]
            grouped = select_TE.view(T, G, E // G)
            if e.get("group_score", "top2") == "max":
                group_TG = grouped.max(dim=-1).values
            else:
                group_TG = grouped.topk(2, dim=-1).values.sum(-1)
            keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
            keep_TG.scatter_(1, group_TG.topk(e["topk_groups"], dim=-1).indices, True)
            keep_TE = keep_TG.repeat_interleave(E // G, dim=1)
            select_TE = select_TE.masked_fill(~keep_TE, float("-inf"))
        ids_TK = torch.topk(select_TE, e["top_k"], dim=-1, sorted=True).indices
        weights_TK = scores_TE.gather(1, ids_TK)
        if e["renormalize"]:
            denom = weights_TK.sum(-1, keepdim=True)
            if e["score_func"] == "sigmoid":
                denom = denom.clamp_min(1e-20)
            weights_TK = weights_TK / denom
        if e["routed_scaling_factor"] != 1.0:
            weights_TK = weights_TK * e["routed_scaling_factor"]
        return weights_TK, ids_TK


class GroupedExperts(nn.Module):
    """E SwiGLU experts with weights (E, D, F), (E, D, F), (E, F, D); with ``bias`` the
    biases (E, F), (E, F), (E, D) of gate, up and down; the activation silu(g) * u or the
    clamped SwiGLU (moetrain's moe.expert_activation)."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, e: dict):
        super().__init__()
        self.e = e
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.b1 = self.b3 = self.b2 = None
        if e.get("expert_ffn_bias"):
            self.b1 = nn.Parameter(torch.zeros(num_experts, ffn_dim))
            self.b3 = nn.Parameter(torch.zeros(num_experts, ffn_dim))
            self.b2 = nn.Parameter(torch.zeros(num_experts, dim))

    def _act(self, g, u):
        if self.e.get("expert_activation", "swiglu") == "clamped_swiglu":
            limit, alpha = self.e["swiglu_limit"], self.e["swiglu_alpha"]
            g = g.clamp(max=limit)
            return (u.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)
        return F.silu(g) * u

    def forward(self, x_TD, weights_TK, ids_TK) -> torch.Tensor:
        out_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
        for e in torch.unique(ids_TK).tolist():
            tok, slot = (ids_TK == e).nonzero(as_tuple=True)
            x = x_TD[tok]
            w1, w3, w2 = (w[e].to(x.dtype) for w in (self.w1, self.w3, self.w2))
            g, u = x @ w1, x @ w3
            if self.b1 is not None:
                g, u = g + self.b1[e].to(x.dtype), u + self.b3[e].to(x.dtype)
            y = self._act(g, u) @ w2
            if self.b2 is not None:
                y = y + self.b2[e].to(x.dtype)
            out_TD.index_add_(0, tok, weights_TK[tok, slot, None] * y.float())
        return out_TD.to(x_TD.dtype)


class MoELayer(nn.Module):
    def __init__(self, dim: int, e: dict):
        super().__init__()
        self.router = Router(dim, e)
        self.experts = GroupedExperts(e["num_experts"], dim, e["expert_ffn_dim"], e)
        self.shared_experts = self.shared_expert_gate = None
        if e["num_shared_experts"]:
            hidden = e["shared_expert_ffn_dim"] or e["num_shared_experts"] * e["expert_ffn_dim"]
            self.shared_experts = FeedForward(dim, hidden)
            if e["shared_expert_gate"]:
                self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        weights_TK, ids_TK = self.router(x_TD)
        y_TD = self.experts(x_TD, weights_TK, ids_TK)
        if self.shared_experts is not None:
            shared = self.shared_experts(x_TD)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared
            y_TD = y_TD + shared
        return y_TD.view(B, S, D)


def is_moe_layer(i: int, e: dict) -> bool:
    n = e["every_n_layers"]
    return e["num_experts"] > 0 and i % n == n - 1 and i not in e["dense_layers"]


class Block(nn.Module):
    def __init__(self, config: MoetrainConfig, layer_id: int):
        super().__init__()
        m, e = config.moetrain_model, config.moetrain_moe
        self.attention_norm = RMSNorm(m["dim"], m["norm_eps"])
        attn = LatentAttention if m["attention"] == "mla" else Attention
        self.attention = attn(m, layer_id)
        self.ffn_norm = RMSNorm(m["dim"], m["norm_eps"])
        self.window = window(m, layer_id)
        self.ffn = (
            MoELayer(m["dim"], e)
            if is_moe_layer(layer_id, e)
            else FeedForward(m["dim"], m["ffn_dim"])
        )
        if layer_id >= m["n_layers"]:
            # A multi-token-prediction module (moetrain's model.mtp_depth): its weights are
            # kept for training; inference does not run it.
            self.enorm = RMSNorm(m["dim"], m["norm_eps"])
            self.hnorm = RMSNorm(m["dim"], m["norm_eps"])
            self.eh_proj = nn.Linear(2 * m["dim"], m["dim"], bias=False)
            self.head_norm = RMSNorm(m["dim"], m["norm_eps"])

    def forward(self, x, cos, sin, masks, cache):
        mask = masks[self.window]
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, cache)
        return h + self.ffn(self.ffn_norm(h))


# ----------------------------------------------------------------------------- models


class MoetrainPreTrainedModel(PreTrainedModel):
    config_class = MoetrainConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, GroupedExperts):
            for w in (module.w1, module.w3, module.w2):
                init.normal_(w, mean=0.0, std=std)
            for b in (module.b1, module.b3, module.b2):
                if b is not None:
                    init.zeros_(b)
        elif isinstance(module, Attention) and module.sinks is not None:
            init.zeros_(module.sinks)
        elif isinstance(module, Router):
            init.zeros_(module.expert_bias)


def attention_mask_4d(
    attention_mask: torch.Tensor | None, q_pos_BS: torch.Tensor, L: int, window=None
) -> torch.Tensor:
    """(B, 1, S, L) bool: query i sees key j <= its cache index that is not padding (and,
    with a sliding ``window``, j > i - window). A query always sees itself, so that a padding
    query's row is never empty."""
    B, S = q_pos_BS.shape
    device = q_pos_BS.device
    key_L = torch.arange(L, device=device)
    q_idx_S = torch.arange(L - S, L, device=device)
    allowed = key_L[None, :] <= q_idx_S[:, None]
    if window is not None:
        allowed = allowed & (q_idx_S[:, None] - key_L[None, :] < window)
    allowed = allowed[None].expand(B, S, L)
    if attention_mask is not None and attention_mask.dim() == 2:
        allowed = allowed & attention_mask[:, None, :L].bool()
    allowed = allowed | (key_L[None, None, :] == q_idx_S[None, :, None])
    return allowed[:, None]


class MoetrainModel(MoetrainPreTrainedModel):
    def __init__(self, config: MoetrainConfig):
        super().__init__(config)
        m = config.moetrain_model
        self.embed_tokens = nn.Embedding(m["vocab_size"], m["dim"])
        depth = m["n_layers"] + m.get("mtp_depth", 0)
        self.layers = nn.ModuleList(Block(config, i) for i in range(depth))
        self.norm = RMSNorm(m["dim"], m["norm_eps"])
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None):  # fmt: skip
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, S = h.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + S, device=h.device)[None].expand(B, S)
        cos, sin = rope_cos_sin(self.config.moetrain_model, position_ids)
        layers = self.layers[: self.config.moetrain_model["n_layers"]]
        masks = {w: attention_mask_4d(attention_mask, position_ids, past + S, w)
                 for w in {layer.window for layer in layers}}  # fmt: skip
        for layer in layers:
            h = layer(h, cos, sin, masks, cache)
        return self.norm(h)


class MoetrainForCausalLM(MoetrainPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MoetrainConfig):
        super().__init__(config)
        self.model = MoetrainModel(config)
        m = config.moetrain_model
        self.lm_head = nn.Linear(m["dim"], m["vocab_size"], bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        h = self.model(input_ids, attention_mask, position_ids, cache if use_cache else None,
                       inputs_embeds)  # fmt: skip
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        out = {"loss": loss, "logits": logits, _CACHE_FIELD: cache if use_cache else None}
        return CausalLMOutputWithPast(**out)


__all__ = ["MoetrainConfig", "MoetrainForCausalLM", "MoetrainModel", "MoetrainPreTrainedModel"]
