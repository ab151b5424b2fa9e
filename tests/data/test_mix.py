"""data.mix: several prepared datasets mixed by weight, deterministic, layout-free, resumable."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from moetrain.config import ConfigError, DataConfig
from moetrain.data import DataError, PackedBatches, check_data, prepare_dataset, unigram_entropy

SEQ = 16


def _jsonl(path: Path, tag: str, n: int) -> Path:
    rows = [{"text": f"{tag} {i}: " + " ".join([tag] * (3 + i % 17))} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def parts(tmp_path_factory, cache_dir) -> dict[str, str]:
    """Three small prepared datasets of distinct text."""
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for tag, n in (("alpha", 120), ("beta", 80), ("gamma", 60)):
        cfg = DataConfig(dataset=str(_jsonl(root / f"{tag}.jsonl", tag, n)), cache_dir=cache_dir)
        prepare_dataset(cfg, root / tag, workers=0, shard_mb=0.001, progress=False)
        out[tag] = str(root / tag)
    return out


def _mix(parts: dict[str, str], weights: dict[str, float]) -> str:
    return ",".join(f"{parts[t]}:{w}" for t, w in weights.items())


def _rows(batches: PackedBatches, steps: int) -> np.ndarray:
    out = []
    for _ in range(steps):
        for b in batches.next_step():
            out.append(torch.cat([b["input_ids"], b["labels"][:, -1:]], 1).numpy())
    return np.concatenate(out)


def test_mixture_draws_each_sequence_from_one_dataset_with_its_weight(parts, data_cfg, tokenizer):
    weights = {"alpha": 3.0, "beta": 1.0, "gamma": 1.0}
    cfg = data_cfg(mix=_mix(parts, weights), seq_len=SEQ, seed=5)
    check_data(cfg)
    steps, g = 250, 8
    mixed = _rows(PackedBatches(cfg, tokenizer, "train", g, 4), steps)
    # Each dataset's own stream (same seed): the mixture must interleave them, in order.
    own = {
        tag: _rows(
            PackedBatches(data_cfg(dataset=p, seq_len=SEQ, seed=5), tokenizer, "train", g, 4), steps
        )
        for tag, p in parts.items()
    }
    next_row = dict.fromkeys(parts, 0)
    picks = []
    for row in mixed:
        tag = next(t for t in parts if np.array_equal(row, own[t][next_row[t]]))
        next_row[tag] += 1
        picks.append(tag)
    n = len(picks)
    total = sum(weights.values())
    for tag, w in weights.items():
        p = w / total
        count = picks.count(tag)
        assert abs(count - n * p) < 4 * math.sqrt(n * p * (1 - p)), (tag, count, n * p)
    # Every dataset wrapped into later epochs at least once: the mix outlives its parts.
    assert min(next_row.values()) * (SEQ + 1) > 900


def test_mixture_is_deterministic_layout_free_and_resumable(parts, data_cfg, tokenizer):
    cfg = data_cfg(mix=_mix(parts, {"alpha": 0.5, "beta": 0.3, "gamma": 0.2}), seq_len=SEQ)
    full = _rows(PackedBatches(cfg, tokenizer, "train", 8, 4), 40).reshape(40, 8, -1)
    again = _rows(PackedBatches(cfg, tokenizer, "train", 8, 2), 40).reshape(40, 8, -1)
    np.testing.assert_array_equal(full, again)
    # Two ranks: disjoint halves whose union is the global batch.
    ranks = [PackedBatches(cfg, tokenizer, "train", 8, 2, r, 2) for r in range(2)]
    halves = [_rows(r, 40).reshape(40, 4, -1) for r in ranks]
    np.testing.assert_array_equal(np.concatenate(halves, 1), full)
    # Resume at any step, under either layout.
    run = PackedBatches(cfg, tokenizer, "train", 8, 4)
    states = []
    for _ in range(40):
        states.append(json.loads(json.dumps(run.state_dict())))
        run.next_step()
    for k in (0, 1, 17, 39):
        fresh = PackedBatches(cfg, tokenizer, "train", 8, 4)
        fresh.load_state_dict(states[k])
        np.testing.assert_array_equal(_rows(fresh, 40 - k).reshape(-1, 8, SEQ + 1), full[k:])
        two = [PackedBatches(cfg, tokenizer, "train", 8, 4, r, 2) for r in range(2)]
        for r in two:
            r.load_state_dict(states[k])
        got = np.concatenate([_rows(r, 1) for r in two])
        np.testing.assert_array_equal(got, full[k])
    assert states[-1]["sequences"] == 39 * 8 and len(states[-1]["mix"]) == 3


def test_mixture_eval_is_fixed_and_the_entropy_is_of_the_mixture(parts, data_cfg, tokenizer):
    mix = _mix(parts, {"alpha": 1.0, "beta": 1.0})
    evals = [
        PackedBatches(data_cfg(mix=mix, seq_len=SEQ, seed=s), tokenizer, "eval", 8, 4)
        for s in (0, 1)
    ]
    first = _rows(evals[0], 2)
    evals[0].reset()
    np.testing.assert_array_equal(_rows(evals[0], 2), first)
    np.testing.assert_array_equal(_rows(evals[1], 2), first)  # independent of data.seed
    h = unigram_entropy(tokenizer, data_cfg(mix=mix, seq_len=SEQ))
    alone = [unigram_entropy(tokenizer, data_cfg(dataset=parts[t])) for t in ("alpha", "beta")]
    assert h > max(alone)  # a mixture of two vocabularies is more varied than either


def test_mixture_state_must_match(parts, data_cfg, tokenizer):
    mix = _mix(parts, {"alpha": 1.0, "beta": 1.0})
    state = PackedBatches(data_cfg(mix=mix), tokenizer, "train", 4, 2).state_dict()
    other = _mix(parts, {"alpha": 2.0, "beta": 1.0})
    with pytest.raises(DataError, match=r"^data\.mix: the checkpoint's mixture has weights"):
        PackedBatches(data_cfg(mix=other), tokenizer, "train", 4, 2).load_state_dict(state)
    single = PackedBatches(data_cfg(dataset=parts["alpha"]), tokenizer, "train", 4, 2)
    with pytest.raises(DataError, match=r"^data\.mix: .*mixture of 2 datasets"):
        single.load_state_dict(state)
    with pytest.raises(DataError, match=r"^data\.mix: .*for one dataset"):
        PackedBatches(data_cfg(mix=mix), tokenizer, "train", 4, 2).load_state_dict(
            single.state_dict()
        )


@pytest.mark.parametrize(
    "mix,extra,phrase",
    [
        ("{alpha}", {}, "is not DIR:WEIGHT"),
        ("{alpha}:0", {}, "is not DIR:WEIGHT with a weight > 0"),
        ("{alpha}:-1,{beta}:1", {}, "weight > 0"),
        ("{alpha}:nan", {}, "weight > 0"),
        ("{alpha}:1,{alpha}:2", {}, "is listed twice"),
        ("/no/such/dir:1", {}, "is not a directory"),
        ("{alpha}:1", {"dataset": "corpus.jsonl"}, "the mixture replaces data.dataset"),
    ],
)
def test_bad_mix_is_a_config_error_naming_the_key(parts, cache_dir, mix, extra, phrase):
    cfg = DataConfig(mix=mix.format(**parts), cache_dir=cache_dir, **extra)
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert str(info.value).startswith("data.mix: ") and phrase in str(info.value)


def test_mix_of_a_directory_that_is_not_prepared(parts, tmp_path, data_cfg):
    plain = tmp_path / "plain"
    plain.mkdir()
    cfg = data_cfg(mix=f"{parts['alpha']}:1,{plain}:1")
    with pytest.raises(DataError) as info:
        check_data(cfg)
    assert str(info.value).startswith(f"data.mix: '{plain / 'manifest.json'}' does not exist")
