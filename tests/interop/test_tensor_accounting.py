"""Every import accounts for every tensor of the checkpoint, and every export for every tensor
of the model (moetrain/interop/accounting.py).

A tensor is read into the model, verified equal to the tensor it duplicates (the head of
tied embeddings, the MTP layers' copies of the embedding and the head), ignored as a known
extra without weights (RoPE's ``inv_freq``), or unused: a layer beyond config.json's, a
module the family does not know, a copy that differs. An unused tensor refuses the import
(exit status 2, nothing written) unless ``--allow-unused`` / ``model.allow_unused_tensors``
accepts the loss; the summary names it either way. The checkpoints are tiny random models
saved by transformers (hf_zoo.py), with tensors added the way a user's checkpoint could
hold them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_zoo import CONFIGS, DENSE, save_hf
from safetensors.torch import save_file

from moetrain.cli import main
from moetrain.interop import HFCheckpointError, from_hf
from moetrain.interop.checkpoints import checkpoint_info, load_model
from moetrain.interop.convert import export_hf, import_hf
from moetrain.interop.hf_files import HFDirectory

FAMILIES = [*CONFIGS, *DENSE]


def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's shards."""
    hf = HFDirectory(path)
    return {name: hf.read(name) for name in hf.tensors}


def add_tensors(path: Path, extra: dict[str, torch.Tensor]) -> None:
    """Rewrite a one-file directory with ``extra`` tensors added (or replaced)."""
    tensors = read_all(path)
    (path / "model.safetensors").unlink()
    save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})


def snapshot(root: Path) -> dict[str, bytes | None]:
    if not root.exists():
        return {}
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}  # fmt: skip


def extras(model_type: str) -> dict[str, torch.Tensor]:
    """The issue's two lost tensors for any family: a module it does not know inside a real
    layer, and a whole projection of a layer beyond config.json's count."""
    gen = torch.Generator().manual_seed(7)
    return {
        "model.layers.0.mlp.extra_adapter.weight": torch.randn(8, 64, generator=gen),
        "model.layers.5.self_attn.q_proj.weight": torch.randn(128, 64, generator=gen),
    }


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_family_accounts_for_every_tensor(model_type: str, tmp_path: Path) -> None:
    """A clean transformers save is read whole (every tensor, nothing else); export writes
    every tensor of the model back, bit for bit, and says how many; a module the family
    does not know and a layer beyond config.json's are refused by name, and accepted with
    --allow-unused into the same model as the clean directory's."""
    hf = tmp_path / "hf"
    save_hf(model_type, hf)
    source = read_all(hf)
    done = import_hf(hf, tmp_path / "mt")
    acc = done.tensors
    assert set(acc.read) == set(source) and not (acc.copies or acc.ignored or acc.unused)
    n = len(source)
    assert acc.summary().startswith(f"{n} tensors: {n} read, 0 verified")
    # Export: every tensor of the model reaches the output (the source's tensors, no more).
    exported = export_hf(tmp_path / "mt", tmp_path / "out", tokenizer=False)
    back = read_all(tmp_path / "out")
    assert back.keys() == source.keys() and exported.tensors == n
    for name, t in source.items():
        assert torch.equal(back[name], t), name
    assert exported.summary().startswith(f"{n} tensors written")

    add_tensors(hf, extras(model_type))
    before = snapshot(tmp_path)
    with pytest.raises(HFCheckpointError) as refused:
        import_hf(hf, tmp_path / "refused")
    msg = str(refused.value)
    assert "2 tensor(s)" in msg and "--allow-unused" in msg
    assert "model.layers.0.mlp.extra_adapter.weight (not a tensor of the " in msg
    assert "model.layers.5.self_attn.q_proj.weight (layer 5, beyond config.json" in msg
    assert snapshot(tmp_path) == before  # nothing written, not even the output directory

    allowed = import_hf(hf, tmp_path / "allowed", allow_unused=True)
    assert list(allowed.tensors.unused) == list(extras(model_type))
    assert "2 unused (model.layers.0.mlp.extra_adapter.weight: " in allowed.tensors.summary()
    a = load_model(checkpoint_info(tmp_path / "mt")).state_dict()
    b = load_model(checkpoint_info(tmp_path / "allowed")).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "allow_unused_tensors: true" in (tmp_path / "allowed" / "config.yaml").read_text()
    assert "allow_unused_tensors" not in (tmp_path / "mt" / "config.yaml").read_text()


def test_command_line_refuses_and_accepts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The issue's Qwen3-MoE case through the command line: exit status 2 and one line
    naming both tensors; an existing import replaced with --force stays byte-identical;
    --allow-unused imports, its summary naming what was dropped."""
    hf = tmp_path / "hf"
    save_hf("qwen3_moe", hf)
    assert main(["import-hf", str(hf), str(tmp_path / "mt")]) == 0
    out = capsys.readouterr().out
    assert "moetrain: import-hf: 80 tensors: 80 read, 0 verified" in out and "0 unused" in out
    add_tensors(hf, extras("qwen3_moe"))
    before = snapshot(tmp_path / "mt")
    assert main(["import-hf", str(hf), str(tmp_path / "mt"), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "extra_adapter" in err and "layers.5.self_attn" in err
    assert snapshot(tmp_path / "mt") == before
    assert main(["import-hf", str(hf), str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()
    capsys.readouterr()
    assert main(["import-hf", str(hf), str(tmp_path / "mt"), "--force", "--allow-unused"]) == 0
    out = capsys.readouterr().out
    assert "82 tensors: 80 read" in out and "2 unused (model.layers.0.mlp.extra_adapter" in out
    # generate reads a transformers directory through the same check.
    argv = ["generate", str(hf), "--prompt", "x", "--max-new-tokens", "1", "--device", "cpu"]
    assert main(argv) == 2 and "extra_adapter" in capsys.readouterr().err


def _mtp_dir(model_type: str, path: Path) -> dict[str, torch.Tensor]:
    from test_mtp_checkpoints import save_with_mtp

    return save_with_mtp(model_type, path)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_mtp_copies_are_verified(model_type: str, tmp_path: Path) -> None:
    """The MTP layer's own embedding and head: equal copies are verified and counted; copies
    that differ from the main embedding and head (a different model) are refused by name
    with the difference, and with --allow-unused the summary names them dropped."""
    hf = tmp_path / "hf"
    _mtp_dir(model_type, hf)
    L = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    emb, head = f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"
    done = import_hf(hf, tmp_path / "mt")
    assert done.tensors.copies == {emb: "model.embed_tokens.weight", head: "lm_head.weight"}
    assert not done.tensors.unused and "2 verified equal" in done.tensors.summary()
    exported = export_hf(tmp_path / "mt", tmp_path / "out", tokenizer=False)
    assert exported.copies == 2 and exported.tensors == len(read_all(hf))

    tensors = read_all(hf)
    add_tensors(hf, {emb: tensors[emb] + 4.0, head: -tensors[head]})
    with pytest.raises(HFCheckpointError) as refused:
        import_hf(hf, tmp_path / "refused")
    msg = str(refused.value)
    assert f"{emb} (differs from model.embed_tokens.weight, which it duplicates: " in msg
    assert f"{head} (differs from lm_head.weight" in msg and "max |difference| 4" in msg
    assert not (tmp_path / "refused").exists()
    allowed = import_hf(hf, tmp_path / "allowed", allow_unused=True)
    assert set(allowed.tensors.unused) == {emb, head}


def test_undeclared_mtp_layer_is_refused(tmp_path: Path) -> None:
    """An MTP layer that config.json does not declare is a layer beyond its count."""
    hf = tmp_path / "hf"
    _mtp_dir("deepseek_v3", hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(HFCheckpointError, match=r"layer 3, beyond config.json's "
                       r"num_hidden_layers=3 \(a multi-token-prediction layer"):  # fmt: skip
        import_hf(hf, tmp_path / "mt")


def test_tied_head_saved_anyway(tmp_path: Path) -> None:
    """Qwen3 with tied embeddings: an ``lm_head.weight`` equal to the embedding is a verified
    copy; one that differs is refused (the tied model would silently not be the checkpoint)."""
    hf = tmp_path / "hf"
    save_hf("qwen3", hf)
    emb = read_all(hf)["model.embed_tokens.weight"]
    add_tensors(hf, {"lm_head.weight": emb.clone()})
    done = import_hf(hf, tmp_path / "mt")
    assert done.tensors.copies == {"lm_head.weight": "model.embed_tokens.weight"}
    add_tensors(hf, {"lm_head.weight": emb * 1.001})
    with pytest.raises(HFCheckpointError, match=r"lm_head.weight \(differs from "
                       r"model.embed_tokens.weight"):  # fmt: skip
        import_hf(hf, tmp_path / "refused")


def test_copy_compared_block_by_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison reads a block of rows at a time: a difference in the last row of the
    last block is found (and a block size that skipped rows would miss it)."""
    from moetrain.interop import accounting

    monkeypatch.setattr(accounting, "COMPARE_ELEMENTS", 64 * 7)  # 7 rows of 64 a block
    hf = tmp_path / "hf"
    save_hf("qwen3", hf)
    emb = read_all(hf)["model.embed_tokens.weight"]
    changed = emb.clone()
    changed[-1, -1] += 0.5
    add_tensors(hf, {"lm_head.weight": changed})
    with pytest.raises(HFCheckpointError, match=r"max \|difference\| 0.5"):
        from_hf(hf)


def test_known_extras_are_ignored(tmp_path: Path) -> None:
    """RoPE's buffers that older transformers versions saved are listed as ignored, not
    refused; a look-alike name that is not one is refused."""
    hf = tmp_path / "hf"
    save_hf("llama", hf)
    add_tensors(hf, {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8)
                     for i in range(2)})  # fmt: skip
    done = import_hf(hf, tmp_path / "mt")
    assert len(done.tensors.ignored) == 2 and not done.tensors.unused
    assert "2 ignored (model.layers.*.self_attn.rotary_emb.inv_freq x2)" in done.tensors.summary()
    add_tensors(hf, {"model.layers.0.self_attn.inv_freq_scale": torch.ones(8)})
    with pytest.raises(HFCheckpointError, match="inv_freq_scale"):
        import_hf(hf, tmp_path / "refused")


def test_moetrain_own_format_accounts(tmp_path: Path) -> None:
    """moetrain's own transformers model (export-hf --family moetrain) is read whole, and an
    extra tensor in it is refused like any family's."""
    save_hf("mixtral", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "mt")
    exported = export_hf(tmp_path / "mt", tmp_path / "own", family="moetrain", tokenizer=False)
    n = len(read_all(tmp_path / "own"))
    assert exported.tensors == n
    done = import_hf(tmp_path / "own", tmp_path / "back")
    assert len(done.tensors.read) == n and not done.tensors.unused
    add_tensors(tmp_path / "own", {"model.layers.0.ffn.lora_a": torch.ones(4, 4)})
    with pytest.raises(HFCheckpointError, match=r"model.layers.0.ffn.lora_a \(not a tensor of "
                       r"the moetrain model"):  # fmt: skip
        import_hf(tmp_path / "own", tmp_path / "refused")


def test_export_refuses_a_tensor_it_would_leave_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter that forgets a tensor on export is an error naming it, not a directory
    without it; nothing is written."""
    from moetrain.interop.families.mixtral import Mixtral

    save_hf("mixtral", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "mt")
    original = Mixtral.sources

    def forgetful(self, m, e):
        out = original(self, m, e)
        del out["layers.1.attention.wk.weight"]
        return out

    monkeypatch.setattr(Mixtral, "sources", forgetful)
    with pytest.raises(HFCheckpointError, match=r"mixtral writes no tensor for the "
                       r"checkpoint's layers.1.attention.wk.weight"):  # fmt: skip
        export_hf(tmp_path / "mt", tmp_path / "out", tokenizer=False)
    assert not (tmp_path / "out").exists()
