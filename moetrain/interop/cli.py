"""The interop commands of ``moetrain``:

    moetrain import-hf HF_DIR OUT_DIR [--force] [--allow-unused]
    moetrain export-hf CHECKPOINT_DIR OUT_DIR [--family F] [--dtype bf16] [--max-shard-gb N]
                       [--force]
    moetrain generate CHECKPOINT_OR_HF_DIR --prompt TEXT [--max-new-tokens N]
                      [--temperature T] [--top-p P] [--seed S] [--device D]

Bad input (a directory that is not what it should be, an architecture no family
expresses, an output directory that is not empty or is one of the sources, a tensor of
HF_DIR that the model would not use) is one line on stderr and exit status 2. Output is
written beside OUT_DIR and renamed into place.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from moetrain.config import ConfigError


def _fail(exc: Exception) -> int:
    from moetrain.train.checkpoint import CheckpointError

    kind = "checkpoint error" if isinstance(exc, CheckpointError) else "error"
    print(f"moetrain: {kind}: {exc}", file=sys.stderr)
    return 2


def _user_errors() -> tuple[type[Exception], ...]:
    from moetrain.data import DataError
    from moetrain.train.checkpoint import CheckpointError

    return (ConfigError, CheckpointError, DataError, ValueError)


def import_hf_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moetrain import-hf",
        description="Convert a directory saved by transformers into a moetrain checkpoint "
        "(OUT_DIR/checkpoints/step_00000000) and the YAML sections of its architecture "
        "(OUT_DIR/config.yaml).",
    )
    parser.add_argument("hf_dir", help="local directory with config.json and safetensors")
    parser.add_argument("out_dir", help="where the checkpoint and config.yaml go: a new or "
                        "empty directory")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR "
                        "whole (never a training run or HF_DIR)")  # fmt: skip
    parser.add_argument("--allow-unused", action="store_true", help="import even when some "
                        "tensors of HF_DIR would not be used (a layer beyond config.json's, a "
                        "module the family does not have, a shared copy that differs from the "
                        "tensor it duplicates); the summary names them")  # fmt: skip
    args = parser.parse_args(argv)
    from moetrain.interop.convert import import_hf

    try:
        done = import_hf(args.hf_dir, args.out_dir, force=args.force,
                         allow_unused=args.allow_unused)  # fmt: skip
    except _user_errors() as exc:
        return _fail(exc)
    print(f"moetrain: imported {args.hf_dir} -> {done.checkpoint} "
          f"(+ {Path(args.out_dir) / 'config.yaml'})")  # fmt: skip
    print(f"moetrain: import-hf: {done.tensors.summary()}")
    return 0


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_hf_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moetrain export-hf",
        description="Write a moetrain checkpoint (saved under any layout) as a directory that "
        "transformers' AutoModelForCausalLM.from_pretrained loads.",
    )
    parser.add_argument("checkpoint", help="a step_* directory, a checkpoints/ root or a run dir")
    parser.add_argument("out_dir", help="a new or empty directory")
    parser.add_argument("--family", help="transformers model_type (default: the first family "
                        "that expresses the architecture, else moetrain's own model, loaded "
                        "with trust_remote_code=True)")  # fmt: skip
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="tensor dtype (default: the "
                        "dtype each tensor was saved in: an imported bf16 model stays bf16, a "
                        "trained one is fp32)")  # fmt: skip
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors "
                        "file in GiB; bigger models are split into several with an index "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR "
                        "whole (never the run, its tokenizer or its source)")  # fmt: skip
    args = parser.parse_args(argv)
    from moetrain.interop.convert import export_hf

    try:
        exported = export_hf(
            args.checkpoint,
            args.out_dir,
            family=args.family,
            dtype=_DTYPES.get(args.dtype) if args.dtype else None,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            force=args.force,
        )
    except _user_errors() as exc:
        return _fail(exc)
    print(f"moetrain: exported {args.checkpoint} -> {exported.path} {exported.describe()}")
    print(f"moetrain: export-hf: {exported.summary()}")
    return 0


def load_for_generation(path: str | Path, device: str = "cpu"):
    """(model, tokenizer or None) of a transformers directory or a moetrain checkpoint, on
    ``device`` in eval mode with dropless routing."""
    from moetrain.data import load_tokenizer

    path = Path(path).expanduser()
    if (path / "config.json").is_file():
        from moetrain.interop.hf_model import from_hf

        model = from_hf(path)
        tokenizer = load_tokenizer(str(path)) if (path / "tokenizer.json").is_file() else None
    else:
        from moetrain.interop.checkpoints import checkpoint_info, load_model

        info = checkpoint_info(path)
        # Dropless routing, whole micro-batch groups: generation feeds one token at a time.
        info.moe = dataclasses.replace(
            info.moe, capacity_factor=None, token_group_seqs=None, kernels="auto"
        )
        model = load_model(info)
        tokenizer = load_tokenizer(info.data.tokenizer, info.data.cache_dir)
    return model.to(device).eval(), tokenizer


def generate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moetrain generate",
        description="Continue a prompt with a moetrain checkpoint or a transformers directory "
        "(KV cache; greedy unless --temperature > 0).",
    )
    parser.add_argument("path", help="a moetrain checkpoint / run dir, or a transformers dir")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at "
                        "most; fewer at the end-of-text token or the model's context "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; "
                        "0: greedy (default: %(default)s)")  # fmt: skip
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: sample "
                        "from the smallest set of tokens whose probability reaches P "
                        "(default: %(default)s, every token)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to run: cpu, cuda, cuda:1 ... (default: %(default)s)",
    )
    parser.add_argument("--show-ids", action="store_true", help="also print the token ids")
    args = parser.parse_args(argv)
    from moetrain.model.generate import generate

    try:
        model, tok = load_for_generation(args.path, args.device)
        if tok is None:
            raise ConfigError(f"{args.path} has no tokenizer.json to encode the prompt with")
        prompt = tok.encode(args.prompt)
        ids = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, eos_id=tok.eos_id, seed=args.seed)  # fmt: skip
    except _user_errors() as exc:
        return _fail(exc)
    print(args.prompt + tok.decode(ids))
    limit = model.cfg.max_seq_len
    if len(ids) < args.max_new_tokens and (not ids or ids[-1] != tok.eos_id):
        print(
            f"moetrain: generate: stopped after {len(ids)} of --max-new-tokens "
            f"{args.max_new_tokens} tokens: the prompt ({len(prompt)} tokens) and the "
            f"continuation fill the model's context of {limit} positions",
            file=sys.stderr,
        )
    if args.show_ids:
        print(f"prompt ids: {prompt}")
        print(f"generated ids: {ids}")
    return 0
