"""import-hf -> moetrain checkpoint -> export-hf loads in transformers with the same logits,
and moetrain generate gives transformers' greedy tokens, for every family."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hf_zoo import CONFIGS, VOCAB, save_hf, save_tokenizer

from moetrain.cli import main
from moetrain.interop.checkpoints import checkpoint_info, load_model

LOGIT_ATOL = 1e-5
"""fp32 max abs logit error (test_families.py states the same)."""


def _tokens(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_import_export_round_trip(model_type: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = save_hf(model_type, tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "mt")]) == 0
    assert main(["export-hf", str(tmp_path / "mt"), str(tmp_path / "out")]) == 0

    # The moetrain checkpoint itself holds the same model...
    info = checkpoint_info(tmp_path / "mt")
    ours = load_model(info).eval()
    # ...and what comes back out is the same transformers model.
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf_model)
    tokens = _tokens()
    with torch.no_grad():
        ref = hf_model(tokens).logits
        err_back = (back(tokens).logits - ref).abs().max().item()
        err_ours = (ours(tokens) - ref).abs().max().item()
    assert err_back <= LOGIT_ATOL and err_ours <= LOGIT_ATOL, (err_back, err_ours)
    # The YAML sections describe the architecture; the tokenizer travelled both ways.
    text = (tmp_path / "mt" / "config.yaml").read_text()
    assert f"n_layers: {hf_model.config.num_hidden_layers}" in text
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (
        tmp_path / "hf" / "tokenizer.json"
    ).read_text()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == model_type


def _generated_ids(out: str) -> tuple[list[int], list[int]]:
    prompt = json.loads(re.search(r"prompt ids: (\[.*\])", out).group(1))
    ids = json.loads(re.search(r"generated ids: (\[.*\])", out).group(1))
    return prompt, ids


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_greedy_generate_matches_transformers(
    model_type: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_model = save_hf(model_type, tmp_path)
    save_tokenizer(tmp_path)
    argv = ["generate", str(tmp_path), "--prompt", "def main():\n    return", "--show-ids",
            "--max-new-tokens", "12", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    prompt, ids = _generated_ids(capsys.readouterr().out)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    with torch.no_grad():
        hf_out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=eos,
            pad_token_id=eos,
        )  # fmt: skip
    print(f"{model_type}: prompt {prompt}, generated {ids}")
    assert ids == hf_out[0, len(prompt) :].tolist()
    assert len(set(ids)) > 2  # not a degenerate constant continuation


def test_generate_from_a_moetrain_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The same greedy tokens from the imported moetrain checkpoint as from the HF directory
    (the checkpoint path of ``moetrain generate``: its config, weights and tokenizer)."""
    save_hf("qwen3_moe", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "mt")]) == 0
    capsys.readouterr()
    outs = []
    for path in (tmp_path / "hf", tmp_path / "mt" / "checkpoints"):
        argv = ["generate", str(path), "--prompt", "The cat", "--show-ids", "--device", "cpu",
                "--max-new-tokens", "8"]  # fmt: skip
        assert main(argv) == 0
        outs.append(_generated_ids(capsys.readouterr().out))
    assert outs[0] == outs[1] and len(outs[0][1]) == 8
