"""The attention-mask seam (``moetrain.model.masks``): every rule against a mask built by hand,
the attention core against a per-query softmax written out, the two backends against each
other, and the sliding window through the model (its receptive field, the layers that use it,
generation over a KV cache)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model.masks import (
    AttentionMask,
    attend,
    document_ids,
    document_lengths,
    document_positions,
    flex_untrusted_reason,
)
from moetrain.model.transformer import KVCache, build_model

V = 32


def test_document_indices_positions_and_lengths_by_hand() -> None:
    ends = torch.tensor([[0, 0, 1, 0, 1, 0], [1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert document_ids(ends).tolist() == [[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]]
    assert document_positions(document_ids(ends)).tolist() == [
        [0, 1, 2, 0, 1, 0],
        [0, 0, 1, 2, 3, 4],
    ]
    # pieces of every row, row after row: 3, 2, 1 | 1, 5
    assert document_lengths(ends).tolist() == [3, 2, 1, 1, 5]


def _hand_mask(q_pos, L, docs=None, window=None, B=1):
    """The rules written out one (query, key) pair at a time."""
    out = torch.zeros(B, len(q_pos), L, dtype=torch.bool)
    for b in range(B):
        for i, p in enumerate(q_pos):
            for j in range(L):
                ok = j <= p
                if window is not None:
                    ok = ok and p - j < window
                if docs is not None:
                    ok = ok and int(docs[b, p]) == int(docs[b, j])
                out[b, i, j] = ok
    return out


DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 2, 2]])


@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("queries", ["whole", "cp rank 0 of 2", "cache of 5"])
def test_dense_mask_is_the_hand_built_one(window, documents, queries) -> None:
    L = 8
    if queries == "whole":
        mask, q_pos = AttentionMask.causal(), list(range(L))
    elif queries == "cp rank 0 of 2":
        pos = torch.tensor([0, 1, 6, 7])
        mask, q_pos = AttentionMask.causal(positions=pos, kv_len=L), pos.tolist()
    else:
        mask, q_pos = AttentionMask.causal(3, "cpu", start=5), [5, 6, 7]
    docs = DOCS if documents else None
    mask = mask.with_documents(docs).with_window(window)
    dense = mask.dense(len(q_pos), L, torch.device("cpu"))
    expected = _hand_mask(q_pos, L, docs, window, B=2)
    if docs is None:
        assert dense.shape == (len(q_pos), L)
        assert torch.equal(dense, expected[0])
    else:
        assert dense.shape == (2, 1, len(q_pos), L)
        assert torch.equal(dense[:, 0], expected)
    assert mask.plain_causal == (queries == "whole" and docs is None and window is None)


def _reference_attention(q, k, v, scale, allowed_BsL, sinks_H=None):
    """Per query: softmax of its scores over the keys it may see, in float64; with sinks,
    the head's sink logit joins the softmax and its weight is dropped (gpt-oss)."""
    B, s, H, _ = q.shape
    out = torch.zeros(B, s, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for i in range(s):
            keys = allowed_BsL[b, i].nonzero().flatten()
            for h in range(H):
                hk = h // (H // k.shape[2])
                scores = (k[b, keys, hk].double() @ q[b, i, h].double()) * scale
                if sinks_H is None:
                    weights = scores.softmax(0)
                else:
                    weights = torch.cat((scores, sinks_H[h : h + 1].double())).softmax(0)[:-1]
                out[b, i, h] = weights @ v[b, keys, hk].double()
    return out.reshape(B, s, -1)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("rules", ["causal", "documents", "window", "documents+window"])
def test_attend_is_a_softmax_over_the_allowed_keys(rules, sinks, assert_close) -> None:
    g = torch.Generator().manual_seed(0)
    B, S, H, Hkv, Dh, Dv = 2, 8, 4, 2, 6, 5  # grouped kv heads, a value width of its own
    q = torch.randn(B, S, H, Dh, generator=g)
    k = torch.randn(B, S, Hkv, Dh, generator=g)
    v = torch.randn(B, S, Hkv, Dv, generator=g)
    sinks_H = torch.randn(H, generator=g) * 2 if sinks else None
    docs = DOCS if "documents" in rules else None
    window = 3 if "window" in rules else None
    mask = AttentionMask.causal().with_documents(docs).with_window(window)
    out = attend(q, k, v, None, mask, sinks_H)
    allowed = _hand_mask(range(S), S, docs, window, B)
    expected = _reference_attention(q, k, v, Dh**-0.5, allowed, sinks_H)
    assert_close(out, expected.float(), what=f"attention, {rules}, sinks {sinks}")
    if sinks:  # the sinks matter, and their gradient is the reference's
        plain = _reference_attention(q, k, v, Dh**-0.5, allowed)
        assert (plain - expected).abs().max() > 1e-2
        sinks_H.requires_grad_(True)
        grad = torch.autograd.grad(attend(q, k, v, None, mask, sinks_H).sum(), sinks_H)[0]
        ref = torch.autograd.grad(_reference_attention(q, k, v, Dh**-0.5, allowed, sinks_H).sum(),
                                  sinks_H)[0]  # fmt: skip
        assert_close(grad, ref.float(), what=f"sink gradient, {rules}")


FLEX_SHAPES = [(8, 40), (16, 40), (4, 17), (12, 33), (48, 257)]
"""(head dim, positions): the shapes where compiled FlexAttention went wrong under AVX2 (8
and 16 at 40 positions), and others around them (masks.FLEX_CPU_MIN_VECTOR_BITS)."""


def _flex_vs_sdpa(assert_close) -> None:
    g = torch.Generator().manual_seed(1)
    for Dh, S in FLEX_SHAPES:
        B, H = 2, 2
        q, k, v = (torch.randn(B, S, H, Dh, generator=g) for _ in range(3))
        docs = torch.zeros(B, S, dtype=torch.long)
        docs[0, S // 3 :] = 1
        docs[0, S - S // 5 :] = 2
        for window in (None, 5):
            sdpa = AttentionMask.causal().with_documents(docs).with_window(window)
            flex = AttentionMask.causal(backend="flex").with_documents(docs).with_window(window)
            assert_close(
                attend(q, k, v, None, flex),
                attend(q, k, v, None, sdpa),
                what=f"flex vs sdpa, head dim {Dh}, {S} positions, window {window}",
            )


@pytest.mark.slow  # FlexAttention compiles (about a minute on two cores)
def test_flex_backend_gives_the_sdpa_numbers(assert_close) -> None:
    """On this machine's own vector ISA: compiled FlexAttention where it is trusted, the
    SDPA fallback (with its warning) where it is not."""
    if flex_untrusted_reason("cpu") is None:
        _flex_vs_sdpa(assert_close)
    else:
        with pytest.warns(RuntimeWarning, match="gives wrong numbers on this CPU"):
            _flex_vs_sdpa(assert_close)


_AVX2_CHILD = """
import warnings, torch
from moetrain.model.masks import flex_untrusted_reason
import conftest, test_masks
reason = flex_untrusted_reason("cpu")
assert reason is not None and "avx2" in reason, reason
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    test_masks._flex_vs_sdpa(conftest._assert_close)
assert any("gives wrong numbers on this CPU" in str(w.message) for w in seen), seen
print("ok")
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector ISAs")
def test_flex_under_avx2_gives_the_sdpa_numbers(tmp_path) -> None:
    """A CPU whose inductor kernels are AVX2 (forced here with ATEN_CPU_CAPABILITY, which
    inductor's ISA choice follows, and a fresh inductor cache): compiled FlexAttention gave
    NaN or wrong rows there, so the flex backend must give SDPA's numbers and say why."""
    here = Path(__file__)
    path = os.pathsep.join(
        [str(here.parent), str(here.parents[1]), os.environ.get("PYTHONPATH", "")]
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": path,
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _AVX2_CHILD], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_document_index_of_another_length_is_refused() -> None:
    mask = AttentionMask.causal(positions=torch.tensor([0, 3]), kv_len=4)
    with pytest.raises(ValueError, match="cover 5 positions, the keys 4"):
        mask.with_documents(torch.zeros(1, 5, dtype=torch.long))


# ----------------------------------------------------------------------------- the model


def _cfgs(**model) -> tuple[ModelConfig, MoEConfig]:
    base = {"vocab_size": V, "dim": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
            "ffn_dim": 24, "max_seq_len": 24}  # fmt: skip
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, kernels="torch")
    return ModelConfig(**{**base, **model}), moe


def _changed_from(model, tokens, p) -> torch.Tensor:
    """Positions whose logits change when token ``p`` changes."""
    changed = tokens.clone()
    changed[:, p] = (changed[:, p] + 1) % V
    with torch.no_grad():
        diff = (model(changed) - model(tokens)).abs().amax(-1).amax(0)
    return (diff > 1e-6).nonzero().flatten()


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_a_sliding_window_limits_what_each_layer_sees(attention) -> None:
    """Window 3 on both of 2 layers: a token reaches 2 positions further per layer, so a
    change at position p shows at p .. p + 4 and nowhere after; a full second layer lets
    it reach the end of the sequence (the check can fail)."""
    mla = {"attention": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
           "v_head_dim": 4} if attention == "mla" else {}  # fmt: skip
    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    p = 5
    windowed = build_model(*_cfgs(sliding_window=3, **mla), seed=0).eval()
    assert _changed_from(windowed, tokens, p).tolist() == list(range(p, p + 5))
    first_only = build_model(*_cfgs(sliding_window=3, sliding_window_layers=[0], **mla), seed=0)
    assert _changed_from(first_only.eval(), tokens, p).tolist() == list(range(p, 16))


def test_generation_over_a_kv_cache_applies_the_window(assert_close) -> None:
    model = build_model(*_cfgs(sliding_window=4, sliding_window_layers=[1]), seed=0).eval()
    tokens = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = model(tokens)
        cache = KVCache()
        steps = [model(tokens[:, :7], cache)] + [
            model(tokens[:, i : i + 1], cache) for i in range(7, 12)
        ]
    assert_close(torch.cat(steps, 1), whole, what="cached steps vs one forward")


def test_window_and_layers_are_validated() -> None:
    with pytest.raises(ValueError, match="model.sliding_window_layers: \\[2\\] are not layers"):
        _cfgs(sliding_window=3, sliding_window_layers=[0, 2])[0].validate()
    with pytest.raises(ValueError, match="model.sliding_window_layers: needs model.sliding"):
        _cfgs(sliding_window_layers=[0])[0].validate()
    with pytest.raises(ValueError, match="model.sliding_window: must be >= 1"):
        _cfgs(sliding_window=0)[0].validate()


def test_attention_flops_follow_the_pieces_and_the_window() -> None:
    """12 x width FLOPs per (query, key) pair: n^2 / 2 pairs for a piece of n tokens, or
    w^2 / 2 + (n - w) w with a window w < n; the plain per-token figure is one whole piece."""
    model = build_model(*_cfgs(sliding_window=4, sliding_window_layers=[1]), seed=0)
    width = 4 * (16 // 4)  # heads x head dim
    pieces = [10, 3, 3]
    full = sum(n * n / 2 for n in pieces)
    windowed = sum(n * n / 2 if n <= 4 else 8 + (n - 4) * 4 for n in pieces)
    assert model.attention_flops(pieces) == 12 * width * (full + windowed)
    dense = model.dense_flops_per_token()
    assert model.flops_per_token(16) == dense + model.attention_flops([16]) / 16
