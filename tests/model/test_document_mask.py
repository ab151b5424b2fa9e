"""The per-document oracle on the model: a packed sequence of several documents with document
masking gives each document the logits and the routing of that document run alone (fp32,
the model tests' tolerance), for grouped-query and latent attention, with positions running
on or restarting at every document, plain RoPE and YaRN. Without the mask the later documents
differ: the check can fail.

And the router's view of excluded tokens: the balancing losses and statistics of a batch with
some tokens marked invalid against the same quantities computed by hand over the valid ones.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model.losses import load_balancing_loss, router_entropy, z_loss
from moetrain.model.masks import document_ids
from moetrain.model.moe import MoELayer
from moetrain.model.transformer import build_model

V = 48
LENGTHS = (5, 7, 1, 3)  # a one-token document among them
MLA = {"attention": "mla", "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
       "qk_rope_head_dim": 4, "v_head_dim": 6}  # fmt: skip
YARN = {"rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_seq_len": 8,
        "rope_yarn_mscale": 1.0, "rope_yarn_mscale_all_dim": 1.0}  # fmt: skip


def _model(document_mask: bool, **model):
    cfg = ModelConfig(vocab_size=V, dim=24, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32,
                      max_seq_len=32, document_mask=document_mask, **model)  # fmt: skip
    # Dropless and no jitter: a token's route depends on its own hidden state alone (capacity
    # would make the documents of one token group compete for expert slots).
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=12, kernels="torch",
                    num_shared_experts=1)  # fmt: skip
    cfg.validate()
    return build_model(cfg, moe, seed=3).eval()


def _routing(model, tokens, **kwargs):
    """Logits and every MoE layer's expert ids (T, K) of one forward."""
    layers = model.moe_layers()
    model.step_context.eval_record = {i: [] for i in layers}
    with torch.no_grad():
        logits = model(tokens, **kwargs)
    ids = {i: torch.cat(model.step_context.eval_record[i]) for i in layers}
    model.step_context.eval_record = None
    return logits, ids


def _packed(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]
    ends = torch.zeros(sum(LENGTHS), dtype=torch.bool)
    ends[torch.tensor(LENGTHS).cumsum(0) - 1] = True
    return docs, torch.cat(docs)[None], document_ids(ends[None])


@pytest.mark.thread_counts
@pytest.mark.parametrize("positions", [False, True], ids=["positions run on", "restart"])
@pytest.mark.parametrize("arch", ["gqa", "mla", "mla+yarn", "gqa+yarn"])
def test_each_packed_document_sees_only_itself(arch, positions, assert_close) -> None:
    extra = {**(MLA if "mla" in arch else {}), **(YARN if "yarn" in arch else {})}
    model = _model(True, document_positions=positions, **extra)
    docs, packed, documents = _packed()
    logits, ids = _routing(model, packed, documents=documents)
    start = 0
    for k, doc in enumerate(docs):
        alone_logits, alone_ids = _routing(model, doc[None])
        end = start + len(doc)
        assert_close(logits[0, start:end], alone_logits[0], what=f"document {k} logits")
        for layer, layer_ids in ids.items():
            assert torch.equal(layer_ids[start:end], alone_ids[layer]), (k, layer)
        start = end


def test_without_the_mask_later_documents_see_the_earlier_ones() -> None:
    model = _model(False)
    docs, packed, documents = _packed()
    logits, _ = _routing(model, packed, documents=documents)  # documents ignored: no mask
    alone, _ = _routing(model, docs[1][None])
    s = len(docs[0])
    assert (logits[0, s : s + len(docs[1])] - alone[0]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- the router


def test_router_losses_and_statistics_count_only_valid_tokens(assert_close) -> None:
    """A batch of 2 sequences x 6 tokens with 4 invalid tokens: every balancing loss and
    statistic equals the one computed by hand on the valid tokens alone."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, kernels="torch",
                    aux_loss_coef=0.01, seq_aux_loss_coef=0.01, z_loss_coef=0.001,
                    token_group_seqs=1)  # fmt: skip
    layer = MoELayer(16, cfg).train()
    x = torch.randn(2, 6, 16)
    valid = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 0, 1, 1, 1, 0]], dtype=torch.bool)
    layer(x, valid_BS=valid)
    stats = layer.pop_stats()

    # By hand: route every token, keep the valid ones, sequence by sequence.
    with torch.no_grad():
        r = layer.router(x.reshape(12, 16), "torch")
    probs, ids, lse = r.scores_TE, r.ids_TK, r.lse_T
    keep = valid.reshape(-1)
    per_seq = []
    for b in range(2):
        rows = keep.clone()
        rows[torch.arange(12) // 6 != b] = False
        p, i = probs[rows], ids[rows]
        f = torch.bincount(i.flatten(), minlength=4).float() / i.numel()
        per_seq.append(4 * (f * p.mean(0)).sum())
    aux = torch.stack(per_seq).mean()
    assert_close(stats["aux_loss"], aux, what="switch loss over valid tokens")
    assert_close(stats["seq_aux_loss"], aux, what="sequence loss (one sequence per group)")
    # Per-token means: over each token group's (here each sequence's) valid tokens, then
    # over the groups.
    seqs = [keep & (torch.arange(12) // 6 == b) for b in range(2)]
    z = torch.stack([lse[m].pow(2).mean() for m in seqs]).mean()
    assert_close(stats["z_loss"], z, what="z-loss")
    ent_T = -(probs * probs.clamp_min(1e-20).log()).sum(-1)
    assert_close(
        stats["entropy"], torch.stack([ent_T[m].mean() for m in seqs]).mean(), what="entropy"
    )
    counts = torch.bincount(ids[keep].flatten(), minlength=4).float()
    assert torch.equal(stats["tokens_per_expert"], counts)
    assert float(stats["assignments"]) == int(keep.sum()) * 2
    assert float(stats["score_hist"].sum()) == int(keep.sum()) * 4
    mean_probs = torch.stack([probs[m].mean(0) for m in seqs]).mean(0)
    assert_close(stats["probs_sum"], mean_probs, what="mean probabilities")
    # The same functions without the mask give other numbers: the check can fail.
    assert abs(float(z_loss(lse)) - float(stats["z_loss"])) > 1e-4
    assert abs(float(router_entropy(probs)) - float(stats["entropy"])) > 1e-5
    assert abs(float(load_balancing_loss(probs, ids, 2)) - float(stats["aux_loss"])) > 1e-5
