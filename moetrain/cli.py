"""The ``moetrain`` command line.

moetrain [train] --config configs/tiny.yaml key.sub=value ...
moetrain ablate configs/sweeps/router.yaml [--parallel N] [key.sub=value ...]
moetrain prepare-data --config configs/tiny.yaml data.dataset=big.jsonl --out data/big
moetrain import-hf HF_DIR OUT_DIR | export-hf CHECKPOINT_DIR OUT_DIR | generate PATH --prompt TEXT
moetrain plan --config configs/qwen3_30b_a3b.yaml --world 8 --gpu h100 [--search]
python -m moetrain.train --config configs/tiny.yaml key.sub=value ...
"""

from __future__ import annotations

import sys

from moetrain.train.cli import train_main


def ablate_main(argv: list[str] | None = None) -> int:
    from moetrain.ablation import main

    return main(argv)


def prepare_data_main(argv: list[str] | None = None) -> int:
    from moetrain.data.prepare import main

    return main(argv)


def import_hf_main(argv: list[str] | None = None) -> int:
    from moetrain.interop.cli import import_hf_main as main

    return main(argv)


def export_hf_main(argv: list[str] | None = None) -> int:
    from moetrain.interop.cli import export_hf_main as main

    return main(argv)


def generate_main(argv: list[str] | None = None) -> int:
    from moetrain.interop.cli import generate_main as main

    return main(argv)


def plan_main(argv: list[str] | None = None) -> int:
    """Per-rank memory, traffic and step time of a layout at any world size (docs/plan.md):
    the plan builds the optimizers as the trainer does (handed in from train/, above it)."""
    from moetrain.plan.cli import main
    from moetrain.train.engine import build_optimizers

    return main(argv, build_optimizers)


COMMANDS = {"train": train_main, "ablate": ablate_main, "prepare-data": prepare_data_main}
COMMANDS.update({"import-hf": import_hf_main, "export-hf": export_hf_main,
                 "generate": generate_main, "plan": plan_main})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\ncommands: " + ", ".join(COMMANDS) + " (default: train)")
        return 0
    if argv and not argv[0].startswith("-") and "=" not in argv[0]:
        # Neither an option nor a key=value override of the default train command: a word
        # that names no command (a typo, or a command this version does not have).
        print(
            f"moetrain: unknown command {argv[0]!r}; commands are {', '.join(COMMANDS)} "
            "(default: train, as in moetrain --config FILE key=value ...)",
            file=sys.stderr,
        )
        return 2
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
