"""The ``moetrain`` command line: a command word picks a subcommand, ``train`` by default.

``moetrain --help`` prints ``HELP`` (plain text: it is what a terminal shows). Training needs
``--config``: ``moetrain`` alone, or training options without a config file, is an error
that names how to start (``moetrain.train.cli``), never a silent run of built-in defaults.
"""

from __future__ import annotations

import sys

from moetrain.train.cli import START, train_main

HELP = f"""\
usage: moetrain [COMMAND] [OPTIONS] [section.key=value ...]

Train and study Mixture-of-Experts language models.

{START}

commands (train is the default: moetrain --config FILE ... trains):
  train         moetrain [train] --config FILE [key=value ...] [--print-config]
  ablate        moetrain ablate SWEEP.yaml [--parallel N] [--out DIR] [key=value ...]
  prepare-data  moetrain prepare-data --config FILE data.dataset=PATH --out DIR
  import-hf     moetrain import-hf HF_DIR OUT_DIR
  export-hf     moetrain export-hf RUN_OR_CHECKPOINT OUT_DIR
  generate      moetrain generate RUN_OR_HF_DIR --prompt TEXT
  plan          moetrain plan --config FILE --world N [--gpu h100] [--search] [key=value ...]

moetrain COMMAND --help shows a command's options; torchrun --nproc-per-node N -m
moetrain.train --config FILE ... trains on N processes. Every config key: docs/config.md.
"""


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
        print(HELP, end="")
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
