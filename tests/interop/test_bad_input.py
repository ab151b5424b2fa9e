"""Bad Hugging Face input is one clear error, raised before any process group starts and
before anything is written: a directory without config.json, an unsupported model_type, a
missing or truncated safetensors shard, a tensor whose shape disagrees with config.json, a
tokenizer whose ids do not fit the vocabulary."""

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
