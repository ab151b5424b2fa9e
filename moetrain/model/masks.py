"""Attention masks: which keys each query may see, built in one place for every attention.

Three rules, combined:

- **causal**: a query at position p sees keys at positions <= p;
- **documents** (block-causal, ``model.document_mask``): and only keys of its own document,
  when a packed sequence holds several;
- **sliding window** (``model.sliding_window`` on the layers ``model.sliding_window_layers``
  names): and only the ``window`` latest positions, its own included (``p - key < window``,
  transformers' and gpt-oss's convention).

``Transformer.forward`` builds one ``AttentionMask`` per forward (and one more per distinct
window) and hands each layer its own; every attention variant (grouped-query, latent, and
the context-parallel core that gathers keys from other ranks) calls ``attend(q, k, v, scale,
mask)`` with it and never builds a mask itself. The mask describes queries by their
positions in the sequence, so one description serves a whole sequence, a context-parallel
rank's two chunks of it, and the new positions of a generation step over a KV cache.

Attention sinks (gpt-oss, ``model.attention_sinks``): ``attend`` takes a logit per head that
joins every query's softmax denominator, run as one more key that every query sees
(``_attend_with_sinks``); the mask is the same.

QK-clip (``optim.qk_clip``): ``attend(..., max_logits=True)`` also returns each head's largest
pre-softmax logit, from the same pass (``_attend_keeping_max``).

Two ways to run it (``model.attention_backend``): "sdpa", ``scaled_dot_product_attention``
with ``is_causal=True`` when the mask is plain causal and an explicit boolean mask otherwise,
or "flex", FlexAttention with a block mask (compiled: blocks that the mask empties are
skipped; on a CPU whose inductor kernels are not AVX-512 the compiled kernel gives wrong
numbers, so the same mask runs through SDPA there, with a warning: ``flex_untrusted_reason``).
``docs/attention.md`` holds the measurement behind the default.

Shape legend: B batch, s query positions, L key positions, S whole sequence, H heads,
Dh head dim, Dv value head dim.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa", "flex")


def document_ids(doc_ends_BS: torch.Tensor) -> torch.Tensor:
    """int64 (B, S) document index of each token (0 for the row's first document) from
    ``doc_ends_BS``, True where a token is the last of its document (its separator): a new
    document starts after each end."""
    ends = doc_ends_BS.to(torch.int64)
    return ends.cumsum(-1) - ends


def document_positions(docs_BS: torch.Tensor) -> torch.Tensor:
    """int64 (B, S) position of each token within its document (0 at a document's first
    token of the row) from document indices that never decrease along a row."""
    B, S = docs_BS.shape
    pos_S = torch.arange(S, device=docs_BS.device)
    starts_BS = torch.ones_like(docs_BS, dtype=torch.bool)
    starts_BS[:, 1:] = docs_BS[:, 1:] != docs_BS[:, :-1]
    first_BS = torch.where(starts_BS, pos_S, torch.zeros_like(pos_S)).cummax(-1).values
    return pos_S - first_BS


def document_lengths(doc_ends_BS: torch.Tensor) -> torch.Tensor:
    """int64 lengths of the document pieces of every row, row after row (a document cut by
    a row boundary counts as one piece in each row): what the attention of a row costs."""
    docs_BS = document_ids(doc_ends_BS)
    per_row_B1 = docs_BS[:, -1:] + 1
    first_B1 = per_row_B1.cumsum(0) - per_row_B1  # documents of the rows before
    return torch.bincount((docs_BS + first_B1).flatten())


@dataclass(frozen=True)
class AttentionMask:
    """What the queries of one attention call may see (module doc).

    Queries sit at positions ``q_pos`` of their sequence (None: the whole sequence, 0 ..
    s - 1, whatever length s the call has -- under sequence parallelism only the attention
    sees it whole); keys at positions 0 .. kv_len - 1 (None: as many as the queries).
    ``docs_BS``: document index of every position of every sequence (None: one document
    each). ``window``: the latest positions a query sees (None: all of them). Build it with
    ``causal`` and refine it with ``with_documents`` / ``with_window``; the dense mask and the
    block mask are computed once per object and length, on first use, so that every layer
    sharing a mask shares them."""

    q_pos: torch.Tensor | None = None
    kv_len: int | None = None
    docs_BS: torch.Tensor | None = None
    window: int | None = None
    backend: str = "sdpa"
    _cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def causal(
        cls,
        q_len: int | None = None,
        device: torch.device | str = "cpu",
        start: int = 0,
        positions: torch.Tensor | None = None,
        kv_len: int | None = None,
        backend: str = "sdpa",
    ) -> AttentionMask:
        """Causal attention of a whole sequence (no arguments), of ``q_len`` new queries at
        positions start .. start + q_len - 1 over the ``start + q_len`` positions up to
        them (a KV cache), or of queries at ``positions`` (a context-parallel rank's share)
        over ``kv_len`` positions."""
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r}: expected one of {BACKENDS}")
        if positions is not None:
            assert kv_len is not None
            return cls(positions.to(device), kv_len, backend=backend)
        if q_len is None or start == 0:
            return cls(backend=backend)
        q_pos = torch.arange(start, start + q_len, device=device)
        return cls(q_pos, start + q_len, backend=backend)

    def with_documents(self, docs_BS: torch.Tensor | None) -> AttentionMask:
        """Block-causal: each query sees its own document only (``docs_BS``: document
        index of each position of every sequence; None: no change)."""
        if docs_BS is None:
            return self
        if self.kv_len is not None and docs_BS.shape[-1] != self.kv_len:
            raise ValueError(
                f"document indices cover {docs_BS.shape[-1]} positions, the keys {self.kv_len}"
            )
        return replace(self, docs_BS=docs_BS, _cache={})

    def sequences(self, start: int, stop: int) -> AttentionMask:
        """The mask of sequences ``start .. stop - 1`` of the batch (the same mask when it
        does not depend on the sequence)."""
        if self.docs_BS is None:
            return self
        return replace(self, docs_BS=self.docs_BS[start:stop], _cache={})

    def with_window(self, window: int | None) -> AttentionMask:
        """Sliding window: each query sees its ``window`` latest positions (None: no
        change)."""
        if window is None:
            return self
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        return replace(self, window=window, _cache={})

    @property
    def plain_causal(self) -> bool:
        """A whole sequence with nothing but the causal rule (SDPA's ``is_causal``)."""
        return self.q_pos is None and self.docs_BS is None and self.window is None

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor, b: Any = None) -> torch.Tensor:
        """Whether queries at ``q_pos`` may see keys at ``k_pos`` (broadcasting; ``b``: the
        sequence index, for the document rule). The one definition of the mask: the dense
        mask and FlexAttention's ``mask_mod`` both evaluate it."""
        ok = k_pos <= q_pos
        if self.window is not None:
            ok = ok & (q_pos - k_pos < self.window)
        if self.docs_BS is not None:
            ok = ok & (self.docs_BS[b, q_pos] == self.docs_BS[b, k_pos])
        return ok

    def _queries(self, s: int, device: torch.device) -> torch.Tensor:
        return self.q_pos if self.q_pos is not None else torch.arange(s, device=device)

    def dense(self, s: int, L: int, device: torch.device) -> torch.Tensor:
        """Boolean mask for SDPA (True: attend) of ``s`` queries over ``L`` keys: (s, L),
        or (B, 1, s, L) with documents."""
        key = ("dense", s, L, device)
        if key not in self._cache:
            q = self._queries(s, device)[:, None]
            k = torch.arange(L, device=device)[None, :]
            if self.docs_BS is None:
                mask = self.allowed(q, k)
            else:
                docs = self.docs_BS.to(device)
                b = torch.arange(docs.shape[0], device=device)[:, None, None]
                mask = replace(self, docs_BS=docs).allowed(q[None], k[None], b)[:, None]
            self._cache[key] = mask
        return self._cache[key]

    def block_mask(self, batch: int, s: int, L: int, device: torch.device) -> Any:
        """FlexAttention's block mask of ``batch`` sequences, ``s`` queries, ``L`` keys."""
        key = ("block", batch, s, L, device)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            q_pos = self._queries(s, device)
            docs = None if self.docs_BS is None else self.docs_BS.to(device)
            rule = replace(self, docs_BS=docs)

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return rule.allowed(q_pos[q_idx], kv_idx, b)

            B = batch if docs is not None else None
            self._cache[key] = create_block_mask(mask_mod, B, None, s, L, device=device)
        return self._cache[key]


def repeat_kv(k_BLHD: torch.Tensor, v_BLHD: torch.Tensor, heads: int):
    """Grouped-query attention: each kv head serves heads / Hkv query heads."""
    n_rep = heads // k_BLHD.shape[2]
    if n_rep > 1:
        k_BLHD = k_BLHD.repeat_interleave(n_rep, dim=2)
        v_BLHD = v_BLHD.repeat_interleave(n_rep, dim=2)
    return k_BLHD, v_BLHD


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


FLEX_CPU_MIN_VECTOR_BITS = 512
"""Compiled FlexAttention on a CPU is trusted only where inductor vectorises its C++ kernel
with at least this many bits (AVX-512). With AVX2 (256 bits), torch 2.13's C++ FlexAttention
template returned NaN or wrong rows that change from run to run: measured on an AMD EPYC with
AVX-512 forced to AVX2 (``ATEN_CPU_CAPABILITY=avx2``, fresh inductor cache), at head dims 8
and 16 with 40 positions (max abs error 1.2 to 2.8 against SDPA, or NaN; different shapes fail
in different runs: the signature of memory read before it is written), while the same shapes
and 15 others (head dims 4 to 48, 16 to 257 positions) agree within 1e-6 under AVX-512
(tests/model/test_masks.py). Without a vectorising ISA inductor refuses to compile it at
all."""


@functools.cache
def flex_untrusted_reason(device_type: str) -> str | None:
    """Why compiled FlexAttention cannot be trusted on ``device_type`` (None: it can). Only
    CPUs are checked: FlexAttention's GPU kernels are Triton's, not this C++ template."""
    if device_type != "cpu":
        return None
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    bits = isa.bit_width() if isa else 0
    if bits >= FLEX_CPU_MIN_VECTOR_BITS:
        return None
    name = str(isa) if isa else "none"
    return (
        f"compiled FlexAttention gives wrong numbers on this CPU (inductor's vector ISA: "
        f"{name}, {bits} bits; trusted from {FLEX_CPU_MIN_VECTOR_BITS}, AVX-512): the same "
        "mask runs through SDPA, which gives FlexAttention's numbers (docs/attention.md)"
    )


def _flex_or_fallback(device: torch.device) -> bool:
    """Whether the flex backend may run compiled FlexAttention on ``device``; warns when it
    may not (``attend`` then runs the same mask through SDPA; Python's default warning filter
    shows it once)."""
    reason = flex_untrusted_reason(device.type)
    if reason is not None:
        warnings.warn(f"model.attention_backend=flex: {reason}", RuntimeWarning, stacklevel=3)
    return reason is None


def attend(
    q_BsHD: torch.Tensor,
    k_BLHD: torch.Tensor,
    v_BLHD: torch.Tensor,
    scale: float | None,
    mask: AttentionMask,
    sinks_H: torch.Tensor | None = None,
    max_logits: bool = False,
) -> Any:
    """Attention of the queries over the keys and values under ``mask`` -> (B, s, H*Dv).
    Keys and values may have fewer (kv) heads than the queries. ``sinks_H``: a logit per
    query head added to the softmax's denominator (attention sinks, gpt-oss).

    ``max_logits``: also return each query head's largest pre-softmax logit, q.k x scale
    over every query and the keys it may see (the sinks are not keys), in fp32 ->
    ``(out, max_H)``: the same pass computes both (``_attend_keeping_max``), for QK-clip."""
    B, s = q_BsHD.shape[:2]
    L, device = k_BLHD.shape[1], q_BsHD.device
    k_BLHD, v_BLHD = repeat_kv(k_BLHD, v_BLHD, q_BsHD.shape[2])
    q, k, v = (t.transpose(1, 2) for t in (q_BsHD, k_BLHD, v_BLHD))
    if max_logits:
        flex = device.type == "cuda"  # FlexAttention's maxima have no CPU kernel
        out, max_H = _attend_keeping_max(q, k, v, scale, mask, sinks_H, flex)
        return out.transpose(1, 2).reshape(B, s, -1), max_H
    if sinks_H is not None:
        out = _attend_with_sinks(q, k, v, scale, mask.dense(s, L, device), sinks_H)
    elif mask.plain_causal:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    elif mask.backend == "flex" and _flex_or_fallback(q.device):
        block = mask.block_mask(B, s, L, device)
        out = _compiled_flex()(q, k, v, block_mask=block, scale=scale)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.dense(s, L, device), scale=scale
        )
    return out.transpose(1, 2).reshape(B, s, -1)


def _attend_keeping_max(
    q_BHsD: torch.Tensor,
    k_BHLD: torch.Tensor,
    v_BHLD: torch.Tensor,
    scale: float | None,
    mask: AttentionMask,
    sinks_H: torch.Tensor | None,
    flex: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (B, H, s, Dv) and each head's largest logit (H,) from one pass. ``flex``
    (CUDA): compiled FlexAttention with its ``max_scores`` output (the row maxima its kernel
    keeps for the online softmax anyway) and, with sinks, its log-sum-exp, which folds them
    in (``fold_sinks``). Otherwise: the scores written out (B, H, s, L), their maximum read
    from them, softmax in fp32 -- the math of SDPA's reference path, since FlexAttention has
    no CPU kernel for its maxima -- and the sinks folded in the same way."""
    B, H, s, Dh = q_BHsD.shape
    L = k_BHLD.shape[2]
    scale = Dh**-0.5 if scale is None else scale
    if flex:
        from torch.nn.attention.flex_attention import AuxRequest

        block = mask.block_mask(B, s, L, q_BHsD.device)
        request = AuxRequest(lse=sinks_H is not None, max_scores=True)
        out, aux = _compiled_flex()(q_BHsD, k_BHLD, v_BHLD, block_mask=block, scale=scale,
                                    return_aux=request)  # fmt: skip
        max_H = aux.max_scores.detach().float().amax(dim=(0, 2))
        return (out if sinks_H is None else fold_sinks(out, aux.lse, sinks_H)), max_H
    if mask.plain_causal:  # built here, not cached: a compiled block guards on the cache
        allowed = torch.ones(s, L, dtype=torch.bool, device=q_BHsD.device).tril()
    else:
        allowed = mask.dense(s, L, q_BHsD.device)
    scores = ((q_BHsD @ k_BHLD.transpose(-2, -1)) * scale).float()
    scores = scores.masked_fill(~allowed, float("-inf"))
    max_H = scores.detach().amax(dim=(0, 2, 3))
    out = torch.softmax(scores, dim=-1).to(v_BHLD.dtype) @ v_BHLD
    if sinks_H is not None:
        out = fold_sinks(out, torch.logsumexp(scores, dim=-1), sinks_H)
    return out, max_H


def fold_sinks(
    out_BHsD: torch.Tensor, lse_BHs: torch.Tensor, sinks_H: torch.Tensor
) -> torch.Tensor:
    """Attention sinks added after the fact: with Z = exp(lse) the sum over the keys, the
    softmax over the keys and one sink of logit s_h is the keys' softmax times Z / (Z + e^s_h)
    = sigmoid(lse - s_h), the sink's value being zero."""
    keep = torch.sigmoid(lse_BHs.float() - sinks_H.float().view(1, -1, 1))
    return out_BHsD * keep.unsqueeze(-1).to(out_BHsD.dtype)


SINK_PAD = 8
"""Width of the extra query/key dims that carry the sink (one used, the rest zeros: fused
attention kernels want head dims in multiples of 8)."""


def _attend_with_sinks(
    q_BHsD: torch.Tensor,
    k_BHLD: torch.Tensor,
    v_BHLD: torch.Tensor,
    scale: float | None,
    allowed: torch.Tensor,
    sinks_H: torch.Tensor,
) -> torch.Tensor:
    """softmax([q.k_1, ..., q.k_L, sink_h]) over the keys and one sink, the sink's weight
    dropped: SDPA over one more key that every query sees, with a zero value, whose logit is
    the head's sink whatever the query (each query gets an extra dim 1, every key 0, the
    sink key sink_h / scale there). ``allowed``: the boolean mask (s, L) or (B, 1, s, L)."""
    B, H, s, Dh = q_BHsD.shape
    scale = Dh**-0.5 if scale is None else scale
    extra = q_BHsD.new_zeros(B, H, s, SINK_PAD)
    extra[..., 0] = 1.0
    q = torch.cat((q_BHsD, extra), dim=-1)
    logit = (sinks_H.to(k_BHLD.dtype) / scale).view(1, H, 1, 1).expand(B, H, 1, 1)
    zeros = k_BHLD.new_zeros(B, H, 1, Dh)
    sink_key = torch.cat((zeros, logit, k_BHLD.new_zeros(B, H, 1, SINK_PAD - 1)), dim=-1)
    k = torch.cat((sink_key, F.pad(k_BHLD, (0, SINK_PAD))), dim=2)
    v = torch.cat((v_BHLD.new_zeros(B, H, 1, v_BHLD.shape[-1]), v_BHLD), dim=2)
    mask = F.pad(allowed, (1, 0), value=True)  # the sink: column 0, seen by every query
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
