"""Expert specialization and routing stability, from the routing of the eval tokens.

At every evaluation the trainer records which experts each eval token is routed to in every
MoE layer (``Engine.eval_loss(..., routing=)``, gathered over every parallel dimension) and
saves it to ``<output_dir>/routing/eval/step_<step>.pt`` in the routing-trace format
(``tools/routing_trace.py``) plus each token's data domain. From such a record:

- **top tokens**: per layer and expert, the tokens (ids, decoded with the run's tokenizer)
  routed to it most often, counting a token once per expert among its K choices;
- **domain shares**: per layer, expert e's share of domain d = the assignments of domain d's
  tokens that chose e / all assignments of domain d's tokens (each domain's column sums to
  1 over the experts; 1/E is no preference);
- **co-activation** (top-k > 1): C[i, j] = the eval tokens whose K choices hold both i and
  j; C[i, i] = the tokens routed to i;
- **routing stability**: per layer, the fraction of eval tokens whose top-1 expert at
  evaluation t is the top-1 expert at the last evaluation (the final checkpoint's).

``SpecializationLog`` writes them to TensorBoard (text: one markdown table per layer; images:
the domain shares and co-activation of every layer) and, once training ends, stability as
the scalar ``moe/layer{L}/routing_stability`` at every evaluation step. The HTML report
(``tools/expert_report.py``) reads the saved records with the same functions.

Shape legend: T tokens, K top-k, E experts, D domains.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetrain.train.replay import FORMAT, routing_trace

log = logging.getLogger("moetrain")

EVAL_DIR = Path("routing") / "eval"
"""Where, under a run's output directory, the eval routing records live."""


@dataclass
class LayerSpecialization:
    """What one MoE layer does with the eval tokens."""

    top_tokens: list[list[tuple[int, int]]]
    """Per expert: (token id, times routed to it), most frequent first (ties: smaller id)."""
    assignments_E: np.ndarray
    """Tokens routed to each expert (a token counts once per expert among its K choices)."""
    domain_counts_ED: np.ndarray | None
    """Assignments of each domain's tokens to each expert (None: no domains)."""
    coactivation_EE: np.ndarray
    """Tokens whose K choices hold both i and j; the diagonal: tokens routed to i."""
    n_tokens: int
    """Eval tokens routed."""

    def domain_shares(self) -> np.ndarray | None:
        """(E, D): expert e's share of domain d's assignments (columns sum to 1)."""
        if self.domain_counts_ED is None:
            return None
        total_D = self.domain_counts_ED.sum(0, keepdims=True)
        return self.domain_counts_ED / np.maximum(total_D, 1)


def layer_specialization(
    ids_TK: torch.Tensor | np.ndarray,
    tokens_T: torch.Tensor | np.ndarray,
    num_experts: int,
    domain_T: np.ndarray | None = None,
    n_domains: int = 0,
    top_n: int = 8,
) -> LayerSpecialization:
    ids = np.asarray(ids_TK, dtype=np.int64)
    tokens = np.asarray(tokens_T, dtype=np.int64).reshape(-1)
    T, K = ids.shape
    E = num_experts
    if tokens.shape[0] != T:
        raise ValueError(f"{tokens.shape[0]} tokens for {T} routed tokens")
    # A token routed twice to one expert (a replayed routing may do that) counts once.
    chosen_TE = np.zeros((T, E), dtype=bool)
    chosen_TE[np.arange(T)[:, None], ids] = True
    top_tokens = []
    for e in range(E):
        tok_e = tokens[chosen_TE[:, e]]
        values, counts = np.unique(tok_e, return_counts=True)
        order = np.lexsort((values, -counts))[:top_n]
        top_tokens.append([(int(values[i]), int(counts[i])) for i in order])
    domain_counts = None
    if domain_T is not None:
        dom = np.asarray(domain_T, dtype=np.int64).reshape(-1)
        onehot_TD = np.zeros((T, n_domains), dtype=np.int64)
        onehot_TD[np.arange(T), dom] = 1
        domain_counts = chosen_TE.astype(np.int64).T @ onehot_TD
    c = chosen_TE.astype(np.int64)
    return LayerSpecialization(top_tokens, c.sum(0), domain_counts, c.T @ c, T)


def routing_stability(earlier: dict[int, Any], final: dict[int, Any]) -> dict[int, float]:
    """Per layer: the fraction of tokens whose top-1 expert (column 0 of ids (T, K), the
    highest score) is the same in ``earlier`` and ``final``. Each record is read with its own
    K (a run resumed with another ``moe.top_k`` has records of both); a layer only one of them
    routed is left out."""
    out = {}
    for layer, ids in final.items():
        if layer not in earlier:
            continue
        a, b = _top1(earlier[layer]), _top1(ids)
        if a.shape != b.shape:
            raise ValueError(f"layer {layer}: {a.shape[0]} routed tokens against {b.shape[0]}")
        out[layer] = float((a == b).mean())
    return out


def _top1(ids: Any) -> np.ndarray:
    """(T,) the first-choice expert of every token of ids (..., K)."""
    ids = np.asarray(ids)
    return ids.reshape(-1, ids.shape[-1])[:, 0]


# ----------------------------------------------------------------------------- records


def save_eval_routing(
    out_dir: str | Path,
    step: int,
    routing: dict[str, Any],
    num_experts: int,
    top_k: int,
    loss: float,
    domains: tuple[list[str], np.ndarray] | None,
) -> Path:
    """Write one evaluation's routing as a routing trace (one "micro-batch" holding every
    eval sequence) with each token's domain: ``<out_dir>/routing/eval/step_<step>.pt``."""
    trace = routing_trace(step, routing, num_experts, top_k, loss)
    if domains is not None:
        trace["domain_names"] = list(domains[0])
        trace["domain"] = torch.as_tensor(domains[1], dtype=torch.int64).reshape(
            trace["input_ids"].shape
        )
    path = Path(out_dir) / EVAL_DIR / f"step_{step:08d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(trace, tmp)
    tmp.replace(path)
    return path


def load_eval_routing(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Every saved evaluation routing of a run, by step."""
    out = {}
    for path in sorted((Path(run_dir) / EVAL_DIR).glob("step_*.pt")):
        m = re.fullmatch(r"step_(\d+)\.pt", path.name)
        if m is None:
            continue
        trace = torch.load(path, map_location="cpu", weights_only=True)
        if trace.get("format") != FORMAT:
            raise ValueError(f"{path}: not a routing trace ({FORMAT})")
        out[int(m.group(1))] = trace
    return out


def trace_specialization(trace: dict[str, Any], top_n: int = 8) -> dict[int, LayerSpecialization]:
    """Every layer's ``LayerSpecialization`` from a saved record."""
    tokens = trace["input_ids"].reshape(-1)
    domain = trace.get("domain")
    names = trace.get("domain_names") or []
    return {
        layer: layer_specialization(
            ids.reshape(-1, ids.shape[-1]), tokens, trace["num_experts"],
            None if domain is None else domain.reshape(-1).numpy(), len(names), top_n,
        )
        for layer, ids in sorted(trace["ids"].items())
    }  # fmt: skip


def stability_over_steps(records: dict[int, dict[str, Any]]) -> dict[int, dict[int, float]]:
    """{step: {layer: stability against the last record}} for every record."""
    if not records:
        return {}
    final = records[max(records)]
    # Only records of the same eval tokens compare (a run resumed with another data.seq_len
    # or train.eval_batches evaluates other tokens).
    return {
        step: routing_stability(r["ids"], final["ids"])
        for step, r in sorted(records.items())
        if torch.equal(torch.as_tensor(r["input_ids"]), torch.as_tensor(final["input_ids"]))
    }


# ----------------------------------------------------------------------------- rendering


def token_label(decode: Callable[[list[int]], str], token: int) -> str:
    """A token as text for a table: repr-style escapes, so spaces and newlines show."""
    text = decode([token])
    return repr(text)[1:-1].replace("|", "\\|") or "''"


def specialization_markdown(
    layer: int,
    spec: LayerSpecialization,
    decode: Callable[[list[int]], str],
    domain_names: list[str],
) -> str:
    """One markdown table: expert, tokens routed, share of each domain, top tokens."""
    shares = spec.domain_shares()
    heads = ["expert", "tokens", *(f"share of {d}" for d in domain_names), "most frequent tokens"]
    uniform = 1 / len(spec.top_tokens)
    lines = [f"MoE layer {layer}: eval tokens per expert (uniform share {uniform:.3f})",
             "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]  # fmt: skip
    for e, top in enumerate(spec.top_tokens):
        cells = [str(e), str(int(spec.assignments_E[e]))]
        if shares is not None:
            cells += [f"{shares[e, d]:.3f}" for d in range(len(domain_names))]
        cells.append(", ".join(f"`{token_label(decode, t)}` {n}" for t, n in top))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_specialization(
    specs: dict[int, LayerSpecialization], domain_names: list[str], title: str
) -> np.ndarray:
    """An RGB image (H, W, 3) uint8: per layer (rows) the expert x domain shares (when there
    are domains) and the expert co-activation (fraction of tokens)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layers = sorted(specs)
    cols = 2 if domain_names else 1
    E = len(next(iter(specs.values())).top_tokens)
    fig = Figure(figsize=(4.2 * cols + 0.5, 0.35 * E * len(layers) + 1.2 * len(layers)), dpi=90)
    FigureCanvasAgg(fig)
    for r, layer in enumerate(layers):
        spec = specs[layer]
        panels = []
        if domain_names:
            panels.append((spec.domain_shares().T, domain_names))
        panels.append((spec.coactivation_EE / max(spec.n_tokens, 1), None))
        for c, (values, labels) in enumerate(panels):
            ax = fig.add_subplot(len(layers), cols, r * cols + c + 1)
            im = ax.imshow(values, aspect="auto", cmap="viridis", vmin=0.0)
            ax.set_xticks(range(E))
            ax.tick_params(labelsize=7)
            if labels is not None:
                ax.set_yticks(range(len(labels)), labels)
                ax.set_title(f"layer {layer}: share of each domain per expert", fontsize=8)
            else:
                ax.set_yticks(range(E))
                ax.set_title(f"layer {layer}: co-activation (fraction of tokens)", fontsize=8)
            fig.colorbar(im, ax=ax, pad=0.02).ax.tick_params(labelsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[:, :, :3].copy()


# ----------------------------------------------------------------------------- the trainer's


class SpecializationLog:
    """The trainer's side (rank 0): each evaluation's routing saved and written to
    TensorBoard; routing stability once training ends."""

    def __init__(self, out_dir: Path, writer: Any, decode: Callable[[list[int]], str],
                 domains: tuple[list[str], np.ndarray] | None, num_experts: int, top_k: int,
                 top_n: int) -> None:  # fmt: skip
        self.out_dir = Path(out_dir)
        self.writer = writer
        self.decode = decode
        self.domains = domains
        self.num_experts, self.top_k, self.top_n = num_experts, top_k, top_n

    def on_eval(self, step: int, routing: dict[str, Any], loss: float) -> None:
        n = routing["input_ids"].shape[0]
        domains = None
        if self.domains is not None:
            domains = (self.domains[0], self.domains[1][:n])
        path = save_eval_routing(self.out_dir, step, routing, self.num_experts, self.top_k,
                                 loss, domains)  # fmt: skip
        specs = trace_specialization(torch.load(path, weights_only=True), self.top_n)
        names = domains[0] if domains is not None else []
        for layer, spec in specs.items():
            self.writer.text(
                f"moe/specialization/layer{layer}",
                specialization_markdown(layer, spec, self.decode, names),
                step,
            )
        if self.writer.writer is not None:
            image = render_specialization(specs, names, f"eval routing at step {step}")
            self.writer.writer.add_image("moe/specialization", image, step, dataformats="HWC")

    def finish(self) -> dict[int, dict[int, float]]:
        """Routing stability of every saved evaluation against the last one, as scalars
        ``moe/layer{L}/routing_stability`` at each evaluation's step."""
        stab = stability_over_steps(load_eval_routing(self.out_dir))
        for step, per_layer in stab.items():
            self.writer.scalars(
                {f"moe/layer{layer}/routing_stability": v for layer, v in per_layer.items()}, step
            )
        if stab:
            first = min(stab)
            log.info(
                "routing stability (top-1 at step %d = top-1 at step %d): %s",
                first,
                max(stab),
                ", ".join(f"layer {k} {v:.1%}" for k, v in stab[first].items()),
            )
        return stab
