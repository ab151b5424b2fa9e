"""Packed batches of the default corpus: contents, determinism, layout independence, resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from moetrain.data import (
    PackedBatches,
    build_doc_source,
    load_split,
    token_entropy,
    unigram_entropy,
)
from moetrain.data.sampling import permutation_slice

SEQ = 64  # short sequences keep every test in milliseconds


def _steps(batches: PackedBatches, n: int) -> list[torch.Tensor]:
    """``n`` steps, each as this rank's [sequences, seq_len + 1] token rows."""
    out = []
    for _ in range(n):
        mbs = batches.next_step()
        out.append(torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], 1) for b in mbs]))
    return out


def _documents(cfg, tokenizer, role="train") -> list[np.ndarray]:
    """The split's documents tokenized here, independently of the cache and its reader."""
    texts = [t for t in load_split(cfg, role)[cfg.text_column] if t]
    return [np.array([*ids, tokenizer.eos_id]) for ids in tokenizer.encode_batch(texts)]


def _reference_stream(docs: list[np.ndarray], seed: int | None, n_tokens: int) -> np.ndarray:
    """The token stream written out directly: epochs of seeded orders, EOS-terminated."""
    parts, total, epoch = [], 0, 0
    while total < n_tokens:
        for d in permutation_slice(seed, epoch, len(docs), 0, len(docs)):
            parts.append(docs[d])
            total += len(docs[d])
        epoch += 1
    return np.concatenate(parts)[:n_tokens]


def test_batches_are_shifted_packed_sequences_of_the_stream(data_cfg, tokenizer):
    cfg = data_cfg(seq_len=SEQ, seed=3)
    batches = PackedBatches(cfg, tokenizer, "train", global_batch_size=8, micro_batch_size=2)
    mbs = batches.next_step()
    assert len(mbs) == batches.micro_batches_per_step == 4
    for b in mbs:
        assert set(b) == {"input_ids", "labels", "doc_ends"}
        assert b["input_ids"].dtype == b["labels"].dtype == torch.long
        assert b["doc_ends"].dtype == torch.bool and b["doc_ends"].shape == (2, SEQ)
        assert b["input_ids"].shape == b["labels"].shape == (2, SEQ)
        assert torch.equal(b["input_ids"][:, 1:], b["labels"][:, :-1])  # labels shifted by one
    batches.reset()
    got = torch.cat(_steps(batches, 4)).flatten().numpy()
    docs = _documents(cfg, tokenizer)
    want = _reference_stream(docs, seed=3, n_tokens=4 * 8 * (SEQ + 1))
    np.testing.assert_array_equal(got, want)
    assert (want == tokenizer.eos_id).sum() > 0  # documents are joined by EOS


def test_documents_are_joined_with_eos(data_cfg, tokenizer):
    cfg = data_cfg()
    source = build_doc_source(cfg, tokenizer, "train")
    docs = _documents(cfg, tokenizer)
    assert source.n_docs == len(docs)
    assert source.n_tokens == sum(len(d) for d in docs)
    ids = np.arange(source.n_docs)
    np.testing.assert_array_equal(source.lengths(ids), [len(d) for d in docs])
    for d in (0, 1, source.n_docs // 2, source.n_docs - 1):
        np.testing.assert_array_equal(source.read(d, 0, len(docs[d])), docs[d])
        assert source.read(d, len(docs[d]) - 1, len(docs[d]))[0] == tokenizer.eos_id
    assert "\n" in tokenizer.decode(docs[0][:-1].tolist())


def test_same_seed_same_batches_other_seed_other_batches(data_cfg, tokenizer):
    a = _steps(PackedBatches(data_cfg(seq_len=SEQ, seed=1), tokenizer, "train", 4, 2), 3)
    b = _steps(PackedBatches(data_cfg(seq_len=SEQ, seed=1), tokenizer, "train", 4, 2), 3)
    c = _steps(PackedBatches(data_cfg(seq_len=SEQ, seed=2), tokenizer, "train", 4, 2), 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("dp_size,micro", [(1, 8), (1, 1), (2, 4), (2, 1), (4, 2), (8, 1)])
def test_global_batch_does_not_depend_on_the_layout(data_cfg, tokenizer, dp_size, micro):
    cfg = data_cfg(seq_len=SEQ, seed=5)
    ref = _steps(PackedBatches(cfg, tokenizer, "train", 8, 4), 3)
    ranks = [
        _steps(PackedBatches(cfg, tokenizer, "train", 8, micro, r, dp_size), 3)
        for r in range(dp_size)
    ]
    for step in range(3):
        # Rank r holds the contiguous block r of the global batch, micro-batches in order.
        assert torch.equal(torch.cat([ranks[r][step] for r in range(dp_size)]), ref[step])
    one_rank = PackedBatches(cfg, tokenizer, "train", 8, micro, 0, dp_size).next_step()
    assert len(one_rank) == 8 // (dp_size * micro)


def test_resume_gives_the_batches_of_the_uninterrupted_run(data_cfg, tokenizer):
    cfg = data_cfg(seq_len=SEQ, seed=7)
    full = _steps(PackedBatches(cfg, tokenizer, "train", 4, 2), 9)
    first = PackedBatches(cfg, tokenizer, "train", 4, 2)
    _steps(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # plain ints survive any checkpoint
    assert all(type(v) is int for v in state.values()) and len(state) <= 8
    fresh = PackedBatches(cfg, tokenizer, "train", 4, 2)
    fresh.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(_steps(fresh, 4), full[5:], strict=True))
    # The state is the position in the global stream: it resumes under another layout too.
    ranks = [PackedBatches(cfg, tokenizer, "train", 4, 1, r, 2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    for step in range(4):
        assert torch.equal(torch.cat([_steps(r, 1)[0] for r in ranks]), full[5 + step])


def test_epochs_wrap_and_resume_across_the_boundary(data_cfg, tokenizer):
    cfg = data_cfg(seq_len=255, seed=11)
    # The eval split is small (~17k tokens): a few steps of 16 x 256 tokens wrap it.
    batches = PackedBatches(cfg, tokenizer, "eval", 16, 16)
    n_tokens = batches.source.n_tokens
    steps_per_epoch = n_tokens // (16 * 256)
    _steps(batches, steps_per_epoch)
    state = batches.state_dict()
    assert state["epoch"] == 0
    after = _steps(batches, 3)
    assert batches.state_dict()["epoch"] >= 1
    fresh = PackedBatches(cfg, tokenizer, "eval", 16, 16)
    fresh.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(_steps(fresh, 3), after, strict=True))
    # Eval wraps in stored order: epoch 1 starts with the tokens epoch 0 started with.
    batches.reset()
    stream = torch.cat(_steps(batches, steps_per_epoch + 3)).flatten()
    assert torch.equal(stream[n_tokens : n_tokens + 500], stream[:500])
    # Training reads every epoch in a new order.
    train = PackedBatches(cfg, tokenizer, "train", 16, 16).stream
    orders = [train.order(e) for e in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(train.source.n_docs))
    assert not np.array_equal(*orders)


def test_eval_batches_are_identical_every_time_and_independent_of_the_seed(data_cfg, tokenizer):
    evals = PackedBatches(data_cfg(seq_len=SEQ, seed=1), tokenizer, "eval", 8, 4)
    first = _steps(evals, 2)
    evals.reset()
    assert all(torch.equal(x, y) for x, y in zip(_steps(evals, 2), first, strict=True))
    other_seed = PackedBatches(data_cfg(seq_len=SEQ, seed=99), tokenizer, "eval", 8, 4)
    assert torch.equal(_steps(other_seed, 1)[0], first[0])
    assert evals.stream.seed is None  # stored order
    train = PackedBatches(data_cfg(seq_len=SEQ, seed=1), tokenizer, "train", 8, 4)
    assert not torch.equal(_steps(train, 1)[0], first[0])


def test_a_state_for_another_seed_or_other_data_is_refused(data_cfg, tokenizer):
    state = PackedBatches(data_cfg(seed=1), tokenizer, "train", 4, 2).state_dict()
    with pytest.raises(ValueError, match=r"^data\.seed: "):
        PackedBatches(data_cfg(seed=2), tokenizer, "train", 4, 2).load_state_dict(state)
    batches = PackedBatches(data_cfg(seed=1), tokenizer, "train", 4, 2)
    batches.load_state_dict({**state, "offset": 10**9})
    with pytest.raises(ValueError, match="past the end of document 0"):
        batches.next_step()


def test_token_entropy_against_the_formula():
    assert token_entropy([3, 3, 3]) == 0.0
    assert math.isclose(token_entropy([0, 1, 0, 1]), math.log(2))
    assert math.isclose(token_entropy(torch.arange(4).repeat(5)), math.log(4))
    p = np.array([0.5, 0.25, 0.25])
    assert math.isclose(token_entropy([7, 7, 1, 2]), float(-(p * np.log(p)).sum()))


def test_unigram_entropy_of_the_training_tokens(data_cfg, tokenizer):
    cfg = data_cfg()
    h = unigram_entropy(tokenizer, cfg)
    tokens = np.concatenate(_documents(cfg, tokenizer))
    counts = np.bincount(tokens, minlength=tokenizer.vocab_size)
    p = counts[counts > 0] / counts.sum()
    assert math.isclose(h, float(-(p * np.log(p)).sum()), rel_tol=1e-9)
    assert 4.0 < h < math.log(tokenizer.vocab_size)  # far from uniform, far from constant
