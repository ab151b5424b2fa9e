"""``moetrain train`` (the default command) and ``python -m moetrain.train`` /
``torchrun -m moetrain.train``: parse the config and its overrides, train, and report bad input
the user can fix as one line with exit status 2.

A config file is required. Without one moetrain would train its dataclasses' defaults (an
untuned 8-expert model into ``outputs/run``), which is what a forgotten ``--config`` looks
like rather than an experiment anybody chose; so a missing ``--config`` is an error that
names how to start (an empty YAML file still gives the built-in defaults, on purpose)."""

from __future__ import annotations

import argparse
import sys

from moetrain.config import ConfigError, load_config

START = """\
start here (from the repository's root):
  moetrain --config configs/tiny.yaml   train a tiny MoE on the embedded corpus (minutes, CPU)"""


def train_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moetrain train",
        description="Train an MoE language model. Overrides are dotted keys: moe.top_k=2.",
    )
    parser.add_argument("--config", help="YAML experiment file (see configs/); required")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    args = parser.parse_intermixed_args(argv)  # options and key=value in any order
    if args.config is None:
        print(f"moetrain: no --config given; nothing was run.\n{START}\n"
              "moetrain --help lists the commands; configs/ holds the experiment files.",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"moetrain: config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        from moetrain.config import config_to_yaml
        from moetrain.train.start import find_start

        try:
            # model.init_from / upcycle_from: the run's architecture is the checkpoint's (the
            # start replaces it, and checks it, as training would); show that.
            find_start(cfg)
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
