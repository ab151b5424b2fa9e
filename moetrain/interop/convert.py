"""``import-hf`` and ``export-hf``: a transformers directory to a moetrain checkpoint and back.

    import_hf(HF_DIR, OUT_DIR)        OUT_DIR/config.yaml (the model and moe sections of the
                                      architecture) + OUT_DIR/checkpoints/step_00000000 (the
                                      weights, in their stored dtype)
    export_hf(CHECKPOINT, OUT_DIR)    config.json + sharded safetensors + tokenizer files that
                                      AutoModelForCausalLM.from_pretrained loads

Export picks the transformers family that expresses the checkpoint's architecture (the
first whose adapter has no objection, or the one named), converts moetrain's interleaved
RoPE pairing to transformers' rotate-half by permuting the q/k rows of each head, and
writes tensors layer by layer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.accounting import TensorAccount, shared_copies
from moetrain.interop.checkpoints import (
    CheckpointInfo,
    checkpoint_info,
    meta_model,
    read_groups,
    saved_dtype,
)
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families import (
    ARCH_MODEL_KEYS,
    ARCH_MOE_KEYS,
    FAMILIES,
    Family,
    export_family,
)
from moetrain.interop.families.moetrain import REMOTE_DIR
from moetrain.interop.hf_files import TOKENIZER_FILES, HFDirectory, write_safetensors
from moetrain.interop.load import checked_sources, sections
from moetrain.interop.sources import read_full
from moetrain.interop.target import staged_output
from moetrain.model.rope import half_to_interleaved

log = logging.getLogger("moetrain")

HF_KEPT_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")
"""config.json keys that say nothing of the architecture but travel with a model: import-hf
records them in the checkpoint, export-hf writes them back."""


def architecture_yaml(
    m: ModelConfig, e: MoEConfig, source: Path, out: Path, allow_unused: bool = False
) -> str:
    """The config.yaml of an import: how to train from it (``model.init_from`` the source
    directory, a run directory of its own, ``model.allow_unused_tensors`` when the import
    accepted unused tensors), then the architecture keys of both sections."""
    train_dir = out.parent / f"{out.name}-train"
    start: dict[str, Any] = {"init_from": str(source)}
    if allow_unused:
        start["allow_unused_tensors"] = True
    tree = {
        "model": {**start, **{k: getattr(m, k) for k in ARCH_MODEL_KEYS}},
        "moe": {k: getattr(e, k) for k in ARCH_MOE_KEYS},
        "train": {"output_dir": str(train_dir)},
    }
    head = (
        f"# {source}, imported by moetrain import-hf: its architecture (the model and moe keys\n"
        "# below, from its config.json) and a weights-only checkpoint in checkpoints/ for\n"
        "# moetrain generate and export-hf (no optimizer state: it is not resumed).\n"
        "# To train from these weights, run this file (training keys not set here take their\n"
        "# defaults, docs/config.md; add sections or key=value overrides as for any run):\n"
        f"#   moetrain --config {out / 'config.yaml'}\n"
        "# model.init_from reads the weights from the directory above (each rank only its\n"
        "# slices) and replaces the architecture keys with its config.json's; the run writes\n"
        "# to train.output_dir.\n"
    )
    return head + yaml.safe_dump(tree, sort_keys=False)


@dataclasses.dataclass(frozen=True)
class Imported:
    """What ``import_hf`` wrote: the checkpoint, and where each tensor of HF_DIR went."""

    checkpoint: Path
    tensors: TensorAccount


def import_hf(
    hf_dir: str | Path, out_dir: str | Path, *, force: bool = False, allow_unused: bool = False
) -> Imported:
    """Convert a transformers directory into OUT_DIR/config.yaml and a moetrain checkpoint
    at step 0 (model weights only; resume needs a training checkpoint, so train from it with
    ``model.init_from: HF_DIR`` or generate / export from it).

    Every tensor of HF_DIR is accounted for (``moetrain.interop.accounting``): one the model
    would not use refuses the import before anything is written, unless ``allow_unused``.
    OUT_DIR must be new or empty (``force``: a directory replaced whole, never a training
    run nor HF_DIR); it is written beside and renamed into place (``staged_output``)."""
    from moetrain.train.checkpoint import CheckpointManager
    from moetrain.train.fingerprint import model_fingerprint

    hf = HFDirectory(hf_dir, key="import-hf HF_DIR")
    m, e, family = sections(hf)
    sources, account = checked_sources(hf, family, m, e, allow_unused=allow_unused,
                                       accept="--allow-unused")  # fmt: skip
    staged = staged_output(out_dir, force=force, sources=[("HF_DIR", hf.path)],
                           key="import-hf OUT_DIR", replaceable_run=True)  # fmt: skip
    with staged as tmp:
        out = Path(out_dir).expanduser().resolve()
        yaml_text = architecture_yaml(m, e, hf.path.resolve(), out, bool(account.unused))
        (tmp / "config.yaml").write_text(yaml_text)
        from moetrain.config import JobConfig

        job = JobConfig(model=m, moe=e)
        job.train.output_dir = str(out)
        copied = [n for n in TOKENIZER_FILES if (hf.path / n).is_file()]
        for name in copied:
            shutil.copy2(hf.path / name, tmp / name)
        if "tokenizer.json" in copied:  # the run's tokenizer: generate and export use it
            job.data.tokenizer = str(out)
        state = {}
        params = {n for n, _ in meta_model(m, e).named_parameters(remove_duplicate=False)}
        for name, t in meta_model(m, e).state_dict().items():
            if name in sources:
                state[name] = read_full(hf, sources[name])
            elif name in params:
                raise HFCheckpointError(f"import-hf: no source for parameter {name} (adapter bug)")
            else:  # a buffer the family has no tensor for (the expert bias): its initial zeros
                state[name] = torch.zeros(t.shape, dtype=t.dtype)
        manager = CheckpointManager(tmp / "checkpoints", keep_last=1)
        kept = {k: hf.config[k] for k in HF_KEPT_KEYS if hf.config.get(k) is not None}
        extra = {"step": 0, "config": job.to_dict(), "source": str(hf.path.resolve()),
                 "model_type": family.model_type, "hf_config": kept}  # fmt: skip
        fingerprint = model_fingerprint(job, m.vocab_size or 0)
        saved = manager.save(0, {"model": state}, extra, fingerprint=fingerprint)
    return Imported(out / "checkpoints" / saved.name, account)


# ----------------------------------------------------------------------------- export


def _to_half_rows(t: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    """Rows of a q/k projection (or bias, or norm weight) from moetrain's interleaved RoPE
    pairing to transformers' rotate-half: per head, interleaved row i is half row p[i] among
    the first ``rope_dim`` rows (partial rotary leaves the others where they are)."""
    inv = torch.cat((torch.argsort(half_to_interleaved(rope_dim)),
                     torch.arange(rope_dim, head_dim)))  # fmt: skip
    heads = t.reshape(-1, head_dim, *t.shape[1:])
    return heads[:, inv].reshape(t.shape)


_ROPE_ROWS = (
    "attention.wq.weight",
    "attention.wq.bias",
    "attention.wk.weight",
    "attention.wk.bias",
    "attention.q_norm.weight",
    "attention.k_norm.weight",
)
"""Tensors whose rows follow the RoPE pairing of each head (norm weights: per-head ones are
one head, whole-projection ones all heads)."""


def _rope_rows_to_half(name: str, t: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    if m.attention == "gqa" and m.rope_style == "interleaved" and name.endswith(_ROPE_ROWS):
        return _to_half_rows(t, m.attn_head_dim, m.rope_dim)
    return t


def hf_tensors(
    info: CheckpointInfo, family: Family, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every tensor of the exported checkpoint, layer by layer, in
    ``dtype`` or the dtype each was saved in. Every tensor of the checkpoint goes out, or is
    one the family documents as not written: the head of tied embeddings (the embedding,
    written once) and a selection bias that is zero in a family without one; anything else
    without a source is refused (an adapter that forgot a tensor)."""
    m, e = info.model, info.moe
    sources = family.sources(m, e)
    if m.tie_embeddings:
        del sources["output.weight"]  # the embedding, saved once
    hf_shapes = {k: v for src in sources.values() for k, v in src.hf_shapes().items()}
    for group in read_groups(info):
        pieces: dict[str, list[tuple[Any, torch.Tensor]]] = {}
        for name, t in group.items():
            if name not in sources:
                _not_written(name, t, family, m)
                continue
            if not family.keeps_rope_style:
                t = _rope_rows_to_half(name, t, m)
            for key, index, piece in sources[name].export(t):
                pieces.setdefault(key, []).append((index, piece))
        for key, parts in pieces.items():
            full = _assemble(parts, hf_shapes.get(key))
            yield key, full.to(dtype) if dtype is not None else full.contiguous()


def _not_written(name: str, t: torch.Tensor, family: Family, m: ModelConfig) -> None:
    """Refuse to leave out a checkpoint tensor unless the family documents why it may."""
    if name == "output.weight" and m.tie_embeddings:
        return
    if name.endswith("router.expert_bias"):
        if not torch.all(t == 0):
            raise HFCheckpointError(
                f"{name} is not zero but {family.model_type} has no selection bias"
            )
        return
    raise HFCheckpointError(
        f"export-hf: {family.model_type} writes no tensor for the checkpoint's {name} "
        "(adapter bug): nothing was written"
    )


def _assemble(parts: list[tuple[Any, torch.Tensor]], shape: Any) -> torch.Tensor:
    """One HF tensor from the pieces its sources exported (each with the index it fills: a
    block of rows, every other column, or the whole)."""
    if len(parts) == 1 and (shape is None or tuple(parts[0][1].shape) == tuple(shape)):
        return parts[0][1]  # the whole tensor
    assert shape is not None, "a tensor exported in pieces has a declared shape"
    full = torch.empty(shape, dtype=parts[0][1].dtype)
    for index, piece in parts:
        full[index] = piece
    return full


def hf_kept(info: CheckpointInfo) -> dict[str, Any]:
    """The HF_KEPT_KEYS of the model's Hugging Face origin: recorded by import-hf, or read
    from the config.json of the run's ``model.init_from`` / ``model.upcycle_from``."""
    kept = info.extra.get("hf_config")
    if isinstance(kept, dict):
        return {k: v for k, v in kept.items() if k in HF_KEPT_KEYS}
    for origin in (info.model.init_from, info.model.upcycle_from):
        path = Path(origin).expanduser() / "config.json" if origin else None
        if path is not None and path.is_file():
            try:
                cfg = json.loads(path.read_text())
            except ValueError:
                return {}
            return {k: cfg[k] for k in HF_KEPT_KEYS if cfg.get(k) is not None}
    return {}


def _write_tokenizer(info: CheckpointInfo, out: Path, config: dict[str, Any]) -> None:
    """The run's tokenizer, when it is a tokenizer.json (the default BPE is one)."""
    from moetrain.data import load_tokenizer

    spec = info.data.tokenizer
    src = Path(spec).expanduser()
    if spec != "default" and src.is_dir():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
    try:
        tok = load_tokenizer(spec, info.data.cache_dir)
    except Exception as exc:  # a tokenizer that moved since training: weights still export
        log.warning("export-hf: tokenizer %r not written (%s)", spec, exc)
        return
    if not (out / "tokenizer.json").is_file():
        (out / "tokenizer.json").write_text(tok._tok.to_str())
    if not (out / "tokenizer_config.json").is_file():
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tok.eos_token,
            "model_max_length": info.model.max_seq_len,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    config.setdefault("eos_token_id", tok.eos_id)  # an imported model keeps its own


@dataclasses.dataclass(frozen=True)
class Exported:
    """What ``export_hf`` wrote: where, as which family, and why no earlier family fit."""

    path: Path
    family: Family
    passed_over: list[str]
    tensors: int = 0
    """Tensors written."""
    copies: int = 0
    """Of those, copies of a tensor written under another name too (the embedding and the
    head of DeepSeek-V3's / GLM-4.5's multi-token-prediction layers)."""

    tied: bool = False
    """Whether the head is the embedding (written once, as transformers does)."""

    def summary(self) -> str:
        """One line: how many tensors the export wrote."""
        notes = ["every tensor of the checkpoint"]
        if self.tied:
            notes.append("the tied head as the embedding")
        if self.copies:
            notes.append(f"{self.copies} copies of the shared embedding and head")
        return f"{self.tensors} tensors written ({'; '.join(notes)})"

    def describe(self) -> str:
        fam = self.family
        if not fam.remote_files:
            return f"as {fam.model_type} ({fam.architecture})"
        # The families of the other kind (dense for an MoE model) need no explanation.
        why = "; ".join(r for r in self.passed_over if "MoE layers" not in r)
        return (
            f"as moetrain's own {fam.architecture} (its modeling file beside the weights: "
            f"load with trust_remote_code=True), since no transformers family expresses it"
            + (f" ({why})" if why else "")
        )


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    family: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer: bool = True,
    force: bool = False,
) -> Exported:
    """Write a moetrain checkpoint (saved under any layout) as a transformers directory: as
    the first family that expresses it, else as moetrain's own self-contained model.

    Tensors keep the dtype they were saved in unless ``dtype`` says otherwise. OUT_DIR must
    be new or empty (``force``: a directory replaced whole); it is never the checkpoint's
    run, its tokenizer or the directory it came from. Everything is written beside it and
    renamed into place (``staged_output``)."""
    info = checkpoint_info(checkpoint)
    fam, passed_over = _family(info, family)
    staged = staged_output(out_dir, force=force, sources=info.read_dirs(),
                           key="export-hf OUT_DIR")  # fmt: skip
    with staged as tmp:
        config = fam.to_hf(info.model, info.moe)
        config.update(hf_kept(info))
        config["dtype"] = str(dtype or saved_dtype(info)).removeprefix("torch.")
        if tokenizer:
            _write_tokenizer(info, tmp, config)
        written: set[str] = set()
        write_safetensors(_once(hf_tensors(info, fam, dtype), written), tmp, max_shard_bytes)
        copies = shared_copies(info.model, fam.sources(info.model, info.moe))
        for name in fam.remote_files:
            shutil.copy2(REMOTE_DIR / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    out = Path(out_dir).expanduser().resolve()
    log.info("export-hf: %s (step %d) -> %s as %s", info.path, info.step, out, fam.model_type)
    return Exported(out, fam, passed_over, len(written), len(written & set(copies)),
                    info.model.tie_embeddings)  # fmt: skip


def _once(
    tensors: Iterator[tuple[str, torch.Tensor]], seen: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors``, each name recorded in ``seen``; a name twice is an adapter bug (one
    tensor would overwrite the other in the shard)."""
    for key, t in tensors:
        if key in seen:
            raise HFCheckpointError(f"export-hf: {key} exported twice (adapter bug)")
        seen.add(key)
        yield key, t


def _family(info: CheckpointInfo, name: str | None) -> tuple[Family, list[str]]:
    if name is None:
        return export_family(info.model, info.moe)
    if name not in FAMILIES:
        raise HFCheckpointError(f"export-hf --family: {name!r} is not one of {', '.join(FAMILIES)}")
    problems = FAMILIES[name].cannot_express(info.model, info.moe)
    if problems:
        raise HFCheckpointError(
            f"export-hf --family {name}: the checkpoint has {', '.join(problems)}, which "
            f"{name} cannot express"
        )
    return FAMILIES[name], []
