"""Round-trip defaults: what a user gets without asking for it.

- a bf16 checkpoint imports and exports as bf16 (bit for bit), config.json says so;
- bos / pad / eos token ids and initializer_range survive import -> export;
- the config.yaml that import-hf writes says how to train from it, and training from it
  works (and training into the import directory itself is refused in one line);
- ``--print-config`` with ``model.init_from`` shows the checkpoint's architecture;
- upcycling with ``moe.renormalize=false`` warns that step 0 is not the dense model;
- ``generate --max-new-tokens`` beyond the context says where it stopped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from hf_zoo import build_hf, save_hf, save_tokenizer
from multirank import micro_config

from moetrain.cli import main


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("bf16") / "mixtral"
    model = build_hf("mixtral").to(torch.bfloat16)
    model.config.initializer_range = 0.037
    model.save_pretrained(path)
    save_tokenizer(path)
    return path, model


def test_bf16_stays_bf16_and_the_config_keys_travel(bf16_dir, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    src, _ = bf16_dir
    assert main(["import-hf", str(src), str(tmp_path / "mt")]) == 0
    assert main(["export-hf", str(tmp_path / "mt"), str(tmp_path / "out")]) == 0
    before = json.loads((src / "config.json").read_text())
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    assert after["dtype"] == "bfloat16"
    for key in ("bos_token_id", "pad_token_id", "eos_token_id", "initializer_range"):
        assert after[key] == before[key], key
    assert after["initializer_range"] == 0.037
    with (
        safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f,
        safe_open(str(src / "model.safetensors"), "pt") as ref,
    ):
        assert set(f.keys()) == set(ref.keys())
        for name in f.keys():
            t = f.get_tensor(name)
            assert t.dtype == torch.bfloat16, name
            assert torch.equal(t, ref.get_tensor(name)), name
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == torch.bfloat16
    # --dtype still casts.
    assert main(["export-hf", str(tmp_path / "mt"), str(tmp_path / "f32"), "--dtype", "fp32"]) == 0
    assert json.loads((tmp_path / "f32" / "config.json").read_text())["dtype"] == "float32"


def test_the_import_config_yaml_trains(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    save_hf("qwen3_moe", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    out = tmp_path / "imported"
    assert main(["import-hf", str(tmp_path / "hf"), str(out)]) == 0
    text = (out / "config.yaml").read_text()
    assert f"moetrain --config {out / 'config.yaml'}" in text  # the header says how
    tree = yaml.safe_load(text)
    assert tree["model"]["init_from"] == str((tmp_path / "hf").resolve())
    train_dir = Path(tree["train"]["output_dir"])
    assert train_dir == tmp_path / "imported-train"
    small = ["train.steps=1", "train.global_batch_size=2", "train.micro_batch_size=2",
             "data.seq_len=16", "train.eval_batches=1", "log.tensorboard=false"]  # fmt: skip
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(["--config", str(out / "config.yaml"), *small]) == 0
    assert (train_dir / "checkpoints" / "step_00000001").is_dir()
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    # Training into the import directory itself: one line, no DCP traceback.
    capsys.readouterr()
    assert main(["--config", str(out / "config.yaml"), *small, f"train.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds only the weights that moetrain import-hf read" in err


def test_print_config_shows_the_checkpoints_architecture(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    hf = save_hf("qwen3_moe", tmp_path / "hf").config
    empty = tmp_path / "empty.yaml"  # the built-in defaults (training needs a --config)
    empty.write_text("{}\n")
    show = ["--config", str(empty), "--print-config", "data.seq_len=32"]
    assert main([*show, f"model.init_from={tmp_path / 'hf'}"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["dim"] == hf.hidden_size
    assert cfg["model"]["head_dim"] == hf.head_dim
    assert cfg["model"]["qk_norm"] == "head"
    assert cfg["moe"]["num_experts"] == hf.num_experts
    assert cfg["moe"]["dense_layers"] == [1]
    # A directory that is not a checkpoint: the one-line refusal, as training gives.
    assert main([*show, f"model.init_from={tmp_path}"]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_upcycling_without_renormalisation_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from moetrain.train.trainer import Trainer

    save_hf("llama", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    base = [f"model.upcycle_from={tmp_path / 'hf'}", "moe.num_shared_experts=0",
            "moe.num_experts=4", "moe.top_k=2"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        Trainer(micro_config(tmp_path / "a", *base, "moe.renormalize=false"))
    assert "does not start as the dense model" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        Trainer(micro_config(tmp_path / "b", *base, "moe.renormalize=true"))
    assert "does not start as the dense model" not in caplog.text


def test_generate_beyond_the_context_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = build_hf("mixtral")  # 64 positions
    with torch.no_grad():
        model.lm_head.weight[0] = 0.0  # a zero logit: <|endoftext|> never wins
    model.save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    argv = ["generate", str(tmp_path), "--prompt", "def main():", "--max-new-tokens", "100",
            "--device", "cpu", "--show-ids"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "of --max-new-tokens 100 tokens" in captured.err
    assert "context of 64 positions" in captured.err
    assert main([*argv[:4], "--max-new-tokens", "5", "--device", "cpu"]) == 0
    assert capsys.readouterr().err == ""
