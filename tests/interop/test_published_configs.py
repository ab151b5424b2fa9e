"""configs/ for the published sizes describe exactly the published models: their model and
moe sections are what the adapter reads from the published config.json, and the moetrain
model built from them on the meta device (nothing allocated) has transformers' parameter
count for that config.json."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from published_configs import PUBLISHED

from moetrain.config import load_config
from moetrain.interop.families import ARCH_MODEL_KEYS, ARCH_MOE_KEYS, family_of
from moetrain.model import Transformer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_config_is_the_published_model(name: str) -> None:
    import transformers

    hf_config = PUBLISHED[name]
    cfg = load_config(CONFIGS / name)
    model_keys, moe_keys = family_of(hf_config).to_moetrain(hf_config)
    assert {k: getattr(cfg.model, k) for k in ARCH_MODEL_KEYS} == model_keys
    assert {k: getattr(cfg.moe, k) for k in ARCH_MOE_KEYS} == moe_keys

    config_cls = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config_cls)
        ours = Transformer(cfg.model, cfg.moe)
    hf_params = sum(p.numel() for p in hf.parameters())
    assert all(p.is_meta for p in ours.parameters())
    n, active = ours.num_params() / 1e9, ours.num_params(active=True) / 1e9
    print(f"{name}: {n:.3f}B params ({active:.3f}B active), transformers {hf_params / 1e9:.3f}B")
    assert ours.num_params() == hf_params
