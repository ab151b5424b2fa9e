"""Decoder-only transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU, MoE FFNs.

Single-device code: no process groups here. Parallelism is applied from outside by
``moetrain.parallel``; the layout of this file keeps that easy (layers in a ModuleDict so a
pipeline stage can delete the ones it does not own; attention reshapes with
``view(B, S, -1, head_dim)`` so a tensor-parallel rank sees only its local heads).

Shape legend: B batch, S sequence, D model dim, H heads, Hkv kv heads, Dh head dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model.attention import Attention, KVCache, LatentAttention, build_attention
from moetrain.model.experts import FeedForward, GroupedExperts
from moetrain.model.init import (
    Where,
    init_buffers,
    init_parameters,
    no_init,
    to_empty,
    whole,
)
from moetrain.model.losses import AuxLossInjector
from moetrain.model.masks import AttentionMask, document_positions
from moetrain.model.moe import MoELayer
from moetrain.model.mtp import mtp_loss
from moetrain.model.norm import RMSNorm
from moetrain.model.rope import apply_rope, fill_rope_tables, rope_tables
from moetrain.model.sequence_shard import SequenceShard
from moetrain.model.step_context import StepContext

__all__ = [
    "MTPBlock",
    "Attention",
    "FeedForward",
    "KVCache",
    "LatentAttention",
    "RMSNorm",
    "StepContext",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "build_model",
    "empty_model",
    "is_moe_layer",
    "meta_model",
    "rope_tables",
]


class TransformerBlock(nn.Module):
    def __init__(
        self,
        layer_id: int,
        cfg: ModelConfig,
        moe_cfg: MoEConfig,
        context: StepContext | None = None,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = build_attention(cfg, layer_id, context)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe_enabled = is_moe_layer(layer_id, moe_cfg)
        self.ffn: nn.Module = (
            MoELayer(cfg.dim, moe_cfg, layer_id, context)
            if self.moe_enabled
            else FeedForward(cfg.dim, cfg.ffn_dim)
        )
        self.halves = False
        """Run training forwards in two halves of the sequences (``schedule_halves``)."""

    def schedule_halves(self) -> None:
        """From now on a forward of an even number of sequences runs as two halves whose
        phases interleave (``parallel.ep_overlap=halves``, installed by
        ``moetrain.parallel.expert_parallel``): each half's expert-parallel all-to-alls
        travel while the other half computes (``_forward_halves``)."""
        if not isinstance(self.ffn, MoELayer):
            raise ValueError(f"layer {self.layer_id}: the halves schedule needs an MoE layer")
        self.halves = True

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        mask: AttentionMask | None = None,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.halves and cache is None and x_BSD.shape[0] % 2 == 0:
            return self._forward_halves(x_BSD, cos, sin, mask, valid)
        x = self.attention_norm(x_BSD)
        # The cache only travels when generating and the mask by keyword: training calls keep
        # the 3-positional-argument form that the tensor-parallel input hooks expect.
        if cache is None:
            attn = self.attention(x, cos, sin, mask=mask)
        else:
            attn = self.attention(x, cos, sin, cache, mask=mask)
        h = x_BSD + attn
        if valid is not None and self.moe_enabled:
            return h + self.ffn(self.ffn_norm(h), valid_BS=valid)
        return h + self.ffn(self.ffn_norm(h))

    def _forward_halves(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask | None,
        valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """The block on two halves of the sequences, the MoE layer's phases interleaved:

            attention 0, route 0, issue rows 0   | (rows 0 travel)
            attention 1, route 1, issue rows 1   | rows 0 travel while half 1 attends
            experts 0, issue outputs 0           | rows 1 travel while half 0's experts run
            experts 1, issue outputs 1           | outputs 0 travel while half 1's run
            combine 0, combine 1                 | outputs 1: exposed

        Backward runs the autograd nodes in reverse order of creation, so it interleaves the
        same way, each transfer between its issue and await nodes (``Transfer``). Every
        token is computed by the same operations as in one forward, on half the rows; the
        balancing losses of each half count half (``MoELayer.begin``'s share)."""
        moe = self.ffn
        assert isinstance(moe, MoELayer)
        half = x_BSD.shape[0] // 2
        hs, passes = [], []
        for lo in (0, half):
            x = x_BSD[lo : lo + half]
            m = mask.sequences(lo, lo + half) if mask is not None else None
            c, s = (cos[lo : lo + half], sin[lo : lo + half]) if cos.dim() == 3 else (cos, sin)
            h = x + self.attention(self.attention_norm(x), c, s, mask=m)
            v = valid[lo : lo + half] if valid is not None else None
            hs.append(h)
            passes.append(moe.begin(self.ffn_norm(h), v, share=0.5))
        for p in passes:
            moe.exchange(p)
        return torch.cat([h + moe.end(p) for h, p in zip(hs, passes, strict=True)])


class MTPBlock(TransformerBlock):
    """A multi-token-prediction module (``moetrain.model.mtp``): TRM_k with M_k
    (``eh_proj``), the norms of its two inputs and its head's norm."""

    def __init__(
        self,
        layer_id: int,
        cfg: ModelConfig,
        moe_cfg: MoEConfig,
        context: StepContext | None = None,
    ):
        super().__init__(layer_id, cfg, moe_cfg, context)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.head_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h_BSD, emb_BSD, cos, sin, valid=None):  # type: ignore[override]
        """(h^k, its head-normed copy) from h^{k-1} and the embeddings of t_{i+k}; ``valid``:
        the positions whose targets count (the MoE layer's balancing losses and statistics
        see those only). The head's norm runs here, inside the block's forward, where FSDP has
        its weights whole."""
        x = self.eh_proj(torch.cat((self.enorm(emb_BSD), self.hnorm(h_BSD)), dim=-1))
        h = super().forward(x, cos, sin, valid=valid)
        return h, self.head_norm(h)


def is_moe_layer(layer_id: int, moe_cfg: MoEConfig) -> bool:
    """Layer i is MoE when there are experts, i % every_n_layers == every_n_layers - 1
    (Qwen-MoE's decoder_sparse_step) and i is not one of ``moe.dense_layers``."""
    n = moe_cfg.every_n_layers
    return (
        moe_cfg.num_experts > 0 and layer_id % n == n - 1 and layer_id not in moe_cfg.dense_layers
    )


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError(
                "model.vocab_size must be set (build_model fills it from the tokenizer)"
            )
        self.cfg = cfg
        # What the model reads of the step it runs in, shared by every MoE layer: whoever
        # runs the steps sets its fields (``moetrain.model.step_context``).
        self.step_context = StepContext()
        ctx = self.step_context
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by layer index: a pipeline stage deletes the layers it does not own
        # and keeps the original names, so checkpoints stay layout-independent.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, cfg, moe_cfg, ctx) for i in range(cfg.n_layers)}
        )
        # Multi-token prediction: module k is layer n_layers + k - 1 (as in DeepSeek's and
        # GLM's checkpoints), so that every per-layer transform and service covers it.
        for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth):
            self.layers[str(i)] = MTPBlock(i, cfg, moe_cfg, ctx)
        # Whether ``forward`` embeds token ids (False on the pipeline stages after the first,
        # which take hidden states). The last stage of a pipeline with multi-token prediction
        # keeps an embedding all the same, for the modules' inputs (``pipeline_split``).
        self.embeds_input = True
        # The multi-token-prediction loss of training forwards since the last pop_mtp_loss():
        # (sum of lambda / D * sum_k L^k, forwards).
        self.register_buffer("stat_mtp", torch.zeros(2), persistent=False)
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.tie_embeddings:  # one tensor, initialised (and trained) as the embedding
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, seed: int, where: Where = whole, skip: Collection[str] = ()) -> int:
        """Every parameter's initial value from ``seed`` (``moetrain.model.init``): normal(0,
        init_std), residual output projections at init_std / sqrt(2L), norms at one, biases at
        zero; the same values under every layout. ``where``: what this process holds of each
        parameter (a slice under a parallel layout); ``skip``: names left alone. Returns the
        elements of the largest generator block drawn."""
        return init_parameters(self, self.cfg, seed, where, skip)

    def init_buffers(self) -> None:
        """This module's own buffers: the RoPE tables and the MTP loss counter (the layers'
        buffers are theirs: ``moetrain.model.init.init_buffers`` covers the whole tree)."""
        fill_rope_tables(self.cfg, self.rope_cos, self.rope_sin)
        self.stat_mtp.zero_()

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, S) int64 -> logits (B, S, V). A pipeline stage after the first
        (``embeds_input`` False) takes hidden states (B, S, D) instead, and one without the
        output returns them.

        ``labels`` (B, S) (the next tokens; training with ``model.mtp_depth``): the
        multi-token-prediction modules run too, and their loss lambda / D * sum_k L^k reaches
        the optimizer through the returned logits' backward (``AuxLossInjector``, scaled like
        the balancing losses by the step context's ``aux_loss_scale``).

        ``cache`` (generation): the keys and values of the ``cache.length`` positions before
        ``tokens``; this call appends the new ones and advances ``cache.length`` by S.
        ``documents``: int64 (B, S) document index of every position of the whole sequences
        (all of them under context parallelism), for ``model.document_mask`` and
        ``model.document_positions``; None: one document per sequence. ``valid``: bool
        (B, S) over the whole sequences, False for the tokens left out of the LM loss, which
        the MoE layers leave out of their balancing losses and statistics; None: all."""
        if not self.embeds_input and self.step_context.zero_stage_input:
            # torch.distributed.pipelining's shape inference hands a stage after the first
            # uninitialised tensors (torch.empty): with zeros instead, every rank of a tensor-
            # or expert-parallel group routes the same tokens, and the collectives whose
            # sizes follow the routing (FP8 rowwise's per-row amax under expert TP) match.
            # Out of place (the input may be a view FSDP2's hooks return) and NaN-proof.
            tokens = tokens.nan_to_num(0.0, 0.0, 0.0) * 0
        h = self.tok_embeddings(tokens) if self.embeds_input else tokens
        if cache is not None and cache.length + tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"{cache.length + tokens.shape[1]} positions exceed "
                             f"model.max_seq_len={self.cfg.max_seq_len}")
        cos, sin, masks = self._positions(tokens.shape[1], cache, documents)
        n = self.cfg.n_layers
        for name, layer in self.layers.items():
            if int(name) >= n:
                continue  # a multi-token-prediction module: below
            mask = masks[int(name)]
            if cache is None:
                h = layer(h, cos, sin, mask=mask, valid=valid)
            else:
                h = layer(h, cos, sin, cache, mask=mask)
        if cache is not None:
            cache.length += tokens.shape[1]
        hidden = h
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        logits = self.output(h)
        blocks = [self.layers[str(i)] for i in range(n, n + self.cfg.mtp_depth)]
        if labels is not None and blocks and self.tok_embeddings is not None:
            loss = mtp_loss(blocks, hidden, labels, self.tok_embeddings, self.output, cos, sin)
            loss = loss * (self.cfg.mtp_loss_weight / len(blocks))
            if self.training and torch.is_grad_enabled():  # not the engine's counting pass
                logits = AuxLossInjector.apply(logits, loss, self.step_context.aux_loss_scale)
                with torch.no_grad():
                    self.stat_mtp += torch.stack([loss.detach().float(), loss.new_ones(())])
        return logits

    @torch.no_grad()
    def pop_mtp_loss(self) -> torch.Tensor:
        """(sum of the multi-token-prediction losses, forwards) since the last call."""
        out = self.stat_mtp.clone()
        self.stat_mtp.zero_()
        return out

    def _positions(
        self, S: int, cache: KVCache | None, documents: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, AttentionMask]]:
        """RoPE rows and every layer's attention mask for this forward's tokens.

        The rows: the whole tables when the tokens are positions 0 .. S - 1 (each attention
        takes the first rows of the length it sees: under sequence parallelism only the
        attention sees the whole sequence), the rows of this process's positions (context
        parallelism) or of the new positions (a KV cache), or per-token rows (B, S, R/2)
        when positions restart at every document."""
        cfg = self.cfg
        device = self.rope_cos.device
        cos, sin = self.rope_cos, self.rope_sin
        if cache is not None:
            mask = AttentionMask.causal(S, device, start=cache.length,
                                        backend=cfg.attention_backend)
        elif self.seq_shard is not None:
            # An early and a late chunk of every sequence under context parallelism.
            pos = self.seq_shard.positions(device)
            mask = AttentionMask.causal(positions=pos, kv_len=self.seq_shard.seq_len,
                                        backend=cfg.attention_backend)
        else:
            mask = AttentionMask.causal(backend=cfg.attention_backend)
        q_pos = mask.q_pos
        if documents is not None and cfg.document_mask and cache is None:
            documents = documents.to(device)
            mask = mask.with_documents(documents)
            if cfg.document_positions:
                rows_BS = document_positions(documents)
                rows_Bs = rows_BS if q_pos is None else rows_BS[:, q_pos]
                return cos[rows_Bs], sin[rows_Bs], self._layer_masks(mask)
        if q_pos is not None:
            cos, sin = cos[q_pos], sin[q_pos]
        return cos, sin, self._layer_masks(mask)

    def _layer_masks(self, mask: AttentionMask) -> dict[int, AttentionMask]:
        """Each layer's mask: ``mask`` itself, or one shared copy with the layer's window."""
        shared: dict[int | None, AttentionMask] = {}
        out = {}
        for name in self.layers:
            window = self.cfg.window(int(name))
            if window not in shared:
                shared[window] = mask.with_window(window)
            out[int(name)] = shared[window]
        return out

    def moe_layers(self) -> dict[int, MoELayer]:
        """The MoE layers this module holds, by layer index (a pipeline stage holds some)."""
        return {int(i): b.ffn for i, b in self.layers.items() if isinstance(b.ffn, MoELayer)}

    @property
    def seq_shard(self) -> SequenceShard | None:
        """Context parallelism: this process's positions of every sequence, by which RoPE
        rotates each token (the step context's; None: whole sequences)."""
        return self.step_context.seq_shard

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
        """Training FLOPs per token: 6 * active non-embedding params + causal attention over
        whole sequences of ``seq_len`` (each layer's window applied)."""
        return self.dense_flops_per_token() + self.attention_flops([seq_len]) / seq_len

    def dense_flops_per_token(self) -> float:
        """Training FLOPs per token of everything but the attention scores: 6 * active
        non-embedding parameters."""
        n_active = self.num_params(active=True)
        if self.tok_embeddings is not None:
            n_active -= self.tok_embeddings.weight.numel() if not self.cfg.tie_embeddings else 0
        return 6 * n_active

    def attention_flops(self, lengths: Any) -> float:
        """Training FLOPs of the attention scores and their values (forward and backward:
        12 * width per query-key pair) over sequences of ``lengths`` tokens that attend
        within themselves (the document pieces of a step under document masking), causally
        and within each layer's window: n^2 / 2 pairs of a length-n piece, or
        w^2 / 2 + (n - w) w with a window w < n."""
        c = self.cfg
        if c.attention == "mla":
            assert c.qk_nope_head_dim and c.qk_rope_head_dim and c.v_head_dim
            width = c.n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / 2
        else:
            width = c.n_heads * c.attn_head_dim
        n = torch.as_tensor(lengths, dtype=torch.float64)
        total = 0.0
        for layer in range(c.n_layers):
            w = c.window(layer)
            if w is None:
                pairs = n * n / 2
            else:
                pairs = torch.where(n <= w, n * n / 2, w * w / 2 + (n - w) * w)
            total += 12 * width * float(pairs.sum())
        return total


def meta_model(cfg: ModelConfig, moe_cfg: MoEConfig) -> Transformer:
    """The model's module tree on the meta device: names, shapes and dtypes, no memory and no
    values. The trainer parallelizes it, then materialises and initialises each rank's
    shards; ``moetrain plan`` reads it."""
    with torch.device("meta"), no_init():
        return Transformer(cfg, moe_cfg)


def empty_model(
    cfg: ModelConfig, moe_cfg: MoEConfig, device: torch.device | str = "cpu"
) -> Transformer:
    """The model on ``device`` with its buffers computed and its parameters uninitialised:
    for a caller that loads every parameter next (an import, an export, generation)."""
    model = to_empty(meta_model(cfg, moe_cfg), device)
    init_buffers(model)
    return model


def build_model(
    cfg: ModelConfig, moe_cfg: MoEConfig, *, seed: int, device: torch.device | str = "cpu"
) -> Transformer:
    """The whole model on ``device``, initialised from ``seed`` (``moetrain.model.init``):
    the same parameters as every layout of a training run with ``train.seed=seed`` starts
    from."""
    model = empty_model(cfg, moe_cfg, device)
    model.init_weights(seed)
    return model
