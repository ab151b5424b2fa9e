"""import-hf and export-hf never overwrite, mix or touch what they read.

Each case records the file listings (and contents) of every directory involved before the
command and compares them after: a refusal is one line on stderr with exit status 2 and
changes nothing; ``--force`` replaces a directory whole (no old file survives beside the new
ones); the source directory, the run directory and a trained run are never written, even
with ``--force``; an error in the middle of writing leaves the target as it was and no
half-written directory behind.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from hf_zoo import VOCAB, save_hf, save_tokenizer
from multirank import micro_config

from moetrain.cli import main


def snapshot(*roots: Path) -> dict[str, str]:
    """Every file under ``roots`` (relative path -> sha256), directories included as names."""
    out: dict[str, str] = {}
    for root in roots:
        if not root.exists():
            out[str(root)] = "absent"
            continue
        if root.is_file():
            out[str(root)] = hashlib.sha256(root.read_bytes()).hexdigest()
            continue
        for p in sorted(root.rglob("*")):
            key = str(p)
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def leftovers(parent: Path) -> list[str]:
    """Temporary or moved-aside directories the commands left in ``parent``."""
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def refused(capsys: pytest.CaptureFixture, argv: list[str], match: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert match in err, err


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF source directory, the moetrain run import-hf made of it)."""
    root = tmp_path_factory.mktemp("imported")
    save_hf("qwen3_moe", root / "src")
    save_tokenizer(root / "src")
    assert main(["import-hf", str(root / "src"), str(root / "run")]) == 0
    return root / "src", root / "run"


def test_export_into_a_non_empty_directory_is_refused_then_replaced_with_force(
    imported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _, run = imported
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("an old tokenizer")
    (out / "notes.txt").write_text("keep me")
    before = snapshot(out, run)
    refused(capsys, ["export-hf", str(run), str(out)], "is not empty (notes.txt, tokenizer.json)")
    assert snapshot(out, run) == before
    # --force: the directory is replaced whole; nothing old survives beside the new files.
    assert main(["export-hf", str(run), str(out), "--force"]) == 0
    fresh = tmp_path / "fresh"
    assert main(["export-hf", str(run), str(fresh)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())
    assert (out / "tokenizer.json").read_text() == (fresh / "tokenizer.json").read_text()
    assert snapshot(run) == {k: v for k, v in before.items() if k.startswith(str(run))}
    assert leftovers(tmp_path) == []


def test_an_empty_directory_is_a_fine_target(imported: tuple[Path, Path], tmp_path: Path) -> None:
    _, run = imported
    (tmp_path / "out").mkdir()
    assert main(["export-hf", str(run), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()


def test_sharded_export_over_a_single_file_one_is_never_mixed(
    imported: tuple[Path, Path], tmp_path: Path
) -> None:
    """The mixed directory of the report: transformers read the old model.safetensors beside
    the new index. With --force nothing of the first export survives, both ways round."""
    from transformers import AutoModelForCausalLM

    from moetrain.interop import from_hf
    from moetrain.interop.checkpoints import checkpoint_info, load_model

    _, run = imported
    out = tmp_path / "out"
    ours = load_model(checkpoint_info(run)).eval()
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    for shard in ("5", "0.0001", "5"):  # single file -> shards -> single file
        assert main(["export-hf", str(run), str(out), "--force", "--max-shard-gb", shard]) == 0
        names = {p.name for p in out.iterdir()}
        sharded = any(n.startswith("model-0") for n in names)
        assert sharded == (shard != "5"), names
        assert ("model.safetensors" in names) != sharded, names
        assert ("model.safetensors.index.json" in names) == sharded, names
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            ref = ours(tokens)
            assert (hf(tokens).logits - ref).abs().max() < 1e-5
            assert (from_hf(out)(tokens) - ref).abs().max() < 1e-5
    assert leftovers(tmp_path) == []


def test_export_never_writes_its_sources(
    imported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The run's own source directory, the run itself, its checkpoints, a directory holding
    the run: refused even with --force, nothing written."""
    src, run = imported
    before = snapshot(src, run)
    cases = [
        (src, "the directory it was imported from"),
        (run, "its run directory"),
        (run / "checkpoints", "its checkpoint root"),
        (run / "checkpoints" / "step_00000000", "the checkpoint"),
        (run.parent, "its run directory"),
    ]
    for target, what in cases:
        for force in ([], ["--force"]):
            refused(capsys, ["export-hf", str(run), str(target), *force], f"overlaps {what}")
    assert snapshot(src, run) == before
    assert leftovers(run.parent) == []


def test_export_onto_a_file_is_refused(
    imported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _, run = imported
    victim = tmp_path / "some_file"
    victim.write_text("precious")
    for force in ([], ["--force"]):
        refused(capsys, ["export-hf", str(run), str(victim), *force], "is not a directory")
    assert victim.read_text() == "precious"
    assert leftovers(tmp_path) == []


def test_export_onto_another_run_is_refused(
    imported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _, run = imported
    other = tmp_path / "other"
    assert main(["import-hf", str(imported[0]), str(other)]) == 0
    before = snapshot(other)
    refused(capsys, ["export-hf", str(run), str(other), "--force"], "is a moetrain run")
    assert snapshot(other) == before


def test_a_crash_while_writing_leaves_the_target_as_it_was(
    imported: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moetrain.interop import convert

    _, run = imported
    out = tmp_path / "out"
    assert main(["export-hf", str(run), str(out)]) == 0
    before = snapshot(out)
    real = convert.write_safetensors

    def crash(tensors, out_dir, max_shard_bytes):
        real(tensors, out_dir, 1)  # every tensor written, one shard each...
        raise RuntimeError("disk unplugged")  # ...then the process dies

    monkeypatch.setattr(convert, "write_safetensors", crash)
    with pytest.raises(RuntimeError, match="disk unplugged"):
        convert.export_hf(run, out, force=True)
    with pytest.raises(RuntimeError, match="disk unplugged"):
        convert.export_hf(run, tmp_path / "new")
    assert snapshot(out) == before
    assert not (tmp_path / "new").exists()
    assert leftovers(tmp_path) == []


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run moetrain trained (one step, one checkpoint)."""
    from moetrain.train.trainer import Trainer

    out = tmp_path_factory.mktemp("trained") / "run"
    Trainer(micro_config(out, "train.steps=1", "train.checkpoint_every=1")).fit()
    return out


def test_import_onto_a_trained_run_is_refused(
    imported: tuple[Path, Path], trained: Path, capsys: pytest.CaptureFixture
) -> None:
    """The report: import-hf rewrote the run's config.yaml and pointed checkpoints/latest
    at the imported step 0. Now: refused, with or without --force, nothing changed."""
    src, _ = imported
    (trained / "config.yaml").write_text("# the run's own config\n")
    before = snapshot(trained, src)
    latest = (trained / "checkpoints" / "latest").read_text()
    for force in ([], ["--force"]):
        refused(capsys, ["import-hf", str(src), str(trained), *force], "is a moetrain run")
    assert snapshot(trained, src) == before
    assert (trained / "checkpoints" / "latest").read_text() == latest == "step_00000001\n"
    assert leftovers(trained.parent) == []


def test_import_refuses_a_non_empty_directory_and_its_source(
    imported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    src, _ = imported
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.txt").write_text("mine")
    before = snapshot(out, src)
    refused(capsys, ["import-hf", str(src), str(out)], "is not empty (data.txt)")
    for target in (src, src / "sub", src.parent):
        for force in ([], ["--force"]):
            refused(capsys, ["import-hf", str(src), str(target), *force], "overlaps HF_DIR")
    assert snapshot(out, src) == before
    assert not (src / "sub").exists()


def test_import_with_force_replaces_a_previous_import_whole(
    imported: tuple[Path, Path], tmp_path: Path
) -> None:
    src, _ = imported
    out = tmp_path / "out"
    assert main(["import-hf", str(src), str(out)]) == 0
    (out / "stale.txt").write_text("from before")
    assert main(["import-hf", str(src), str(out), "--force"]) == 0
    assert not (out / "stale.txt").exists()
    latest = (out / "checkpoints" / "latest").read_text()
    assert latest == "step_00000000\n"
    assert "import-hf" in (out / "config.yaml").read_text()
    assert leftovers(tmp_path) == []
