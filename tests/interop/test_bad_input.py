"""Bad Hugging Face input is one clear error, raised before any process group starts and
before anything is written: a directory without config.json, an unsupported model_type, a
missing or truncated safetensors shard, a tensor whose shape disagrees with config.json, a
tokenizer whose ids do not fit the vocabulary, a tensor the model would not use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from hf_zoo import save_hf, save_tokenizer
from multirank import micro_config

from moetrain.cli import main
from moetrain.config import ConfigError
from moetrain.interop import HFCheckpointError
from moetrain.train.trainer import Trainer


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE directory in several shards with an index."""
    path = tmp_path_factory.mktemp("hf") / "qwen3"
    save_hf("qwen3_moe", path).save_pretrained(path, max_shard_size="200KB")
    save_tokenizer(path)
    assert len(list(path.glob("model-*.safetensors"))) > 2
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        os.link(f, dst / f.name) if f.suffix == ".safetensors" else (dst / f.name).write_bytes(
            f.read_bytes()
        )
    return dst


def _refused(hf_dir: Path, out: Path, match: str, *extra: str) -> None:
    """Trainer and CLI both refuse, naming the problem; no process group, nothing written."""
    with pytest.raises(ConfigError, match=match) as info:
        Trainer(micro_config(out, f"model.init_from={hf_dir}", *extra))
    assert isinstance(info.value, HFCheckpointError) or "model.init_from" in str(info.value)
    assert not dist.is_initialized()
    assert not out.exists() or not any(out.iterdir())


def test_directory_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    _refused(tmp_path / "hf", tmp_path / "run", r"model.init_from: .* has no config.json")


def test_unsupported_model_type(tmp_path: Path, sharded: Path) -> None:
    hf = _copy(sharded, tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    _refused(hf, tmp_path / "run", r"model_type 'gpt2' is not supported; supported: mixtral")


def test_missing_shard(tmp_path: Path, sharded: Path) -> None:
    hf = _copy(sharded, tmp_path / "hf")
    victim = sorted(hf.glob("model-*.safetensors"))[1]
    victim.unlink()
    _refused(hf, tmp_path / "run", rf"{victim.name}: missing safetensors shard")


def test_truncated_shard(tmp_path: Path, sharded: Path) -> None:
    hf = _copy(sharded, tmp_path / "hf")
    victim = sorted(hf.glob("model-*.safetensors"))[-1]
    data = victim.read_bytes()
    victim.unlink()  # a hard link: write a new file, the fixture's stays whole
    victim.write_bytes(data[: len(data) - 100])
    _refused(hf, tmp_path / "run", rf"{victim.name}: truncated safetensors file")


def test_shape_disagreeing_with_config(tmp_path: Path, sharded: Path) -> None:
    hf = _copy(sharded, tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 48}))
    _refused(hf, tmp_path / "run", r"tensor model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight "
             r"has shape \[32, 64\] .* but config.json implies \[48, 64\]")  # fmt: skip


def test_vocabulary_the_tokenizer_does_not_fit(tmp_path: Path, sharded: Path) -> None:
    hf = _copy(sharded, tmp_path / "hf")
    (hf / "tokenizer.json").unlink()  # falls back to data.tokenizer (the default, 4096 ids)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    _refused(hf, tmp_path / "run", r"data.tokenizer 'default' has token ids up to 4095, but "
             r"the model's vocabulary has 1000 entries")  # fmt: skip


def test_command_line_reports_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "hf").mkdir()
    code = main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "has no config.json" in err
    (tmp_path / "run.yaml").write_text("train:\n  steps: 1\n")
    code = main(["--config", str(tmp_path / "run.yaml"), f"model.init_from={tmp_path / 'hf'}",
                 f"train.output_dir={tmp_path / 'run'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "config error: model.init_from:" in err and "no config.json" in err


def _add_shard(hf: Path, tensors: dict) -> None:
    """One more shard holding ``tensors``, listed in the index (as a fine-tuning tool that
    saves an adapter beside the weights could leave it)."""
    from safetensors.torch import save_file

    save_file(tensors, str(hf / "model-extra.safetensors"), metadata={"format": "pt"})
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "model-extra.safetensors"))
    (hf / "model.safetensors.index.json").unlink()  # a copy: the fixture's stays as it was
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


UNUSED = r"model.init_from: 2 tensor\(s\) of .* would not be used: model.layers.0.mlp.extra_"


def test_init_from_refuses_unused_tensors(
    tmp_path: Path, sharded: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tensor of the checkpoint that the model would not use refuses ``model.init_from``
    before any process group, naming it; ``model.allow_unused_tensors`` accepts the loss and
    the log names what was dropped."""
    import torch

    hf = _copy(sharded, tmp_path / "hf")
    _add_shard(hf, {"model.layers.0.mlp.extra_adapter.weight": torch.ones(8, 64),
                    "model.layers.5.self_attn.q_proj.weight": torch.ones(128, 64)})  # fmt: skip
    why = r".*layer 5, beyond config.json's num_hidden_layers=3.*"
    _refused(hf, tmp_path / "run", UNUSED + why + "model.allow_unused_tensors=true")
    with caplog.at_level("INFO", logger="moetrain"):
        trainer = Trainer(micro_config(tmp_path / "run", f"model.init_from={hf}",
                                       "model.allow_unused_tensors=true"))  # fmt: skip
    trainer.close()
    assert "82 tensors: 80 read" in caplog.text and "2 unused (model.layers.0.mlp" in caplog.text


def test_upcycle_from_refuses_unused_tensors(tmp_path: Path) -> None:
    from hf_zoo import save_hf
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_hf("llama", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["lm_head.lora_B.weight"] = tensors["lm_head.weight"][:, :4].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    upcycle = ["moe.num_experts=4", "moe.top_k=2", "moe.num_shared_experts=0"]
    with pytest.raises(ConfigError, match=r"model.upcycle_from: 1 tensor\(s\) .* "
                       r"lm_head.lora_B.weight \(not a tensor of the llama model"):  # fmt: skip
        Trainer(micro_config(tmp_path / "run", f"model.upcycle_from={tmp_path / 'hf'}", *upcycle))
    assert not (tmp_path / "run").exists() and not dist.is_initialized()
    Trainer(micro_config(tmp_path / "run", f"model.upcycle_from={tmp_path / 'hf'}", *upcycle,
                         "model.allow_unused_tensors=true")).close()  # fmt: skip


def test_allow_unused_tensors_needs_a_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.allow_unused_tensors: applies to "
                       "model.init_from and model.upcycle_from, and neither is set"):  # fmt: skip
        Trainer(micro_config(tmp_path / "run", "model.allow_unused_tensors=true"))


def test_command_line_refuses_unused_tensors(
    tmp_path: Path, sharded: Path, capsys: pytest.CaptureFixture
) -> None:
    """Through the command line: exit status 2, one line, the run directory untouched."""
    import torch

    hf = _copy(sharded, tmp_path / "hf")
    _add_shard(hf, {"model.layers.9.mlp.gate.weight": torch.ones(8, 64)})
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    (tmp_path / "run.yaml").write_text("train:\n  steps: 1\ndata:\n  seq_len: 32\n")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    code = main(["--config", str(tmp_path / "run.yaml"), f"model.init_from={hf}",
                 f"train.output_dir={run}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "config error: model.init_from: 1 tensor(s)" in err and "layer 9, beyond" in err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
