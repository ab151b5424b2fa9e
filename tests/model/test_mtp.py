"""Multi-token prediction against a hand computation of the DeepSeek-V3 report's equations
(section 2.2), written position by position:

    h'_i^k = M_k [RMSNorm(h_i^{k-1}); RMSNorm(Emb(t_{i+k}))]    (M_k split into its two halves)
    h^k    = TRM_k(h'^k_{1:T-k})
    L^k    = -1/T sum_{i=2+k}^{T+1} log P^k_i[t_i],   P^k_{i+k+1} = OutHead(h_i^k)
    L_MTP  = lambda / D sum_k L^k

The model's recorded loss equals it, and one backward of the model's LM loss gives every
parameter the gradient of LM + L_MTP computed by hand (so the loss really reaches the
optimizer, scaled as it should). A wiring mistake (the embedding of the wrong token) is
caught.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model import build_model
from moetrain.model import mtp as mtp_module
from moetrain.model.transformer import TransformerBlock

TOL = 1e-5
D_DEPTH = 2
LAMBDA = 0.3


def _model():
    m = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                    max_seq_len=32, tie_embeddings=False, mtp_depth=D_DEPTH,
                    mtp_loss_weight=LAMBDA)  # fmt: skip
    e = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16, capacity_factor=None,
                  aux_loss_coef=0.0, z_loss_coef=0.0, kernels="torch")  # fmt: skip
    model = build_model(m, e, seed=3)
    with torch.no_grad():  # norms away from one, so that swapping them would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
    return model.train()


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def hand_mtp_loss(model, tokens_BT1: torch.Tensor) -> torch.Tensor:
    """L_MTP of the report, from the model's parameters; tokens t_1 .. t_{T+1} (0-based
    columns 0 .. T)."""
    cfg = model.cfg
    T = tokens_BT1.shape[1] - 1
    emb_W = model.tok_embeddings.weight
    cos, sin = model.rope_cos, model.rope_sin
    h = emb_W[tokens_BT1[:, :T]]  # main model on t_1 .. t_T
    for i in range(cfg.n_layers):
        h = model.layers[str(i)](h, cos, sin)
    total = 0.0
    for k in range(1, D_DEPTH + 1):
        blk = model.layers[str(cfg.n_layers + k - 1)]
        W = blk.eh_proj.weight  # (d, 2d): checkpoint layout [emb; h] -> M_k = [W_h, W_e]
        W_e, W_h = W[:, : cfg.dim], W[:, cfg.dim :]
        rows = []
        for i in range(T - k):  # report's positions 1 .. T-k (0-based i)
            hi = _rms(h[:, i], blk.hnorm.weight, cfg.norm_eps)
            ei = _rms(emb_W[tokens_BT1[:, i + k]], blk.enorm.weight, cfg.norm_eps)  # t_{i+k}
            rows.append(hi @ W_h.T + ei @ W_e.T)
        h = TransformerBlock.forward(blk, torch.stack(rows, dim=1), cos, sin)  # TRM_k
        logits = _rms(h, blk.head_norm.weight, cfg.norm_eps) @ model.output.weight.T
        logp = torch.log_softmax(logits.double(), dim=-1)
        targets = tokens_BT1[:, k + 1 :]  # t_{i+k+1}
        nll = -logp.gather(-1, targets[..., None]).squeeze(-1)  # (B, T - k)
        total = total + nll.sum(1).mean() / T  # -1/T sum_i, averaged over the batch
    return LAMBDA / D_DEPTH * total


def _tokens(B: int = 3, T: int = 12) -> torch.Tensor:
    return torch.randint(0, 97, (B, T + 1), generator=torch.Generator().manual_seed(4))


def test_mtp_loss_and_gradient_equal_the_reports_equations() -> None:
    model = _model()
    ref = copy.deepcopy(model)
    tokens = _tokens()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    logits = model(inputs, labels=labels)
    recorded, forwards = model.pop_mtp_loss().tolist()
    lm = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    lm.backward()  # the MTP loss rides on the logits' backward

    want = hand_mtp_loss(ref, tokens)
    ref_lm = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten())
    assert forwards == 1
    assert math.isclose(recorded, want.item(), rel_tol=TOL), (recorded, want.item())
    (ref_lm + want.float()).backward()
    checked = 0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        err = (p.grad - q.grad).abs().max().item()
        assert err <= TOL * max(1.0, q.grad.abs().max().item()), (name, err)
        checked += 1
    mtp_names = [n for n, _ in model.named_parameters() if n.startswith("layers.2.eh_proj")]
    assert mtp_names and checked > 20


def test_a_wiring_mistake_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedding of t_{i+k+1} instead of t_{i+k}: the comparison above fails."""
    real = mtp_module.mtp_loss

    def shifted(blocks, h, labels, embed, head, cos, sin):
        return real(blocks, h, labels, lambda t: embed(torch.roll(t, -1, 1)), head, cos, sin)

    monkeypatch.setattr("moetrain.model.transformer.mtp_loss", shifted)
    model = _model()
    tokens = _tokens()
    model(tokens[:, :-1], labels=tokens[:, 1:])
    recorded = model.pop_mtp_loss()[0].item()
    want = hand_mtp_loss(model, tokens).item()
    assert not math.isclose(recorded, want, rel_tol=1e-3), (recorded, want)


def test_mtp_runs_only_in_training_with_labels() -> None:
    model = _model()
    tokens = _tokens()
    with torch.no_grad():
        plain = model(tokens[:, :-1])
        with_labels = model(tokens[:, :-1], labels=tokens[:, 1:])
    assert torch.equal(plain, with_labels)  # the logits are the main model's
    assert model.pop_mtp_loss()[1] == 0  # no-grad forwards (the counting pass) record nothing
