"""Golden curves: the single-process numbers of a few configs, checked into tests/golden/.

The equivalence matrix proves layouts equal to one process; nothing there notices when the
single process itself changes its numbers. These files do (as torchtitan's loss-compare
files and Megatron-Core's golden values do): each holds, per step, the loss, the gradient
norm, the learning rate and each MoE layer's token counts, drops and balancing losses of a
short fp32 run on one CPU thread. A change to single-process numerics shows as a diff that
its commit must explain; regenerating is a deliberate command:

    MOETRAIN_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py

The data do not depend on the machine or the Python version (the embedded corpus does):
a corpus generated here from a fixed linear congruential sequence (words with a fixed
successor table, so that there is something to learn) and a word-level tokenizer built
from its vocabulary.

Exact or bounded. A file records the environment it was written in (torch version, CPU
architecture, instruction set and processor model: what decides the kernels and so the
rounding). In the
same environment the run is deterministic and every number must be equal, bit for bit;
elsewhere losses and gradient norms must agree within ``BOUND`` and counts are not compared
(a last-bit difference can flip one routing decision).
"""

from __future__ import annotations

import json
import math
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch
from threads import one_thread

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
REPO = Path(__file__).resolve().parents[1]

BOUND = {"loss": 1e-5, "grad_norm": 1e-4}
"""Relative bound on losses and gradient norms where the environment differs from the one a
file was written in (another instruction set rounds matmuls elsewhere). Measured on these
configs with AVX2 kernels against the files' AVX-512 ones (``ATEN_CPU_CAPABILITY=avx2``):
losses within 9.1e-8, gradient norms within 2.4e-6, no token count changed. A balancing
loss taking each micro-batch's own counts (tests/faults.py) moves deepseek_v3_micro's
second loss by 1.6e-5 and its fifth gradient norm by 8e-4: outside the bound too."""

COMMON = [
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.device=cpu",
    "train.dtype=fp32",
    "log.progress_bar=false",
    "log.tensorboard=false",
]
MICRO = [
    # The micro MoE of tests/multirank.py: 4 layers, 2 micro-batches of 4 sequences a step.
    "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=128", "model.max_seq_len=64", "model.tie_embeddings=false",
    "moe.num_experts=4", "moe.top_k=2", "moe.expert_ffn_dim=64", "data.seq_len=32",
    "train.global_batch_size=8", "train.micro_batch_size=4", "optim.warmup_steps=2",
]  # fmt: skip
HALF_ROPE = ["model.rope_style=half"]

# name -> (YAML config or None, overrides, steps). Shapes and options follow the config or
# the family; the families' options are those of tests/interop/hf_zoo.py.
CONFIGS: dict[str, tuple[str | None, list[str], int]] = {
    "tiny": ("configs/tiny.yaml", ["optim.warmup_steps=2"], 4),
    "tiny_ep": ("configs/tiny_ep.yaml", ["optim.warmup_steps=2", "parallel.ep=1",
                                         "parallel.tp=1", "parallel.dp_shard=-1"], 3),
    "deepseek_v3_micro": (None, [
        *MICRO, "model.attention=mla", "model.q_lora_rank=24", "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
        "model.rope_scaling=yarn", "model.rope_scaling_factor=4.0",
        "model.rope_original_max_seq_len=16", "model.rope_yarn_mscale=1.0",
        "model.rope_yarn_mscale_all_dim=1.0", "moe.score_func=sigmoid", "moe.n_groups=2",
        "moe.topk_groups=1", "moe.routed_scaling_factor=2.5", "moe.dense_layers=[0]",
        "moe.num_shared_experts=1", "moe.expert_bias_rate=0.001", "moe.aux_loss_coef=0.0",
        "moe.seq_aux_loss_coef=0.0001", "moe.global_aux_loss_coef=0.01",
        "moe.capacity_factor=null",
    ], 6),
    "mixtral_micro": (None, [*MICRO, *HALF_ROPE, "model.rope_theta=1000000.0",
                             "moe.num_shared_experts=0", "moe.capacity_factor=null",
                             "moe.aux_loss_coef=0.02", "moe.z_loss_coef=0.0"], 6),
    "qwen3_moe_micro": (None, [*MICRO, *HALF_ROPE, "model.head_dim=32", "model.qk_norm=head",
                               "moe.dense_layers=[1]", "moe.num_shared_experts=0",
                               "moe.capacity_factor=null", "moe.aux_loss_coef=0.001"], 6),
    "olmoe_micro": (None, [*MICRO, *HALF_ROPE, "model.qk_norm=full", "model.clip_qkv=8.0",
                           "moe.renormalize=false", "moe.num_shared_experts=0",
                           "moe.capacity_factor=null", "moe.aux_loss_coef=0.01",
                           "moe.z_loss_coef=0.001"], 6),
    "qwen2_moe_micro": (None, [*MICRO, *HALF_ROPE, "model.qkv_bias=true",
                               "moe.num_shared_experts=1", "moe.shared_expert_gate=true",
                               "moe.shared_expert_ffn_dim=96", "moe.renormalize=false",
                               "moe.capacity_factor=1.0", "moe.token_group_seqs=2"], 6),
}  # fmt: skip
"""The golden configs: the two shipped tiny configs (tiny_ep's model in one process: the
matrix proves its layout equal to this), a DeepSeek-V3-style micro config (MLA, YaRN,
group-limited sigmoid routing, a dense first layer, a shared expert, the expert bias, the
sequence and global-batch balancing losses) and one micro config per other Hugging Face
family (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE)."""


# ----------------------------------------------------------------------------- data

_WORDS = 240
_DOCS = 400


def _lcg(seed: int):
    x = seed
    while True:
        x = (6364136223846793005 * x + 1442695040888963407) % 2**64
        yield x >> 33


def corpus(root: Path) -> tuple[Path, Path]:
    """Write the golden corpus (``corpus.txt``, one document per line) and its word-level
    ``tokenizer.json`` under ``root``; the same bytes on every machine."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    rand = _lcg(24)
    syllables = ["ka", "lo", "mi", "ren", "to", "sa", "vu", "ne", "di", "por", "el", "an"]
    words: list[str] = []
    while len(words) < _WORDS:
        w = "".join(syllables[next(rand) % len(syllables)] for _ in range(1 + next(rand) % 3))
        if w not in words:
            words.append(w)
    # Each word is followed by one of its 3 successors 90% of the time: learnable bigrams.
    successors = [[next(rand) % _WORDS for _ in range(3)] for _ in range(_WORDS)]
    lines = []
    for _ in range(_DOCS):
        w, doc = next(rand) % _WORDS, []
        for _ in range(40 + next(rand) % 120):
            doc.append(words[w])
            r = next(rand) % 100
            w = successors[w][r % 3] if r < 90 else next(rand) % _WORDS
        lines.append(" ".join(doc))
    root.mkdir(parents=True, exist_ok=True)
    text = root / "corpus.txt"
    text.write_text("\n".join(lines) + "\n")
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok_path = root / "tokenizer.json"
    tok.save(str(tok_path))
    return text, tok_path


# ----------------------------------------------------------------------------- runs


def environment() -> dict[str, str]:
    """What decides the kernels a CPU run uses, and so its rounding. The instruction set
    alone is not enough: oneDNN and MKL pick their kernels by the processor too (files
    written on an Intel AVX-512 machine differed in the last bits on an AMD EPYC one with
    the same ``cpu_capability``: gradient norms by 5e-9 relative, z-losses by 2e-7)."""
    return {
        "torch": torch.__version__.split("+")[0],
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": _cpu_model(),
    }


def _cpu_model() -> str:
    """The processor: vendor, family, model and name (Linux: /proc/cpuinfo; a name such as
    "AMD EPYC" alone spans generations), else ``platform.processor()``."""
    keys = ("vendor_id", "cpu family", "model", "model name")
    try:
        info: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block is enough
            key, _, value = line.partition(":")
            if key.strip() in keys:
                info[key.strip()] = value.strip()
        if info:
            return " ".join(f"{k}={info[k]}" for k in keys if k in info)
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(name: str, root: Path | None = None) -> dict[str, Any]:
    """Train config ``name`` of ``CONFIGS`` on one thread and return its golden record."""
    from moetrain.config import load_config
    from moetrain.train.trainer import Trainer

    path, overrides, steps = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        data_root = root or Path(tmp) / "data"
        text, tok = corpus(data_root)
        cfg = load_config(
            str(REPO / path) if path else None,
            [*overrides, *COMMON, f"data.dataset={text}", "data.format=text",
             f"data.tokenizer={tok}", f"data.cache_dir={Path(tmp) / 'cache'}",
             f"train.output_dir={Path(tmp) / 'out'}", f"train.steps={steps}"],
        )  # fmt: skip
        with one_thread():  # one summation order on any machine (tests/threads.py)
            trainer = Trainer(cfg)
            record: dict[str, Any] = {"loss": [], "grad_norm": [], "lr": [], "moe": []}
            for _ in range(steps):
                res = trainer.train_step()
                record["loss"].append(res.loss)
                record["grad_norm"].append(res.grad_norm)
                record["lr"].append(res.lr)
                record["moe"].append({str(i): _layer(s) for i, s in sorted(res.moe.items())})
            trainer.close()
    return {"config": name, "steps": steps, "environment": environment(), **record}


def _layer(s: dict[str, torch.Tensor]) -> dict[str, Any]:
    calls = float(s["calls"])
    return {
        "tokens_per_expert": [int(x) for x in s["tokens_per_expert"].tolist()],
        "dropped": int(s["dropped"]),
        "aux_loss": float(s["aux_loss"]) / calls,
        "z_loss": float(s["z_loss"]) / calls,
        "seq_aux_loss": float(s["seq_aux_loss"]) / calls,
        "expert_bias": [float(x) for x in s["expert_bias"].tolist()],
    }


def path_of(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def save(record: dict[str, Any]) -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    path_of(record["config"]).write_text(json.dumps(record, indent=1) + "\n")


def load(name: str) -> dict[str, Any]:
    return json.loads(path_of(name).read_text())


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What differs between a run and its golden file: everything, bit for bit, in the
    file's environment; losses and gradient norms within ``BOUND`` elsewhere. One line per
    quantity, first diverging step first."""
    exact = got["environment"] == want["environment"]
    out: list[tuple[int, str]] = []

    def note(step: int, what: str, a: Any, b: Any, bound: float | None = None) -> None:
        if bound is None:
            if a != b:
                out.append((step, f"step {step} {what}: {a!r}, golden {b!r}"))
        elif not math.isclose(a, b, rel_tol=bound, abs_tol=0.0):
            rel = abs(a - b) / max(abs(b), 1e-30)
            out.append((step, f"step {step} {what}: {a!r}, golden {b!r} (relative "
                              f"difference {rel:.3g}, bound {bound:g})"))  # fmt: skip

    if len(got["loss"]) != len(want["loss"]):
        return [f"{len(got['loss'])} steps, golden {len(want['loss'])}"]
    for step in range(len(want["loss"])):
        for key in ("loss", "grad_norm", "lr"):
            bound = None if exact else BOUND.get(key, 1e-12)
            note(step, key, got[key][step], want[key][step], bound)
        if exact:
            for layer, stats in want["moe"][step].items():
                for key, value in stats.items():
                    note(step, f"layer {layer} {key}", got["moe"][step].get(layer, {}).get(key),
                         value)  # fmt: skip
    out.sort(key=lambda x: x[0])
    mode = (
        "bit for bit (same environment)"
        if exact
        else (
            f"within {BOUND} (environment {got['environment']} vs the file's {want['environment']})"
        )
    )
    return [f"compared {mode}"] + [line for _, line in out] if out else []
