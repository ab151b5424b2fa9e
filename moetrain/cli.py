"""The ``moetrain`` command line.

moetrain [train] --config configs/tiny.yaml key.sub=value ...
moetrain ablate configs/sweeps/router.yaml [--parallel N] [key.sub=value ...]
moetrain prepare-data --config configs/tiny.yaml data.dataset=big.jsonl --out data/big
moetrain import-hf HF_DIR OUT_DIR | export-hf CHECKPOINT_DIR OUT_DIR | generate PATH --prompt TEXT
python -m moetrain.train --config configs/tiny.yaml key.sub=value ...
"""

from __future__ import annotations

import argparse
import sys

from moetrain.config import ConfigError, load_config


def train_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moetrain train",
        description="Train an MoE language model. Overrides are dotted keys: moe.top_k=2.",
    )
    parser.add_argument("--config", help="YAML experiment file (see configs/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"moetrain: config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        from moetrain.config import config_to_yaml

        if cfg.model.init_from is not None or cfg.model.upcycle_from is not None:
            # The run's architecture is the checkpoint's: show that, as training will use it.
            from moetrain.interop.init import hf_architecture

            try:
                hf_architecture(cfg)
            except ConfigError as exc:
                print(f"moetrain: config error: {exc}", file=sys.stderr)
                return 2
        print(config_to_yaml(cfg), end="")
        return 0
    import datasets

    from moetrain.data import DataError
    from moetrain.train.checkpoint import CheckpointError
    from moetrain.train.resilience import NonFiniteError
    from moetrain.train.trainer import run

    # The corpus is small and cached: datasets' per-split progress bars are only noise here.
    datasets.disable_progress_bars()

    # Bad input the user can fix (config, data, checkpoint) is reported as one clear line and
    # exit status 2; anything else is a bug or a crash and keeps its traceback.
    kinds = {
        ConfigError: "config error",
        DataError: "data error",
        CheckpointError: "checkpoint error",
    }
    try:
        run(cfg)
    except tuple(kinds) as exc:
        kind = next(v for k, v in kinds.items() if isinstance(exc, k))
        print(f"moetrain: {kind}: {exc}", file=sys.stderr)
        return 2
    except NonFiniteError as exc:
        print(f"moetrain: training halted: {exc}", file=sys.stderr)
        return 1
    return 0


def ablate_main(argv: list[str] | None = None) -> int:
    from moetrain.ablate import main

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


COMMANDS = {"train": train_main, "ablate": ablate_main, "prepare-data": prepare_data_main}
COMMANDS.update({"import-hf": import_hf_main, "export-hf": export_hf_main,
                 "generate": generate_main})  # fmt: skip


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
