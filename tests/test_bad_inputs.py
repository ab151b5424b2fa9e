"""Bad input, end to end through the command line: each case exits with status 2 and one
message that names what is wrong, and leaves the run directory it was pointed at
byte-identical (no new file, no changed file, no TensorBoard event file). docs/long_runs.md
lists them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moetrain.cli import main as cli_main

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny.yaml")

MICRO = [
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.ffn_dim=64",
    "model.max_seq_len=32",
    "moe.num_experts=4",
    "moe.expert_ffn_dim=32",
    "moe.token_group_seqs=null",
    "data.seq_len=16",
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.eval_batches=1",
    "train.eval_every=0",
    "log.progress_bar=false",
]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli_main(args)
    return code, capsys.readouterr().err


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {
        p.relative_to(root).as_posix(): (None if p.is_dir() else p.read_bytes())
        for p in sorted(root.rglob("*"))
    }


def assert_untouched(before: dict[str, bytes | None], after: dict[str, bytes | None]) -> None:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    assert not (added or removed or changed), (
        f"a refused start touched the run directory: added {added}, removed {removed}, "
        f"changed {changed}"
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad_inputs")
    out = {}
    out["empty_txt"] = d / "empty.txt"
    out["empty_txt"].write_text("")
    out["ints_json"] = d / "ints.jsonl"
    out["ints_json"].write_text("\n".join(json.dumps({"text": i}) for i in range(50)))
    out["body_json"] = d / "body.jsonl"
    out["body_json"].write_text("\n".join(json.dumps({"body": f"doc {i}"}) for i in range(50)))
    out["corrupt_tok"] = d / "tokenizer.json"
    out["corrupt_tok"].write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    out["empty_dir"] = d / "empty_dir"
    out["empty_dir"].mkdir()
    out["bad_yaml"] = d / "bad.yaml"
    out["bad_yaml"].write_text("moe:\n  top_k: [1\n")
    out["typo_yaml"] = d / "typo.yaml"
    out["typo_yaml"].write_text("moe:\n  topk: 2\n")
    return out


# (id, extra CLI args given a files dict, text the message must contain)
CASES = [
    ("config-typo-key", lambda f: ["moe.topk=2"], "moe.topk: unknown key"),
    ("config-typo-in-file", lambda f: ["--config", str(f["typo_yaml"])], "moe.topk: unknown key"),
    ("config-bad-yaml", lambda f: ["--config", str(f["bad_yaml"])], "is not valid YAML"),
    ("config-missing-file", lambda f: ["--config", "/no/such.yaml"], "--config: no such file"),
    ("config-top-k", lambda f: ["moe.top_k=9"], "moe.top_k: must be in [1, moe.num_experts=8]"),
    ("config-capacity", lambda f: ["moe.capacity_factor=0"], "moe.capacity_factor: must be"),
    ("config-heads", lambda f: ["model.dim=100"], "model.dim: 100 is not divisible by"),
    ("config-kv-heads", lambda f: ["model.n_kv_heads=4"], "model.n_kv_heads: 4 does not divide"),
    ("config-seq-len", lambda f: ["data.seq_len=0"], "data.seq_len: must be > 0"),
    ("config-seq-too-long", lambda f: ["data.seq_len=4096"], "data.seq_len: 4096 exceeds"),
    ("config-type", lambda f: ["train.steps=ten"], "train.steps: expected int, got 'ten'"),
    ("config-choice", lambda f: ["moe.score_func=tanh"], "moe.score_func: expected"),
    (
        "config-batch",
        lambda f: ["train.global_batch_size=12"],
        "train.global_batch_size: 12 is not divisible",
    ),
    (
        "config-groups",
        lambda f: ["moe.token_group_seqs=3"],
        "moe.token_group_seqs: 3 does not divide",
    ),
    (
        "config-pad-dropless",
        lambda f: ["moe.capacity_factor=null", "moe.pad_to_capacity=true"],
        "moe.pad_to_capacity: needs moe.capacity_factor",
    ),
    (
        "config-device",
        lambda f: ["train.device=cuda"] if not _cuda() else ["train.device=tpu"],
        "train.device:",
    ),
    (
        "config-flex-on-cpu",
        lambda f: ["model.attention_backend=flex", "model.document_mask=true"]
        + ([] if not _cuda() else ["train.device=cpu"]),
        "model.attention_backend: flex trains on CUDA only",
    ),
    (
        "config-positions-without-mask",
        lambda f: ["model.document_positions=true"],
        "model.document_positions: needs model.document_mask=true",
    ),
    (
        "balanced-routing-outside-a-benchmark",
        lambda f: ["moe.force_load_balancing=true"],
        "moe.force_load_balancing: routes every token by its position",
    ),
    (
        "memory-cannot-fit",
        lambda f: ["train.memory_per_rank_gb=0.001"],
        "train.memory_check: rank 0 needs about",
    ),
    (
        "layout-world-size",
        lambda f: ["parallel.tp=2"],
        "config error: parallel.pp * parallel.dp_replicate * parallel.tp = 1 * 1 * 2 = 2 does "
        "not divide the world size 1",
    ),
    (
        "data-missing-path",
        lambda f: ["data.dataset=/no/such/corpus.txt"],
        "data.dataset: local path '/no/such/corpus.txt' does not exist",
    ),
    ("data-empty-file", lambda f: [f"data.dataset={f['empty_txt']}"], "data.dataset"),
    ("data-empty-dir", lambda f: [f"data.dataset={f['empty_dir']}"], "data.dataset"),
    ("data-missing-column", lambda f: [f"data.dataset={f['body_json']}"], "data.text_column: "),
    ("data-column-typo", lambda f: ["data.text_column=txt"], "data.text_column: "),
    ("data-not-text", lambda f: [f"data.dataset={f['ints_json']}"], "data.text_column"),
    ("data-hub-offline", lambda f: ["data.dataset=no-such-user/no-such-dataset"], "data.dataset"),
    ("data-bad-split", lambda f: ["data.split=nonexistent"], "data.split"),
    (
        "tokenizer-missing",
        lambda f: ["data.tokenizer=/no/such/tokenizer.json"],
        "data.tokenizer: '/no/such/tokenizer.json' does not exist",
    ),
    ("tokenizer-corrupt", lambda f: [f"data.tokenizer={f['corrupt_tok']}"], "data.tokenizer"),
]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding one good checkpoint of the micro model, its config.yaml and
    its TensorBoard events: what a refused start must leave as it is."""
    out = tmp_path_factory.mktemp("trained")
    assert cli_main(["--config", TINY, *MICRO, "train.steps=1", f"train.output_dir={out}"]) == 0
    assert list((out / "tb").glob("events.out.tfevents.*")), "the fixture run wrote no events"
    return out


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_error(
    case, files, trained: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, make_args, message = case
    args = make_args(files)
    base = [] if "--config" in args else ["--config", TINY]
    # Pointed at an existing run (as a typo in a restart command would be).
    run = _copy_run(trained, tmp_path / "run")
    before = snapshot(run)
    code, err = run_cli([*base, *args, f"train.output_dir={run}"], capsys)
    assert code == 2, err
    assert message in err, err
    assert err.count("\n") == 1, f"expected one line, got:\n{err}"
    assert_untouched(before, snapshot(run))


CKPT_CASES = [
    # (id, how to damage the copied run, extra overrides, text the message must contain;
    # {ckpt} stands for the checkpoint's path)
    (
        "ckpt-truncated",
        "truncate",
        [],
        "checkpoint {ckpt} is not usable: __0_0.distcp is 100 bytes but manifest.json records",
    ),
    ("ckpt-file-missing", "delete", [], "checkpoint {ckpt} is not usable: __0_0.distcp is missing"),
    (
        "ckpt-other-shape",
        None,
        ["moe.num_experts=8"],
        "checkpoint error: checkpoint {ckpt} was saved for a different model: "
        "num_experts: checkpoint has 4, this run has 8\n",
    ),
    (
        "ckpt-other-dim",
        None,
        ["model.dim=64"],
        "checkpoint error: checkpoint {ckpt} was saved for a different model: "
        "dim: checkpoint has 32, this run has 64\n",
    ),
    (
        "ckpt-other-data-seed",
        None,
        ["data.seed=7"],
        "config error: train.resume: {ckpt} was trained with other values of keys that change "
        "what the model computes or the data it reads: data.seed 0 -> 7 (checkpoint -> this "
        "run).",
    ),
    (
        "ckpt-other-routing",
        None,
        ["moe.top_k=1", "moe.score_func=sigmoid"],
        "moe.top_k 2 -> 1; moe.score_func 'softmax' -> 'sigmoid' (checkpoint -> this run). "
        "Resume with the checkpoint's values, start a new run in another train.output_dir, or "
        "accept the change with train.resume_allow_changes=[moe.top_k, moe.score_func]\n",
    ),
    (
        "ckpt-nothing-to-train",
        None,
        ["train.steps=1"],
        "config error: train.steps: 1, and the checkpoint {ckpt} is at step 1: nothing to "
        "train. Raise train.steps to train on, or give a new run its own train.output_dir\n",
    ),
    (
        "ckpt-auto-none-verifies",
        "auto-none-verifies",
        [],
        "checkpoint(s) in {root} but none verifies",
    ),
    (
        "ckpt-resume-never",
        "resume-never",
        [],
        "config error: train.resume: 'never' but {root} already holds checkpoints",
    ),
]


@pytest.mark.parametrize("case", CKPT_CASES, ids=[c[0] for c in CKPT_CASES])
def test_bad_checkpoint_is_one_clear_error(case, trained: Path, tmp_path: Path, capsys) -> None:
    _, damage, extra, message = case
    run = _copy_run(trained, tmp_path / "run")
    ckpt = run / "checkpoints" / "step_00000001"
    shard = next(ckpt.glob("*.distcp"))
    if damage in ("truncate", "auto-none-verifies"):
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "delete":
        shard.unlink()
    resume = {"auto-none-verifies": "auto", "resume-never": "never"}.get(damage, str(ckpt))
    before = snapshot(run)
    code, err = run_cli(
        [
            "--config",
            TINY,
            *MICRO,
            "train.steps=2",
            *extra,
            f"train.output_dir={run}",
            f"train.resume={resume}",
        ],
        capsys,
    )
    assert code == 2, err
    assert message.format(ckpt=ckpt, root=run / "checkpoints") in err, err
    assert err.count("\n") == 1, f"expected one line, got:\n{err}"
    # Nothing already saved is lost or changed, and nothing is added: config.yaml still
    # describes the saved model (the tools build the model from it), no new event file.
    assert_untouched(before, snapshot(run))
