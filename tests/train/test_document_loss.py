"""The per-document oracle through the trainer: a training step with document masking on
sequences that pack several short documents has the loss and the gradient of every document
piece run alone through the same model, each separator's prediction left out (fp32).

The reference never packs: it cuts every row of the step's batch at its document boundaries
(``doc_ends``), runs each piece alone, sums the cross-entropy of its labels but the
separator's, and divides by the number of labels counted. Without the mask (the same batch,
the same reference) the trainer's gradients differ: the check can fail.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from multirank import micro_config
from short_docs import short_docs_dataset

from moetrain.data import PackedBatches, load_tokenizer
from moetrain.train.trainer import Trainer

FP32 = {"atol": 1e-5, "rtol": 1e-4}  # the model tests' fp32 tolerance (tests/model/conftest.py)

OPTIONS = (
    "moe.capacity_factor=null",  # dropless: a token's route is its own
    "moe.token_group_seqs=null",
    "moe.aux_loss_coef=0.0",  # balancing losses are per token group, not per document
    "moe.seq_aux_loss_coef=0.0",
    "moe.z_loss_coef=0.0",
    "model.n_layers=2",
    "data.seq_len=32",
)


def _reference(model, micro_batches) -> tuple[float, dict[str, torch.Tensor]]:
    total = torch.zeros(())
    counted = 0
    for batch in micro_batches:
        for row, ends, labels in zip(
            batch["input_ids"], batch["doc_ends"], batch["labels"], strict=True
        ):
            cuts = [0, *(ends.nonzero().flatten() + 1).tolist()]
            cuts += [len(row)] if cuts[-1] != len(row) else []
            for a, b in zip(cuts, cuts[1:], strict=False):
                logits = model(row[a:b][None])[0]
                keep = ~ends[a:b]  # a separator predicts the next document: left out
                total = total + F.cross_entropy(logits[keep], labels[a:b][keep], reduction="sum")
                counted += int(keep.sum())
    loss = total / counted
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


MLA = ("model.attention=mla", "model.q_lora_rank=24", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16")  # fmt: skip


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("positions", [False, True], ids=["positions run on", "restart"])
def test_a_masked_step_is_the_documents_run_alone(tmp_path: Path, positions, attention) -> None:
    cfg = micro_config(tmp_path / "run", "train.steps=1", f"data.dataset={short_docs_dataset()}",
                       "model.document_mask=true", f"model.document_positions={positions}",
                       *OPTIONS, *(MLA if attention == "mla" else ()))  # fmt: skip
    trainer = Trainer(cfg)
    model = copy.deepcopy(trainer.engine.parts[0]).train()
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
    data = PackedBatches(cfg.data, tok, "train", 8, cfg.train.micro_batch_size)
    micro_batches = data.next_step()
    ends = torch.cat([b["doc_ends"] for b in micro_batches])
    assert int(ends.sum()) >= 16 and not bool(ends[:, -1].all())  # many documents, some cut

    grads: list[dict[str, torch.Tensor]] = []
    trainer.engine.grad_hook = lambda engine: grads.append(engine.full_grad_dict())
    result = trainer.train_step()
    ref_loss, ref_grads = _reference(model, micro_batches)
    assert abs(result.loss - ref_loss) <= FP32["atol"] + FP32["rtol"] * abs(ref_loss)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[0][name], grad, **FP32, msg=f"gradient of {name}")


def test_without_the_mask_the_step_is_not_the_documents_alone(tmp_path: Path) -> None:
    cfg = micro_config(tmp_path / "run", "train.steps=1", f"data.dataset={short_docs_dataset()}",
                       *OPTIONS)  # fmt: skip
    trainer = Trainer(cfg)
    model = copy.deepcopy(trainer.engine.parts[0]).train()
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
    micro_batches = PackedBatches(cfg.data, tok, "train", 8, cfg.train.micro_batch_size).next_step()
    grads: list[dict[str, torch.Tensor]] = []
    trainer.engine.grad_hook = lambda engine: grads.append(engine.full_grad_dict())
    trainer.train_step()
    _, ref_grads = _reference(model, micro_batches)
    # An untrained model's loss hardly depends on context; its attention gradients do.
    name = "layers.1.attention.wq.weight"
    with pytest.raises(AssertionError):
        torch.testing.assert_close(grads[0][name], ref_grads[name], **FP32)


def test_padding_labels_are_left_out_of_the_loss_and_the_router(tmp_path: Path) -> None:
    """A batch whose labels hold -100 (padding): the step's loss is the mean cross-entropy of
    the other labels of each micro-batch (computed here by hand), and the MoE layers count
    only the other tokens."""
    cfg = micro_config(tmp_path / "run", "train.steps=1", *OPTIONS)
    trainer = Trainer(cfg)
    model = copy.deepcopy(trainer.engine.parts[0]).train()
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 4096, (2, 33), generator=g)
        labels = ids[:, 1:].clone()
        labels[0, 20:] = -100  # the tail of the first sequence is padding
        batches.append({"input_ids": ids[:, :-1], "labels": labels})
    loss = trainer.engine.forward_backward(batches)
    want = sum(
        F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten()).item()
        for b in batches
    ) / len(batches)
    assert abs(loss - want) <= FP32["atol"] + FP32["rtol"] * abs(want)
    stats = trainer.engine.moe_stats()
    counted = sum(int((b["labels"] != -100).sum()) for b in batches)
    for layer in stats.values():
        assert float(layer["tokens_per_expert"].sum()) == counted * cfg.moe.top_k


def test_document_lengths_histogram_and_flops_follow_the_documents(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moetrain.model.masks import document_lengths

    cfg = micro_config(tmp_path / "run", "train.steps=2", f"data.dataset={short_docs_dataset()}",
                       "model.document_mask=true", "log.tensorboard=true",
                       "log.histogram_every=2", *OPTIONS)  # fmt: skip
    trainer = Trainer(cfg)
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
    data = PackedBatches(cfg.data, tok, "train", 8, cfg.train.micro_batch_size)
    ends = torch.cat([b["doc_ends"] for _ in range(2) for b in data.next_step()])
    first = trainer.train_step()
    lengths = document_lengths(ends[:8])
    model = trainer.engine.parts[0]
    want = model.dense_flops_per_token() + model.attention_flops(lengths) / 8 / 32
    assert abs(first.flops_per_token - want) <= 1e-9 * want
    assert first.flops_per_token < trainer.flops_per_token  # pieces cost less than sequences
    trainer.fit()
    acc = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"histograms": 0})
    acc.Reload()
    (event,) = acc.Histograms("data/document_lengths")
    assert event.step == 2
    assert event.histogram_value.num == len(document_lengths(ends))
    assert event.histogram_value.sum == 2 * 8 * 32
