"""Expert specialization and routing stability against an independent count.

A micro run evaluates after every step (128 eval sequences of 32 tokens: a code file and
the start of the prose that follows it in the eval split) and keeps every
checkpoint. The reference does not use the trainer's records: for each checkpoint it loads
the weights through the public checkpoint API, runs the eval batches in its own forward,
reads each router's choices with a forward hook, and counts with ``collections.Counter``.
Data domains come from the embedded corpus's eval file, tokenized document by document.
The trainer's outputs -- its eval routing records, the TensorBoard text tables and stability
scalars, and the HTML report -- must agree.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from multirank import micro_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from moetrain.config import load_config
from moetrain.data import PackedBatches, corpus_files, load_tokenizer
from moetrain.model import build_model
from moetrain.train.checkpoint import CheckpointManager
from moetrain.train.trainer import Trainer

STEPS = 3
TOP = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("spec")
    cfg = micro_config(out, f"train.steps={STEPS}", "train.eval_every=1", "train.eval_batches=16",
                       "train.micro_batch_size=8",
                       "train.checkpoint_every=1", f"train.keep_last={STEPS}",
                       "log.tensorboard=true", "log.specialization=true",
                       f"log.specialization_top_tokens={TOP}", "optim.warmup_steps=1",
                       "optim.lr=0.02", "moe.jitter_eps=0.1")  # fmt: skip
    Trainer(cfg).fit()
    return out


@functools.cache
def routing_at(run: Path, step: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(eval input ids (T,), {layer: ids (T, K)}) of the checkpoint of ``step``, counted by
    a forward hook on each router of a model loaded through the checkpoint API."""
    cfg = load_config(run / "config.yaml")
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
    model = build_model(cfg.model, cfg.moe, seed=cfg.train.seed)
    state = {"model": get_model_state_dict(model)}
    CheckpointManager(run / "checkpoints", cfg.train.keep_last).load(
        run / "checkpoints" / f"step_{step:08d}", state)
    set_model_state_dict(model, state["model"])
    model.eval()
    seen: dict[int, list[torch.Tensor]] = {}
    for i, layer in model.moe_layers().items():
        layer.router.register_forward_hook(
            lambda _m, _in, r, i=i: seen.setdefault(i, []).append(r.ids_TK.clone()))
    n = cfg.train.eval_batches * cfg.train.micro_batch_size
    data = PackedBatches(cfg.data, tok, "eval", n, cfg.train.micro_batch_size)
    batches = data.next_step()
    with torch.no_grad():
        for b in batches:
            model(b["input_ids"])
    tokens = torch.cat([b["input_ids"] for b in batches]).flatten()
    return tokens, {i: torch.cat(v) for i, v in seen.items()}


def token_domains(n_tokens: int, seq_len: int, n_seqs: int) -> list[str]:
    """The domain of each eval input token: the eval file's documents in order, each
    tokenized and followed by EOS, cut into sequences of seq_len + 1."""
    tok = load_tokenizer("default")
    stream: list[str] = []
    with corpus_files(None)["eval"].open() as f:
        for line in f:
            rec = json.loads(line)
            stream += [rec["domain"]] * (len(tok.encode(rec["text"])) + 1)
            if len(stream) > n_seqs * (seq_len + 1):
                break
    out = [stream[i * (seq_len + 1) + j] for i in range(n_seqs) for j in range(seq_len)]
    assert len(out) == n_tokens
    return out


def tb_texts(run: Path) -> dict[str, dict[int, str]]:
    acc = EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    out: dict[str, dict[int, str]] = {}
    for tag in acc.Tags()["tensors"]:
        if not tag.endswith("/text_summary"):
            continue
        for ev in acc.Tensors(tag):
            value = tensor_util.make_ndarray(ev.tensor_proto).item()
            out.setdefault(tag, {})[ev.step] = value.decode()
    return out


def tb_scalars(run: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def test_records_are_the_checkpoints_routing(run: Path) -> None:
    for step in range(1, STEPS + 1):
        tokens, ids = routing_at(run, step)
        rec = torch.load(run / "routing" / "eval" / f"step_{step:08d}.pt", weights_only=True)
        assert torch.equal(rec["input_ids"].flatten(), tokens)
        for layer, want in ids.items():
            assert torch.equal(rec["ids"][layer][0].to(torch.int64), want), (step, layer)


def test_stability_scalars_match_an_independent_count(run: Path) -> None:
    final = routing_at(run, STEPS)[1]
    scalars = tb_scalars(run)
    changed = False
    for step in range(1, STEPS + 1):
        ids = routing_at(run, step)[1]
        for layer, want in final.items():
            same = sum(int(a) == int(b) for a, b in zip(ids[layer][:, 0], want[:, 0],
                                                         strict=True))  # fmt: skip
            expected = same / want.shape[0]
            changed |= expected < 1
            got = scalars[f"moe/layer{layer}/routing_stability"][step]
            assert got == pytest.approx(expected, abs=1e-6), (step, layer)
    assert changed, "the routing never changed: the check would pass on a constant"


def _parse_table(markdown: str) -> dict[int, list[str]]:
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cells and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


def test_specialization_tables_match_an_independent_count(run: Path) -> None:
    cfg = load_config(run / "config.yaml")
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
    tokens, ids = routing_at(run, STEPS)
    n_seqs = tokens.numel() // cfg.data.seq_len
    domains = token_domains(tokens.numel(), cfg.data.seq_len, n_seqs)
    assert {"code", "prose"} == set(domains), "the eval set should hold both domains"
    texts = tb_texts(run)
    E = cfg.moe.num_experts
    for layer, ids_TK in ids.items():
        table = _parse_table(texts[f"moe/specialization/layer{layer}/text_summary"][STEPS])
        assert "| expert | tokens | share of code | share of prose |" in \
            texts[f"moe/specialization/layer{layer}/text_summary"][STEPS]
        per_expert: dict[int, Counter] = {e: Counter() for e in range(E)}
        by_domain: Counter = Counter()
        for t in range(tokens.numel()):
            for e in set(ids_TK[t].tolist()):
                per_expert[e][int(tokens[t])] += 1
                by_domain[e, domains[t]] += 1
        for e in range(E):
            cells = table[e]
            assert int(cells[1]) == sum(per_expert[e].values())
            for j, d in enumerate(("code", "prose")):
                total = sum(by_domain[x, d] for x in range(E))
                assert float(cells[2 + j]) == pytest.approx(by_domain[e, d] / total, abs=5e-4)
            top = sorted(per_expert[e].items(), key=lambda kv: (-kv[1], kv[0]))[:TOP]
            shown = re.findall(r"`(.*?)` (\d+)(?:, |$)", cells[4])
            assert [int(n) for _, n in shown] == [n for _, n in top], (layer, e)
            labels = [repr(tok.decode([t]))[1:-1].replace("|", "\\|") or "''" for t, _ in top]
            assert [s for s, _ in shown] == labels, (layer, e)


def test_coactivation_matches_an_independent_count(run: Path) -> None:
    from moetrain.train.specialization import load_eval_routing, trace_specialization

    _, ids = routing_at(run, STEPS)
    specs = trace_specialization(load_eval_routing(run)[STEPS])
    for layer, ids_TK in ids.items():
        pairs: Counter = Counter()
        for row in ids_TK.tolist():
            for i in set(row):
                for j in set(row):
                    pairs[i, j] += 1
        E = specs[layer].coactivation_EE.shape[0]
        want = [[pairs[i, j] for j in range(E)] for i in range(E)]
        assert specs[layer].coactivation_EE.tolist() == want
        assert any(want[i][j] for i in range(E) for j in range(E) if i != j)


def test_the_html_report_shows_the_same_tables(run: Path, tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
    from expert_report import main

    result = main([str(run), "-o", str(tmp_path / "r.html")])
    page = (tmp_path / "r.html").read_text()
    texts = tb_texts(run)
    for layer in (0, 1, 2, 3):
        table = _parse_table(texts[f"moe/specialization/layer{layer}/text_summary"][STEPS])
        block = re.search(rf'<table class="spec" data-run="[^"]+" data-layer="{layer}">(.*?)'
                          r"</table>", page, re.S).group(1)  # fmt: skip
        for e, cells in table.items():
            row = re.search(rf'<tr data-expert="{e}">(.*?)</tr>', block, re.S).group(1)
            assert f"<td>{cells[1]}</td>" in row
            shares = re.findall(r'<td data-value="([^"]+)">', row)
            assert [f"{float(v):.3f}" for v in shares] == cells[2:4]
    assert "specialization_0.png" in result["pngs"] and "stability_0.png" in result["pngs"]
