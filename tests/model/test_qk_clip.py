"""QK-clip (``optim.qk_clip``) in one process: the heads' largest logits the attention keeps,
against a hand computation from the q and k it attends with; the rescale of Kimi K2, which
leaves every clipped head's largest logit at tau exactly and the others bit for bit, for
grouped-query, multi-head (with biases and partial rotary) and latent attention; the
config's refusals. Under every layout: the equivalence matrix
(tests/parallel/matrix_options.py, factor "qk_clip"); in training:
tests/train/test_qk_clip_training.py."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ModelConfig, MoEConfig, load_config
from moetrain.config.errors import ConfigError
from moetrain.model import Transformer
from moetrain.train.qk_clip import scale_rows

V, S, B = 32, 12, 2
ATTENTIONS = {
    "gqa, 2 query heads per kv head": {"n_heads": 4, "n_kv_heads": 2},
    "gqa, attention sinks (gpt-oss)": {"n_heads": 4, "n_kv_heads": 2, "attention_sinks": True},
    "mha, q/k/v biases, half of each head rotated": {
        "n_heads": 4, "n_kv_heads": 4, "qkv_bias": True, "partial_rotary_factor": 0.5},
    "mla, low-rank queries": {
        "attention": "mla", "n_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 8,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
    "mla, full-rank queries": {
        "attention": "mla", "n_heads": 4, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 8},
}  # fmt: skip


def _model(overrides: dict) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=1, ffn_dim=32, max_seq_len=S,
                      init_std=0.3, **overrides)  # fmt: skip
    model = Transformer(cfg, MoEConfig(num_experts=0))
    for p in model.parameters():  # biases too: a bias must be rescaled with its rows
        torch.nn.init.normal_(p, std=0.3)
    model.step_context.max_logits = True
    return model.train()


def _captured_qk(model: Transformer, ids: torch.Tensor) -> list[tuple]:
    """Forward with the attention's core wrapped: the (q, k, scale) it was handed."""
    attention = model.layers["0"].attention
    core, seen = attention.attend, []

    def capture(q, k, v, scale, *rest, **kw):
        seen.append((q.detach(), k.detach(), scale))
        return core(q, k, v, scale, *rest, **kw)

    attention.attend = capture
    try:
        model(ids)
    finally:
        attention.attend = core
    return seen


def _hand_max(q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, scale: float | None) -> torch.Tensor:
    """max over b, i, j <= i of q_i . k_j x scale, per query head, written out."""
    H, Dh = q_BSHD.shape[2], q_BSHD.shape[3]
    scale = Dh**-0.5 if scale is None else scale
    per_kv = H // k_BSHD.shape[2]
    out = torch.full((H,), -torch.inf, dtype=torch.float64)
    for h in range(H):
        q, k = q_BSHD[:, :, h].double(), k_BSHD[:, :, h // per_kv].double()
        for i in range(q.shape[1]):
            logits = (q[:, i : i + 1] * k[:, : i + 1]).sum(-1) * scale
            out[h] = max(out[h], logits.max())
    return out


@pytest.mark.parametrize("kind", list(ATTENTIONS))
def test_recorded_maxima_are_the_hand_computed_ones(kind: str) -> None:
    model = _model(ATTENTIONS[kind])
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    (q, k, scale), = _captured_qk(model, ids)
    attention = model.layers["0"].attention
    got = attention.pop_max_logits()
    torch.testing.assert_close(got.double(), _hand_max(q, k, scale), rtol=1e-5, atol=1e-5)
    assert attention.pop_max_logits() is None  # popped: the next step starts afresh
    # The recording pass computes the attention the plain one does.
    recorded = model(ids)
    model.step_context.max_logits = False
    torch.testing.assert_close(recorded, model(ids), rtol=1e-5, atol=1e-5)
    # Eval forwards and a model whose context says nothing record nothing.
    model.eval()
    model.step_context.max_logits = True
    model(ids)
    model.train()
    attention.pop_max_logits()
    model(ids)
    assert attention.pop_max_logits() is not None


@pytest.mark.parametrize("kind", list(ATTENTIONS))
def test_rescale_leaves_clipped_heads_at_tau_and_the_rest_bit_for_bit(kind: str) -> None:
    model = _model(ATTENTIONS[kind])
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    attention = model.layers["0"].attention
    model(ids)
    before = attention.pop_max_logits()
    tau = float(before.median())  # some heads above, some at or below
    clipped = before > tau
    assert clipped.any() and not clipped.all()
    gamma = torch.where(clipped, tau / before, torch.ones_like(before))
    values_before = {n: p.detach().clone() for n, p in attention.named_parameters()}
    scales = attention.qk_clip_scales(gamma)
    with torch.no_grad():
        for name, rows in scales.items():
            scale_rows(attention.get_parameter(name), rows)
    model(ids)
    after = attention.pop_max_logits()
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau),
                               rtol=2e-6, atol=0)  # fmt: skip
    assert torch.equal(after[~clipped], before[~clipped])
    # Only query and key rows moved: values, the output projection, the shared rotary key
    # and the norms are as they were.
    for name, p in attention.named_parameters():
        if name not in scales:
            assert torch.equal(p, values_before[name]), name


def test_rescale_rows_follow_k2() -> None:
    """The factors per row, spelled out: MLA's q_C and k_C by sqrt(gamma), q_R by gamma,
    values by 1; grouped queries by gamma with their shared key left alone; a head with its
    own key by sqrt(gamma) on each side."""
    gamma = torch.tensor([0.25, 1.0, 0.64, 1.0])
    mla = _model(ATTENTIONS["mla, low-rank queries"]).layers["0"].attention
    rows = mla.qk_clip_scales(gamma)
    assert set(rows) == {"wq_b.weight", "wkv_b.weight"}
    q = rows["wq_b.weight"].view(4, 12)  # per head 8 content + 4 rotary rows
    torch.testing.assert_close(q[:, :8], gamma.sqrt()[:, None].expand(4, 8))
    torch.testing.assert_close(q[:, 8:], gamma[:, None].expand(4, 4))
    kv = rows["wkv_b.weight"].view(4, 16)  # per head 8 key content + 8 value rows
    torch.testing.assert_close(kv[:, :8], gamma.sqrt()[:, None].expand(4, 8))
    assert torch.equal(kv[:, 8:], torch.ones(4, 8))
    gqa = _model(ATTENTIONS["gqa, 2 query heads per kv head"]).layers["0"].attention
    rows = gqa.qk_clip_scales(gamma)
    assert set(rows) == {"wq.weight"}
    torch.testing.assert_close(rows["wq.weight"], gamma.repeat_interleave(8))
    mha = _model(ATTENTIONS["mha, q/k/v biases, half of each head rotated"]).layers["0"]
    rows = mha.attention.qk_clip_scales(gamma)
    assert set(rows) == {"wq.weight", "wk.weight", "wq.bias", "wk.bias"}
    for r in rows.values():
        torch.testing.assert_close(r, gamma.sqrt().repeat_interleave(8))


@pytest.mark.parametrize("override", ["model.qk_norm=head", "model.clip_qkv=4.0"])
def test_refused_with_what_acts_after_the_projections(override: str) -> None:
    with pytest.raises(ConfigError, match="optim.qk_clip.*" + override.split("=")[0]):
        load_config(None, ["optim.qk_clip=50", override])


def test_threshold_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="optim.qk_clip"):
        load_config(None, ["optim.qk_clip=0"])
    assert load_config(None, ["optim.qk_clip=.inf"]).optim.qk_clip == float("inf")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rule", ["causal", "documents", "window"])
@pytest.mark.parametrize("dims", [(64, 64), (192, 128)], ids=["gqa head", "mla head"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_flexattention_maxima_on_cuda_are_the_written_out_ones(rule: str, dims, sinks) -> None:
    """On CUDA the maxima come from FlexAttention's ``max_scores`` (no scores in memory), the
    sinks folded in from its log-sum-exp; they and the attention must be what the CPU's
    written-out scores give."""
    from moetrain.model.masks import AttentionMask, attend

    qk_dim, v_dim = dims
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 128, 4, qk_dim, generator=gen) for _ in range(2))
    v = torch.randn(2, 128, 4, v_dim, generator=gen)
    mask = AttentionMask.causal()
    if rule == "documents":
        mask = mask.with_documents((torch.arange(128) // 40).expand(2, 128))
    elif rule == "window":
        mask = mask.with_window(17)
    sinks_H = torch.randn(4, generator=gen) if sinks else None
    ref_out, ref_max = attend(q, k, v, None, mask, sinks_H, max_logits=True)
    cuda = [None if t is None else t.cuda() for t in (q, k, v, sinks_H)]
    out, max_H = attend(*cuda[:3], None, mask, cuda[3], max_logits=True)
    torch.testing.assert_close(max_H.cpu(), ref_max, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_the_cuda_branch_asks_flexattention_for_maxima_and_folds_sinks(monkeypatch, sinks):
    """The CUDA branch on a CPU, FlexAttention faked by the written-out scores: it is handed
    the mask's block mask and the scale, asked for the maxima (and the log-sum-exp with
    sinks), and its outputs -- natural-log units, per query row -- become the same attention
    and maxima as the CPU's branch."""
    from torch.nn.attention.flex_attention import AuxOutput

    import moetrain.model.masks as masks

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 10, 8, generator=gen) for _ in range(3))
    sinks_H = torch.randn(4, generator=gen) if sinks else None
    mask = masks.AttentionMask.causal().with_window(4)
    asked = {}

    def fake_flex(q_, k_, v_, *, block_mask, scale, return_aux):
        asked.update(block=block_mask, scale=scale, aux=return_aux)
        allowed = mask.dense(10, 10, q_.device)
        scores = (q_ @ k_.transpose(-2, -1) * scale).masked_fill(~allowed, -torch.inf)
        out = torch.softmax(scores, -1) @ v_
        return out, AuxOutput(lse=scores.logsumexp(-1) if return_aux.lse else None,
                              max_scores=scores.amax(-1))  # fmt: skip

    monkeypatch.setattr(masks, "_compiled_flex", lambda: fake_flex)
    monkeypatch.setattr(masks.AttentionMask, "block_mask", lambda self, *a: ("block", a))
    got = masks._attend_keeping_max(q, k, v, None, mask, sinks_H, flex=True)
    want = masks._attend_keeping_max(q, k, v, None, mask, sinks_H, flex=False)
    assert asked["block"] == ("block", (2, 10, 10, q.device)) and asked["scale"] == 8**-0.5
    assert asked["aux"].max_scores and asked["aux"].lse == sinks
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])
