"""Every moetrain model goes back out: when no Hugging Face family expresses a checkpoint,
``export-hf`` writes moetrain's own transformers model (modeling and config files beside
the weights, ``auto_map``), which ``AutoModelForCausalLM``, ``generate`` and ``pipeline`` run
with ``trust_remote_code=True`` and the logits of moetrain's model.

References are independent of the modeling file under test: moetrain's own model read from
the checkpoint (its forward, its ``generate``), and for the upcycled Qwen2 transformers' own
dense Qwen2 model (an upcycled model starts as the dense one).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_zoo import VOCAB, save_hf, save_tokenizer
from multirank import micro_config

from moetrain.cli import main
from moetrain.interop.checkpoints import checkpoint_info, load_model
from moetrain.interop.convert import export_hf
from moetrain.model.generate import generate

LOGIT_ATOL = 2e-5
"""fp32 max abs logit error. Twice test_families.py's: the option-heavy last case, at the wide
init of 0.3 (its first, dense FFN's outputs reach 20, the residual stream 30 by the fourth
layer), carries the transformers model's few ulps of rounding in that FFN to 1.5e-5 on the
logits (9.4e-6 from the init before the layout-independent one: the same rounding, other
weights)."""
REPO = Path(__file__).resolve().parents[2]

CASES: dict[str, tuple[list[str], str | None]] = {
    # configs/tiny.yaml's own model: softmax routing with the aux-loss-free expert bias,
    # tied embeddings, interleaved RoPE; no family has the bias.
    "tiny.yaml": (["train.global_batch_size=8", "train.micro_batch_size=8", "data.seq_len=32",
                   "train.eval_batches=1"],
                  None),
    # the micro MoE: an ungated shared expert beside softmax routing and the bias, and a
    # multi-token-prediction module (kept with the weights, not run by inference).
    "micro (shared expert, expert bias)": (["model.mtp_depth=1"], None),
    # options a family has, but not together: forced through --family moetrain.
    "mla, yarn, sigmoid groups by their best, scaling, dense first layer, rotate-half": ([
        "model.attention=mla", "model.q_lora_rank=24", "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
        "model.rope_scaling=yarn", "model.rope_scaling_factor=4.0",
        "model.rope_original_max_seq_len=16", "model.rope_yarn_mscale=1.0",
        "model.rope_yarn_mscale_all_dim=1.0", "model.rope_yarn_truncate=false",
        "model.rope_style=half",
        "moe.score_func=sigmoid", "moe.n_groups=2", "moe.topk_groups=1",
        "moe.routed_scaling_factor=2.5", "moe.dense_layers=[0]", "moe.group_score=max"],
        "moetrain"),
    # ... and gpt-oss's options beside ones gpt-oss does not have.
    "whole-projection q/k norm, clip, biases, head_dim, partial llama3, sparse layers, sinks, "
    "sliding layers, router and expert biases, clamped SwiGLU": ([
        "model.qk_norm=full", "model.clip_qkv=1.5", "model.qkv_bias=true", "model.head_dim=16",
        "model.rope_scaling=llama3", "model.rope_scaling_factor=8.0",
        "model.rope_original_max_seq_len=16", "moe.every_n_layers=2",
        "model.partial_rotary_factor=0.5", "model.attention_sinks=true",
        "model.sliding_window=5", "model.sliding_window_layers=[0,2]", "moe.router_bias=true",
        "moe.expert_ffn_bias=true", "moe.expert_activation=clamped_swiglu",
        "moe.swiglu_limit=0.5", "moe.swiglu_alpha=1.2",
        "moe.shared_expert_gate=true", "moe.renormalize=false", "moe.expert_bias_rate=0.0"],
        None),
}  # fmt: skip


def _train(out: Path, name: str) -> None:
    from moetrain.train.trainer import Trainer

    overrides, _ = CASES[name]
    # A wide init: logits far from uniform, so greedy continuations vary from token to token.
    common = ["train.steps=1", "train.checkpoint_every=1", "model.init_std=0.3"]
    if name == "tiny.yaml":
        from moetrain.config import load_config

        cfg = load_config(REPO / "configs" / "tiny.yaml",
                          [f"train.output_dir={out}", *common, *overrides])  # fmt: skip
    else:
        cfg = micro_config(out, *common, *overrides)
    Trainer(cfg).fit()


def _reference(run: Path):
    """moetrain's model of the checkpoint, routed dropless as inference routes."""
    info = checkpoint_info(run)
    info.moe.capacity_factor = info.moe.token_group_seqs = None
    return load_model(info).eval()


def _tokens(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(seed))


SLOW_CASES = list(CASES)[2:]
"""The two option-heavy cases run under -m slow (about a minute each on two cores)."""


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_CASES else []) for n in CASES]
)
def test_export_loads_in_transformers_with_moetrains_logits(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    _train(tmp_path / "run", name)
    exported = export_hf(tmp_path / "run", tmp_path / "hf", family=CASES[name][1])
    assert exported.family.model_type == "moetrain"
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert {"modeling_moetrain.py", "configuration_moetrain.py", "config.json"} <= set(files)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_moetrain.MoetrainForCausalLM"

    ours = _reference(tmp_path / "run")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    # Every tensor of the checkpoint is a tensor of the model (the MTP module's included).
    theirs = hf.state_dict()
    for mine, t in ours.state_dict().items():
        key = {"tok_embeddings.weight": "model.embed_tokens.weight",
               "output.weight": "lm_head.weight"}.get(mine, f"model.{mine}")  # fmt: skip
        assert torch.equal(theirs[key], t), mine
    tokens = _tokens()
    with torch.no_grad():
        err = (hf(tokens).logits - ours(tokens)).abs().max().item()
    print(f"{name}: max abs logit error {err:.2e}")
    assert err <= LOGIT_ATOL, err

    # Greedy generate with transformers' KV cache = moetrain's generate.
    prompt = tokens[0, :6].tolist()
    want = generate(ours, prompt, 10)
    with torch.no_grad():
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert got[0, len(prompt) :].tolist() == want
    assert len(set(want)) > 1


def test_the_error_is_caught(tmp_path: Path) -> None:
    """The logit comparison above can fail: the exported file run with one option flipped
    (the expert bias ignored at selection) leaves moetrain's logits."""
    from transformers import AutoModelForCausalLM

    _train(tmp_path / "run", "tiny.yaml")
    export_hf(tmp_path / "run", tmp_path / "hf")
    ours = _reference(tmp_path / "run")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    for layer in hf.model.layers:
        layer.ffn.router.e = {**layer.ffn.router.e, "route_with_bias": False}
    with torch.no_grad():
        err = (hf(_tokens()).logits - ours(_tokens())).abs().max().item()
    assert err > 1e-3, err


def test_pipeline_and_a_machine_without_moetrain(tmp_path: Path) -> None:
    """``pipeline("text-generation")`` continues a prompt as ``moetrain generate`` does; and
    the directory loads where moetrain cannot be imported at all."""
    from transformers import pipeline

    _train(tmp_path / "run", "tiny.yaml")
    export_hf(tmp_path / "run", tmp_path / "hf")
    gen = pipeline("text-generation", model=str(tmp_path / "hf"), trust_remote_code=True)
    out = gen("def main():", max_new_tokens=8, do_sample=False, return_tensors=True)
    tok = gen.tokenizer
    prompt = tok("def main():")["input_ids"]
    ours = _reference(tmp_path / "run")
    want = generate(ours, prompt, 8, eos_id=tok.eos_token_id)
    assert out[0]["generated_token_ids"][len(prompt) :] == want

    script = f"""
import importlib.abc, sys
class NoMoetrain(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "moetrain" or name.startswith("moetrain."):
            raise ImportError("moetrain is not installed here")
sys.meta_path.insert(0, NoMoetrain())
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r}, trust_remote_code=True)
tokens = torch.tensor([{prompt}])
torch.save(model(tokens).logits.detach(), {str(tmp_path / "logits.pt")!r})
assert not any(m == "moetrain" or m.startswith("moetrain.") for m in sys.modules)
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    with torch.no_grad():
        ref = ours(torch.tensor([prompt]))
    assert (torch.load(tmp_path / "logits.pt") - ref).abs().max() <= LOGIT_ATOL
    source = (tmp_path / "hf" / "modeling_moetrain.py").read_text()
    assert "import moetrain" not in source and "from moetrain" not in source


def test_import_of_the_export_round_trips(tmp_path: Path) -> None:
    """import-hf reads moetrain's own export back (the ``moetrain`` family): same weights."""
    _train(tmp_path / "run", "micro (shared expert, expert bias)")
    export_hf(tmp_path / "run", tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    a = load_model(checkpoint_info(tmp_path / "run")).state_dict()
    b = load_model(checkpoint_info(tmp_path / "back")).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_family_is_preferred_and_the_command_says_which(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _train(tmp_path / "mixtral-like", "micro (shared expert, expert bias)")
    assert main(["export-hf", str(tmp_path / "mixtral-like"), str(tmp_path / "a")]) == 0
    assert "as moetrain's own MoetrainForCausalLM" in capsys.readouterr().out
    from moetrain.train.trainer import Trainer

    cfg = micro_config(tmp_path / "plain", "train.steps=1", "moe.num_shared_experts=0",
                       "moe.expert_bias_rate=0.0")  # fmt: skip
    Trainer(cfg).fit()
    assert main(["export-hf", str(tmp_path / "plain"), str(tmp_path / "b")]) == 0
    assert "as mixtral (MixtralForCausalLM)" in capsys.readouterr().out


@pytest.fixture
def qwen2(tmp_path: Path):
    """A dense Qwen2 with non-zero q/k/v biases (transformers initialises them to zero)."""
    model = save_hf("qwen2", tmp_path / "qwen2")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.copy_(torch.randn(proj.bias.shape, generator=gen) * 0.3)
    model.save_pretrained(tmp_path / "qwen2")
    save_tokenizer(tmp_path / "qwen2")
    return model, tmp_path / "qwen2"


def test_upcycled_qwen2_at_step_0_exports_as_the_dense_model(qwen2, tmp_path: Path) -> None:
    """train.steps=0 writes the upcycled model directly; no family has attention biases
    without a shared expert, so it exports as moetrain's own, whose logits are the dense
    Qwen2's (whole copies, renormalised top-k)."""
    from transformers import AutoModelForCausalLM

    from moetrain.train.trainer import Trainer

    dense, hf_dir = qwen2
    cfg = micro_config(tmp_path / "up", f"model.upcycle_from={hf_dir}", "train.steps=0",
                       "moe.num_experts=4", "moe.top_k=2", "moe.renormalize=true",
                       "moe.num_shared_experts=0", "model.upcycle_router_std=0.5",
                       "moe.expert_bias_rate=0.0")  # fmt: skip
    Trainer(cfg).fit()
    info = checkpoint_info(tmp_path / "up")
    assert info.step == 0
    exported = export_hf(tmp_path / "up", tmp_path / "hf")
    assert exported.family.model_type == "moetrain"
    why = exported.describe()
    assert "mixtral: attention biases" in why and "qwen2_moe: no gated shared expert" in why
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    tokens = _tokens()
    with torch.no_grad():
        err = (back(tokens).logits - dense(tokens).logits).abs().max().item()
    assert err <= LOGIT_ATOL, err
    # A later run resumes from the step-0 checkpoint with its own schedule.
    cfg = micro_config(tmp_path / "up", f"model.upcycle_from={hf_dir}", "train.steps=1",
                       "moe.num_experts=4", "moe.top_k=2", "moe.renormalize=true",
                       "moe.num_shared_experts=0", "model.upcycle_router_std=0.5",
                       "moe.expert_bias_rate=0.0")  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    assert trainer.step == 1
