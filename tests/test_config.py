"""Config loading: every bad input fails before anything runs, with a message naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.cli import main as cli_main
from moetrain.config import ConfigError, JobConfig, load_config, parse_overrides

REPO = Path(__file__).resolve().parent.parent

BAD_OVERRIDES = [
    # (overrides, text the message must contain)
    (["moe.top_k=9"], "moe.top_k: must be in [1, moe.num_experts=8], got 9"),
    (["moe.top_k=0"], "moe.top_k: must be in [1, moe.num_experts=8], got 0"),
    (["moe.capacity_factor=0"], "moe.capacity_factor: must be a finite number > 0 or null"),
    (["moe.capacity_factor=-1.5"], "moe.capacity_factor: must be a finite number > 0"),
    (["moe.capacity_factor=.inf"], "moe.capacity_factor: must be a finite number > 0"),
    (["model.dim=100"], "model.dim: 100 is not divisible by model.n_heads=8"),
    (["model.n_kv_heads=3"], "model.n_kv_heads: 3 does not divide model.n_heads=8"),
    (["model.dim=24", "model.n_heads=8"], "model.dim: head dim 3 must be even for RoPE"),
    (["model.partial_rotary_factor=0.1"], "model.partial_rotary_factor: rotates 3 dims of each "
     "head; RoPE needs an even number > 0"),
    (["model.partial_rotary_factor=1.5"], "model.partial_rotary_factor: must be in (0, 1]"),
    (["model.mtp_depth=1", "model.sliding_window=8"],
     "model.sliding_window: is not supported with model.mtp_depth > 0"),
    (["model.attention=mla", "model.kv_lora_rank=16", "model.qk_nope_head_dim=16",
      "model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.partial_rotary_factor=0.5"],
     "model.partial_rotary_factor: applies to attention=gqa only"),
    (["data.seq_len=0"], "data.seq_len: must be > 0, got 0"),
    (["data.seq_len=-4"], "data.seq_len: must be > 0, got -4"),
    (["data.seq_len=512"], "data.seq_len: 512 exceeds model.max_seq_len=256"),
    (["moe.foo=1"], "moe.foo: unknown key; moe has num_experts, top_k"),
    (["modle.dim=4"], "modle: unknown key; top level has model, moe"),
    (["moe.top_k=two"], "moe.top_k: expected int, got 'two'"),
    (["moe.top_k=2.5"], "moe.top_k: expected int, got 2.5"),
    (["train.resume_allow_changes=[moe.topk]"],
     "train.resume_allow_changes: ['moe.topk'] are not config keys"),
    (["moe.renormalize=maybe"], "moe.renormalize: expected bool, got 'maybe'"),
    (["moe.score_func=relu"], "moe.score_func: expected 'softmax' | 'sigmoid', got 'relu'"),
    (["moe.drop_policy=random"], "moe.drop_policy: expected 'probs' | 'position'"),
    (["moe.kernels=cuda"], "moe.kernels: expected 'auto' | 'torch' | 'triton'"),
    (["moe.pad_to_capacity=true"], "moe.pad_to_capacity: needs moe.capacity_factor"),
    (["moe.jitter_eps=1.5"], "moe.jitter_eps: must be in [0, 1), got 1.5"),
    (["moe.num_experts=-1"], "moe.num_experts: must be >= 0, got -1"),
    (["moe.aux_loss_coef=-0.1"], "moe.aux_loss_coef: must be >= 0"),
    (["moe.expert_ffn_dim=0"], "moe.expert_ffn_dim: must be > 0, got 0"),
    (["moe.every_n_layers=0"], "moe.every_n_layers: must be > 0, got 0"),
    (
        ["moe.token_group_seqs=3"],
        "moe.token_group_seqs: 3 does not divide train.micro_batch_size=8",
    ),
    (
        ["train.global_batch_size=12"],
        "train.global_batch_size: 12 is not divisible by train.micro_batch_size=8",
    ),
    (["train.steps=-1"], "train.steps: must be >= 0, got -1"),
    (["train.device=tpu"], "train.device: expected 'auto' | 'cpu' | 'cuda', got 'tpu'"),
    (["optim.lr=0"], "optim.lr: must be > 0, got 0.0"),
    (["optim.beta2=1.0"], "optim.beta2: must be in [0, 1), got 1.0"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio: must be in [0, 1], got 2.0"),
    (["data.eval_fraction=0"], "data.eval_fraction: must be in (0, 1)"),
    (
        ["data.tokenizer=/no/such/tokenizer.json"],
        "data.tokenizer: '/no/such/tokenizer.json' does not exist",
    ),
    (["parallel.tp=0"], "parallel.tp: must be >= 1, got 0"),
    (["parallel.zero_stage=4"], "parallel.zero_stage: expected 0 | 1 | 2 | 3, got 4"),
    (["moe=3"], "moe: expected a mapping of keys, got 3"),
    (["noequals"], "'noequals': an override is written section.key=value"),
]


@pytest.mark.parametrize("overrides,message", BAD_OVERRIDES, ids=[o[0][0] for o in BAD_OVERRIDES])
def test_bad_override_names_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value), str(info.value)


def test_bad_yaml_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="--config: no such file"):
        load_config(missing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("moe: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(scalar)
    unsafe = tmp_path / "unsafe.yaml"
    unsafe.write_text("model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(unsafe)


def test_overrides_are_yaml_typed_and_merge_over_the_file(tmp_path: Path) -> None:
    assert parse_overrides(["moe.capacity_factor=null", "moe.top_k=1", "a.b.c=x"]) == {
        "moe": {"capacity_factor": None, "top_k": 1},
        "a": {"b": {"c": "x"}},
    }
    path = tmp_path / "c.yaml"
    path.write_text("moe:\n  top_k: 1\n  num_experts: 4\ntrain:\n  steps: 7\n")
    cfg = load_config(path, ["moe.num_experts=6", "optim.lr=1e-3"])
    assert (cfg.moe.top_k, cfg.moe.num_experts, cfg.train.steps) == (1, 6, 7)
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert isinstance(load_config(None, ["optim.grad_clip=2"]).optim.grad_clip, float)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    assert isinstance(load_config(path), JobConfig)


def test_config_docs_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_cli_reports_config_errors_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["train", "--config", str(REPO / "configs" / "tiny.yaml"), "moe.top_k=99"]) == 2
    assert "moe.top_k: must be in [1, moe.num_experts=8], got 99" in capsys.readouterr().err
    assert (
        cli_main(["--config", str(REPO / "configs" / "tiny.yaml"), "--print-config", "moe.top_k=1"])
        == 0
    )
    assert "top_k: 1" in capsys.readouterr().out


# ----------------------------------------------------------------------------- resume keys


def unclassified_keys(cfg: JobConfig) -> list[str]:
    """Config keys that ``RESUME_KEYS`` names neither exactly nor by their section."""
    from moetrain.config import flat_keys, resume_kind

    return [key for key in flat_keys(cfg) if resume_kind(key) is None]


def test_every_config_key_is_classified_for_resume() -> None:
    """A key added to a config section must say in ``RESUME_KEYS`` (moetrain/config/resume.py)
    whether a resume may change it: until then a resume treats it as changing the model's
    function (refused), and this test fails naming it."""
    missing = unclassified_keys(JobConfig())
    assert not missing, (
        f"{missing}: classify them in RESUME_KEYS (moetrain/config/resume.py): free (precision, "
        "logging, cadence, layout), saved (restored from the checkpoint) or function"
    )


def test_resume_classification_check_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key the table leaves out is reported by the test above, and a resume changing it is
    refused as function-changing (the default for a new key)."""
    from moetrain.config import resume as resume_module
    from moetrain.config import resume_changes

    table = dict(resume_module.RESUME_KEYS)
    del table["train.dtype"]
    monkeypatch.setattr(resume_module, "RESUME_KEYS", table)
    assert unclassified_keys(JobConfig()) == ["train.dtype"]
    saved = JobConfig().to_dict()
    now = load_config(None, ["train.dtype=bf16", "log.log_every=3", "moe.top_k=1"])
    kinds = {c.key: c.kind for c in resume_changes(saved, now)}
    assert kinds == {"train.dtype": "function", "log.log_every": "free", "moe.top_k": "function"}


def test_a_key_the_checkpoint_lacks_counts_with_its_default() -> None:
    """A checkpoint written before a key existed behaved as the key's default does."""
    from moetrain.config import resume_changes

    saved = JobConfig().to_dict()
    del saved["model"]["sliding_window"], saved["moe"]["group_score"]
    assert resume_changes(saved, JobConfig()) == []
    changed = resume_changes(saved, load_config(None, ["moe.group_score=max"]))
    assert [(c.key, c.saved, c.now) for c in changed] == [("moe.group_score", "top2", "max")]


def test_uneven_pipeline_stages_resume_freely() -> None:
    """``parallel.pp_stage_layers`` is layout (``parallel.*``): checkpoints hold the full
    model's names whatever the split, so a resume may change it, or find it in a checkpoint
    written before the key existed (tests/parallel/test_layouts.py resumes across splits)."""
    from moetrain.config import resume_changes

    pp2 = ["parallel.pp=2", "parallel.pp_schedule=1f1b"]
    saved = load_config(None, pp2).to_dict()
    del saved["parallel"]["pp_stage_layers"]
    assert resume_changes(saved, load_config(None, pp2)) == []
    changed = resume_changes(saved, load_config(None, [*pp2, "parallel.pp_stage_layers=[3,1]"]))
    assert [(c.key, c.saved, c.now, c.kind) for c in changed] == [
        ("parallel.pp_stage_layers", None, [3, 1], "free")
    ]
