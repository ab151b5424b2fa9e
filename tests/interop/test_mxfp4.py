"""gpt-oss's MXFP4 expert weights, dequantized on import.

The dequantization is checked against transformers' own conversion
(``transformers.integrations.mxfp4.convert_moe_packed_tensors``) on random packed tensors,
bit for bit, in bf16 and fp32; a directory whose experts are packed (``*_blocks`` /
``*_scales``, ``quantization_config``) imports as the model with the dequantized weights
(transformers' logits on them), reads any slice of them as the whole tensor cut, and
exports dequantized to a directory transformers loads. A wrong code table is caught.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_zoo import VOCAB, build_hf, save_tokenizer
from safetensors.torch import load_file, save_file

from moetrain.cli import main
from moetrain.interop import from_hf
from moetrain.interop.hf_files import HFDirectory
from moetrain.interop.mxfp4 import dequantize_mxfp4
from moetrain.interop.sources import Mxfp4Experts

LOGIT_ATOL = 1e-5  # fp32, as tests/interop/test_families.py


def _packed(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (..., G, 16) and exponents (..., G) from 2^-9 to 2^-4 (bias 127): weights
    of the tiny model's scale, logits O(1) as the tolerance assumes."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 124, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantization_is_transformers_conversion(dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _packed((3, 10, 4), seed=0)
    # The whole exponent range too (2^-127 .. 2^128: zeros, subnormals and infinities alike).
    scales[0, 0] = torch.arange(0, 256, 64, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, in, out)
    got = dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)


def _quantize_experts(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """A copy of the gpt-oss directory ``src`` whose experts are random MXFP4 tensors (as the
    published checkpoints store them); returns the dequantized weights transformers would
    load (``convert_moe_packed_tensors``, bf16), by name."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    plain = {}
    for i, name in enumerate(sorted(k for k in tensors if k.endswith(("gate_up_proj",
                                                                       "down_proj")))):  # fmt: skip
        E, n_in, n_out = tensors.pop(name).shape
        blocks, scales = _packed((E, n_out, n_in // 32), seed=10 + i)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return plain


@pytest.fixture
def mxfp4_dir(tmp_path: Path):
    """(the packed directory, transformers' model with the dequantized experts)."""
    hf_model = build_hf("gpt_oss")
    hf_model.save_pretrained(tmp_path / "plain")
    plain = _quantize_experts(tmp_path / "plain", tmp_path / "mxfp4")
    save_tokenizer(tmp_path / "mxfp4")
    with torch.no_grad():
        state = hf_model.state_dict()
        for name, w in plain.items():
            state[name].copy_(w.float())
    return tmp_path / "mxfp4", hf_model


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))


def test_a_packed_checkpoint_imports_as_its_dequantized_model(mxfp4_dir, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path, hf_model = mxfp4_dir
    tokens = _tokens()
    with torch.no_grad():
        want = hf_model(tokens).logits
        err = (from_hf(path)(tokens) - want).abs().max().item()
    assert err <= LOGIT_ATOL, err
    # Any slice of a packed tensor reads as the whole tensor cut there (blocks of 32 inputs,
    # interleaved gate / up columns): what each rank reads under a layout.
    hf = HFDirectory(path)
    src = Mxfp4Experts("model.layers.1.mlp.experts.gate_up_proj", (8, 64, 32), 1)
    whole = src.read(hf, (slice(0, 8), slice(0, 64), slice(0, 32)))
    part = src.read(hf, (slice(3, 5), slice(7, 45), slice(5, 19)))
    assert torch.equal(part, whole[3:5, 7:45, 5:19])
    # Import, then export: written dequantized, a directory transformers loads as it is.
    assert main(["import-hf", str(path), str(tmp_path / "mt")]) == 0
    assert main(["export-hf", str(tmp_path / "mt"), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(tokens).logits - want).abs().max().item() <= LOGIT_ATOL


def test_a_wrong_code_table_is_caught(mxfp4_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nibbles read in the other order: the logits leave transformers'."""
    import moetrain.interop.mxfp4 as mx

    path, hf_model = mxfp4_dir
    swapped = mx.FP4_VALUES[8:] + mx.FP4_VALUES[:8]  # the sign bit read as the top code bit
    monkeypatch.setattr(mx, "FP4_VALUES", swapped)
    tokens = _tokens()
    with torch.no_grad():
        err = (from_hf(path)(tokens) - hf_model(tokens).logits).abs().max().item()
    assert err > 10 * LOGIT_ATOL, err
