"""Multi-token-prediction layers of DeepSeek-V3 and GLM-4.5 checkpoints: read on import and
by ``model.init_from``, written back on export (transformers drops them on load; moetrain
keeps them).

The released checkpoints hold their MTP module as one extra layer after the main ones
(``model.layers.{num_hidden_layers}``: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, copies of the embedding and the head, and a decoder block).
transformers' own ``save_pretrained`` writes no such layer, so the tests add one: the block
of a transformers model one layer deeper, and random norms and projection.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_zoo import CONFIGS, VOCAB, build_hf, save_tokenizer
from safetensors import safe_open
from safetensors.torch import save_file

from moetrain.cli import main
from moetrain.interop.checkpoints import checkpoint_info, load_model

LOGIT_ATOL = 1e-5


def save_with_mtp(model_type: str, path: Path) -> dict[str, torch.Tensor]:
    """A tiny ``model_type`` directory whose checkpoint carries one MTP layer, as released
    checkpoints do; returns that layer's tensors."""
    import transformers

    model = build_hf(model_type)
    model.save_pretrained(path)
    save_tokenizer(path)
    L = model.config.num_hidden_layers
    cls_name, kwargs = CONFIGS[model_type]
    deeper_cfg = getattr(transformers, cls_name)(**{**kwargs, "num_hidden_layers": L + 1})
    torch.manual_seed(1)
    deeper = type(model)(deeper_cfg)
    deeper.save_pretrained(path / "deeper")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    mtp: dict[str, torch.Tensor] = {}
    with safe_open(str(path / "deeper" / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if k.startswith(f"model.layers.{L}."):
                mtp[k] = f.get_tensor(k)
    gen = torch.Generator().manual_seed(5)
    D = model.config.hidden_size
    p = f"model.layers.{L}"
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{p}.{name}.weight"] = 1 + 0.1 * torch.randn(D, generator=gen)
    mtp[f"{p}.eh_proj.weight"] = 0.05 * torch.randn(D, 2 * D, generator=gen)
    mtp[f"{p}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[f"{p}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    for f in (path / "deeper").iterdir():
        f.unlink()
    (path / "deeper").rmdir()
    return mtp


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_mtp_layer_imports_and_exports(model_type: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    mtp = save_with_mtp(model_type, tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "mt")]) == 0
    info = checkpoint_info(tmp_path / "mt")
    assert info.model.mtp_depth == 1
    L = info.model.n_layers
    ours = load_model(info).state_dict()
    assert torch.equal(ours[f"layers.{L}.eh_proj.weight"], mtp[f"model.layers.{L}.eh_proj.weight"])
    assert torch.equal(ours[f"layers.{L}.head_norm.weight"],
                       mtp[f"model.layers.{L}.shared_head.norm.weight"])  # fmt: skip
    assert torch.equal(ours[f"layers.{L}.attention_norm.weight"],
                       mtp[f"model.layers.{L}.input_layernorm.weight"])  # fmt: skip

    assert main(["export-hf", str(tmp_path / "mt"), str(tmp_path / "out")]) == 0
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    )
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        back = {k: f.get_tensor(k) for k in f.keys() if k.startswith(f"model.layers.{L}.")}
    assert back.keys() == mtp.keys()
    for k, t in mtp.items():
        assert torch.equal(back[k], t), k
    # transformers loads the export (dropping the extra layer) with the source's logits.
    src = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (src(tokens).logits - out(tokens).logits).abs().max() <= LOGIT_ATOL


def test_init_from_trains_the_mtp_layer(tmp_path: Path) -> None:
    from multirank import micro_config

    from moetrain.train.trainer import Trainer

    mtp = save_with_mtp("deepseek_v3", tmp_path / "hf")
    cfg = micro_config(tmp_path / "run", f"model.init_from={tmp_path / 'hf'}", "train.steps=1",
                       "moe.capacity_factor=null", "data.seq_len=32")  # fmt: skip
    trainer = Trainer(cfg)
    assert trainer.cfg.model.mtp_depth == 1
    model = trainer.engine.parts[0]
    L = trainer.cfg.model.n_layers
    loaded = model.layers[str(L)].eh_proj.weight.detach().clone()
    assert torch.equal(loaded, mtp[f"model.layers.{L}.eh_proj.weight"])
    res = trainer.train_step()
    assert res.mtp_loss > 0
    assert not torch.equal(model.layers[str(L)].eh_proj.weight, loaded)  # it trains
    trainer.close()


def test_a_checkpoint_without_the_layer_imports_without_mtp(tmp_path: Path) -> None:
    """transformers' own save of GLM-4.5 declares num_nextn_predict_layers=1 but holds no
    such layer: the import has no MTP rather than failing."""
    model = build_hf("glm4_moe")
    model.save_pretrained(tmp_path / "hf")
    assert model.config.num_nextn_predict_layers >= 1
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "mt")]) == 0
    assert checkpoint_info(tmp_path / "mt").model.mtp_depth == 0
