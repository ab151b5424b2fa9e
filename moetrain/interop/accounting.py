"""Every tensor of a Hugging Face checkpoint accounted for: nothing is dropped without a word.

Each tensor of the directory's shards is one of

    read      read into the model (by a source of the family adapter: whole, a block of its
              rows, one of two interleaved halves, MXFP4 blocks and scales, a dense FFN that
              upcycling copies)
    copy      a duplicate of a tensor that is read, verified equal to it (the head of a model
              with tied embeddings saved anyway; the embedding and the head that DeepSeek-V3's
              and GLM-4.5's multi-token-prediction layers store again)
    ignored   a known extra that holds no weight of the model (RoPE's ``inv_freq``, cos/sin
              caches; ``Family.ignored`` names them)
    unused    anything else: a layer beyond config.json's count, a module the adapter does
              not know, a copy that differs from the tensor it duplicates. Refused unless the
              caller accepts the loss (``import-hf --allow-unused``,
              ``model.allow_unused_tensors``), and named in the summary either way.

``account_tensors`` is the one classification every import path uses (``import-hf``,
``from_hf`` / ``generate``, ``model.init_from``, ``model.upcycle_from``: through
``load.checked_sources``); it reads tensor headers only, except the copies, which it compares
with their originals a block of rows at a time.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import torch

from moetrain.config import ModelConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families.base import Family
from moetrain.interop.hf_files import HFDirectory
from moetrain.interop.sources import Rows, Source

COMPARE_ELEMENTS = 1 << 22
"""Elements of each tensor read at once when a copy is compared with its original (4M, 32
MiB in fp64, whatever the embedding's size)."""

NAMED_IN_ERROR = 5
"""Unused tensors an error names one by one (the rest are counted)."""


@dataclasses.dataclass(frozen=True)
class TensorAccount:
    """Where each tensor of a directory went (names are the checkpoint's)."""

    read: tuple[str, ...]
    copies: dict[str, str]
    """copy -> the tensor it duplicates, verified equal."""
    ignored: dict[str, str]
    """name -> why it holds no weight of the model."""
    unused: dict[str, str]
    """name -> why it would be lost."""

    @property
    def total(self) -> int:
        return len(self.read) + len(self.copies) + len(self.ignored) + len(self.unused)

    def summary(self) -> str:
        """One line: how many tensors went where, naming every unused one and the ignored
        ones (grouped by pattern: ``model.layers.*.self_attn.rotary_emb.inv_freq x32``)."""
        parts = [f"{len(self.read)} read", f"{len(self.copies)} verified equal to the tensor "
                 "they duplicate", f"{len(self.ignored)} ignored"]  # fmt: skip
        if self.ignored:
            parts[-1] += f" ({_grouped(self.ignored)})"
        parts.append(f"{len(self.unused)} unused")
        if self.unused:
            parts[-1] += " (" + "; ".join(f"{k}: {v}" for k, v in self.unused.items()) + ")"
        return f"{self.total} tensors: " + ", ".join(parts)

    def refuse_unless(self, allowed: bool, key: str, path: object, accept: str) -> None:
        """HFCheckpointError naming the unused tensors and why, unless ``allowed``;
        ``accept``: how the caller accepts the loss (a flag, a config key)."""
        if not self.unused or allowed:
            return
        named = [f"{k} ({v})" for k, v in list(self.unused.items())[:NAMED_IN_ERROR]]
        more = len(self.unused) - len(named)
        raise HFCheckpointError(
            f"{key}: {len(self.unused)} tensor(s) of {path} would not be used: "
            + "; ".join(named)
            + (f"; and {more} more" if more > 0 else "")
            + f". Nothing was written; accept the loss with {accept}"
        )


def _grouped(names: dict[str, str]) -> str:
    """``a.0.x, a.1.x`` -> ``a.*.x x2``: the ignored tensors in a few words."""
    counts = Counter(re.sub(r"\.\d+\.", ".*.", k) for k in names)
    return ", ".join(p if n == 1 else f"{p} x{n}" for p, n in counts.items())


def shared_copies(m: ModelConfig, sources: dict[str, Source]) -> dict[str, str]:
    """Checkpoint names that duplicate a tensor a source reads (copy -> original): the
    ``copies`` of each source (the multi-token-prediction layers' embedding and head), and,
    with tied embeddings, ``lm_head.weight`` (the embedding, which some checkpoints store
    again though transformers does not)."""
    out: dict[str, str] = {}
    for src in sources.values():
        if isinstance(src, Rows):
            out.update(dict.fromkeys(src.copies, src.key))
    head = sources.get("output.weight")
    if m.tie_embeddings and isinstance(head, Rows) and head.key != "lm_head.weight":
        out["lm_head.weight"] = head.key
    return out


def _difference(hf: HFDirectory, copy: str, original: str) -> str | None:
    """None when ``copy`` equals ``original`` value for value, else how it differs. Compared
    a block of rows at a time, so an embedding of any size costs little memory."""
    shape, other = hf.tensors[copy].shape, hf.tensors[original].shape
    if shape != other:
        return f"shape {list(shape)}, but {original}, which it duplicates, has {list(other)}"
    if not shape:  # a scalar
        blocks: list[tuple[slice, ...] | None] = [None]
    else:
        step = max(1, COMPARE_ELEMENTS // max(1, torch.Size(shape[1:]).numel()))
        blocks = [(slice(r, min(shape[0], r + step)),) for r in range(0, shape[0], step)]
    differs, worst = False, 0.0
    for index in blocks:
        x, y = hf.read(copy, index).double(), hf.read(original, index).double()
        if not torch.equal(x, y):
            differs = True
            worst = max(worst, (x - y).abs().nan_to_num(float("inf")).max().item())
    if not differs:
        return None
    return f"differs from {original}, which it duplicates: max |difference| {worst:.3g}"


def _why_unused(name: str, family: Family, m: ModelConfig, tensors: set[str]) -> str:
    found = re.match(rf"{re.escape(family.prefix)}\.(\d+)\.", name)
    layers = m.n_layers + m.mtp_depth
    if found and int(found.group(1)) >= layers:
        i = int(found.group(1))
        why = f"layer {i}, beyond config.json's num_hidden_layers={m.n_layers}"
        if m.mtp_depth:
            why += f" and its {m.mtp_depth} multi-token-prediction layer(s)"
        if family.mtp and f"{family.prefix}.{i}.eh_proj.weight" in tensors:
            why += (" (a multi-token-prediction layer: config.json's num_nextn_predict_layers "
                    "does not declare it, or an earlier one is missing)")  # fmt: skip
        return why
    return f"not a tensor of the {family.model_type} model moetrain reads"


def account_tensors(
    hf: HFDirectory, family: Family, m: ModelConfig, sources: dict[str, Source]
) -> TensorAccount:
    """Classify every tensor of ``hf`` against the sources that will fill the model."""
    tensors = set(hf.tensors)
    read = {key for src in sources.values() for key in src.hf_shapes()}
    copies: dict[str, str] = {}
    ignored: dict[str, str] = {}
    unused: dict[str, str] = {}
    dup = shared_copies(m, sources)
    for name in sorted(tensors - read, key=_natural):
        if name in dup:
            why = _difference(hf, name, dup[name])
            if why is None:
                copies[name] = dup[name]
            else:
                unused[name] = why
            continue
        why = family.ignored_reason(name)
        if why is not None:
            ignored[name] = why
        else:
            unused[name] = _why_unused(name, family, m, tensors)
    return TensorAccount(tuple(sorted(read, key=_natural)), copies, ignored, unused)


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key putting layer 2 before layer 10."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))
