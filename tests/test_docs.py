"""The docs say only what a machine can confirm: paths that exist, commands that parse.

For README.md and every docs/*.md page:

- every link and every repository path (``moetrain/...``, ``tests/...``, ``configs/...``)
  resolves inside the repository, and nothing points outside it (``../shared``, absolute
  paths of a build machine, files that live beside the repository); a link to a heading
  (``page.md#anchor``, ``#anchor``) names a heading the page has;
- every command shown in a shell code block parses its arguments without running:
  ``moetrain ...`` and ``python -m moetrain ...`` through the command's own parser (any
  command of ``moetrain.cli.COMMANDS``, so commands added later are covered), training
  commands (``moetrain [train]``, ``python -m moetrain.train``, ``torchrun ... -m
  moetrain.train``) further through config loading and validation (``--print-config``
  semantics) and the layout check for the launch's world size, and ``python tools/X.py``
  / ``torchrun ... tools/X.py`` through the tool's parser (and its ``check_args`` when it
  has one, e.g. ``tools/comm_report.py`` validates its layout).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from doc_commands import blocks, commands, unlabeled_commands

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "docs" / "data"  # what tools, tests and sweeps wrote, which the pages quote
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What a clean clone has at its top: not the ignored run outputs (outputs/, runs/) that a
# working tree may hold.
IGNORED_TOP = {"outputs", "runs", "checkpoints", "build", "dist", "__pycache__"}
TOP = (
    {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
    - IGNORED_TOP
    - {n for n in (p.name for p in REPO.iterdir()) if n.endswith(".egg-info")}
)
# Names of files that live beside the repository, not in it: a clone would not have them.
FOREIGN = re.compile(r"\.\./shared|\bANCHORS\b|\b(?:DESIGN|PLATFORM|STYLE)\.md\b")
# Absolute paths into a machine's own directories (an illustrative '/no/such/file' is fine).
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|home|root|tmp|Users|mnt|opt|srv|scratch)/")


def _rel(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


# ----------------------------------------------------------------------------- paths


def _path_tokens(page: Path) -> Iterator[tuple[int, str]]:
    """Tokens of code spans and of non-YAML code blocks that could name a file."""
    for number, lang, line in blocks(page):
        if lang is None:
            texts = re.findall(r"`([^`]+)`", line)
        elif lang in ("yaml", "yml", "python", "py"):
            continue  # paths there are relative to another file (a sweep's base:) or code
        else:
            texts = [line.split(" #")[0]]
        for text in texts:
            for token in text.split():
                token = token.strip("()[]{},;:'\"").rstrip(".")
                if "/" in token:
                    yield number, token


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (code spans and links reduced to their
    text), lower case, without punctuation but ``-`` and ``_``, spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks); a repeated heading's second
    anchor ends in ``-1``, as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, lang, line in blocks(page):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*$", line) if lang is None else None
        if heading:
            slug = _slug(heading.group(1))
            out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return out


def _problems(page: Path) -> list[str]:
    problems = []
    text = page.read_text()
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in (FOREIGN, MACHINE_PATH):
            for m in pattern.finditer(line):
                problems.append(f"{_rel(page)}:{number}: {m.group(0)!r} points outside the repo")
    for number, line in enumerate(text.splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            if target.startswith("#"):
                if target[1:] not in anchors(page):
                    problems.append(f"{_rel(page)}:{number}: link {target}: no such heading")
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if REPO not in path.parents and path != REPO:
                problems.append(f"{_rel(page)}:{number}: link {target} leaves the repository")
            elif not path.exists():
                problems.append(f"{_rel(page)}:{number}: link {target} does not exist")
            elif "#" in target and path.suffix == ".md":
                if target.split("#", 1)[1] not in anchors(path):
                    problems.append(f"{_rel(page)}:{number}: link {target}: no such heading")
    for number, token in _path_tokens(page):
        if token.startswith("../"):
            path = (page.parent / token).resolve()
            if REPO not in path.parents:
                problems.append(f"{_rel(page)}:{number}: {token} leaves the repository")
            continue
        path = token.split("::")[0]
        if path.split("/")[0] not in TOP or any(c in path for c in "<>{}$"):
            continue  # not a repository path (outputs/tiny, moe/layer{L}/...)
        if not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
            problems.append(f"{_rel(page)}:{number}: {token} does not exist in the repository")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_paths_resolve_inside_the_repository(page: Path) -> None:
    problems = _problems(page)
    assert not problems, "\n".join(problems)


def undocumented_configs(readme: str) -> list[str]:
    """Files under configs/ that README.md's table of experiment files does not name."""
    files = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").rglob("*.yaml"))
    return [f for f in files if f"`{f}`" not in readme]


def test_anchors_are_githubs() -> None:
    """Anchors as GitHub writes them, so a link that works there passes here and one that
    does not fails: code spans and punctuation dropped, a repeated heading numbered."""
    assert _slug("Resume (`train.resume`)") == "resume-trainresume"
    assert _slug("The first GPU run (one H100, 2026-11-27)") == (
        "the-first-gpu-run-one-h100-2026-11-27")  # fmt: skip
    found = anchors(REPO / "docs" / "expert_parallel.md")
    assert {"choosing-ep", "how-the-engine-runs-it"} <= found and "no-such-heading" not in found
    assert "the-keys-parallel-in-docsconfigmd" in found  # `parallel.*`, `docs/config.md`


def test_every_config_file_is_documented() -> None:
    assert not undocumented_configs((REPO / "README.md").read_text())
    assert undocumented_configs("") and "configs/tiny.yaml" in undocumented_configs("")


FRONT = REPO / "docs" / "README.md"
"""The docs' front page: which page to read for what, and what writes each data file."""


def unlisted_data(front: str, files: list[Path]) -> list[str]:
    """Files under docs/data/ and docs/img/ that the front page does not name by their path
    from docs/ (``data/...``, ``img/...``)."""
    names = [f.relative_to(REPO / "docs").as_posix() for f in files]
    return [n for n in names if f"({n})" not in front and f"`{n}`" not in front]


def test_every_data_file_is_listed_on_the_front_page() -> None:
    """What a tool, test or sweep wrote lives under docs/data/ (figures under docs/img/), not
    among the pages, and the front page says what writes each file and what reads it."""
    loose = sorted(p.name for p in (REPO / "docs").iterdir() if p.is_file() and p.suffix != ".md")
    assert not loose, f"files among the pages, not under docs/data/ or docs/img/: {loose}"
    files = sorted(f for d in ("data", "img") for f in (REPO / "docs" / d).rglob("*")
                   if f.is_file())  # fmt: skip
    assert len(files) > 20 and not unlisted_data(FRONT.read_text(), files)
    planted = [*files, REPO / "docs" / "data" / "new_sweep_summary.csv"]
    assert unlisted_data(FRONT.read_text(), planted) == ["data/new_sweep_summary.csv"]


def test_path_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself catches each kind of bad reference."""
    page = REPO / "docs" / "_test_docs_probe.md"
    bad = [
        "See `../shared/DESIGN.md`.",
        "Targets in `/work/shared/targets.md` terms.",
        "[missing](no_such_page.md)",
        "[outside](../../etc/passwd)",
        "[no heading](checkpoints.md#no-such-heading)",
        "[no heading here](#nor-here)",
        "The code is `moetrain/train/no_such_module.py`.",
        "```bash\npython tools/no_such_tool.py\n```",
    ]
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "\n".join(bad) + "\n")
    problems = _problems(page)
    for needle in (
        "../shared",
        "/work/",
        "no_such_page.md",
        "../../etc/passwd",
        "#no-such-heading",
        "#nor-here",
        "no_such_module.py",
        "no_such_tool.py",
    ):
        assert any(needle in p for p in problems), (needle, problems)


# ----------------------------------------------------------------------------- commands


class _Parsed(BaseException):  # noqa: N818 (not an error: escapes `except Exception`)
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


@contextlib.contextmanager
def _stop_after_parsing() -> Iterator[None]:
    """Make the first ``ArgumentParser.parse_args`` / ``parse_intermixed_args`` /
    ``parse_known_args`` call raise with its result, so that a ``main(argv)`` parses its
    arguments and does nothing else."""
    methods = ("parse_args", "parse_intermixed_args", "parse_known_args")
    originals = {name: getattr(argparse.ArgumentParser, name) for name in methods}
    depth = {"in_parse_args": 0}

    def whole(name: str) -> Callable[..., Any]:
        def parse(self, args=None, namespace=None):
            depth["in_parse_args"] += 1
            try:
                result = originals[name](self, args, namespace)
            finally:
                depth["in_parse_args"] -= 1
            raise _Parsed(result)

        return parse

    def parse_known_args(self, args=None, namespace=None):
        result = originals["parse_known_args"](self, args, namespace)
        if depth["in_parse_args"]:  # inside parse_args (or a subparser): let it finish
            return result
        raise _Parsed(result[0])

    argparse.ArgumentParser.parse_args = whole("parse_args")
    argparse.ArgumentParser.parse_intermixed_args = whole("parse_intermixed_args")
    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(argparse.ArgumentParser, name, method)


def parse_only(main: Callable[[list[str]], Any], argv: list[str]) -> argparse.Namespace:
    """The namespace ``main(argv)`` parses; fails (SystemExit from argparse) on bad arguments,
    or when ``main`` returns without parsing anything."""
    with _stop_after_parsing():
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.namespace
    raise AssertionError(f"{main.__module__}.{main.__name__} returned without parsing {argv}")


def _load_tool(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_docs_tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a tool's dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def check_training(argv: list[str], world_size: int = 1) -> None:
    """A training command's arguments parse, its config loads and validates, and its layout
    fits ``world_size`` ranks."""
    from moetrain.config import load_config
    from moetrain.parallel.dims import ParallelDims
    from moetrain.train.cli import train_main

    args = parse_only(train_main, argv)
    assert args.config is not None, "training needs --config (moetrain refuses to run without)"
    cfg = load_config(args.config, args.overrides)
    ParallelDims.from_config(cfg.parallel, world_size).validate(cfg)


def _check_ablate(args: argparse.Namespace) -> None:
    from moetrain.ablation import load_sweep

    load_sweep(args.sweep, args.overrides, args.out)  # builds and validates every run's config


def _check_config(args: argparse.Namespace) -> None:
    from moetrain.config import load_config

    # The keys a command reads (data.* for prepare-data): names, types, values. The layout
    # itself may be one that plan refuses, which is its answer, not an error of the page.
    load_config(args.config, args.overrides)


# Checks beyond parsing for commands that take a config; other commands are parsed only.
DEEPER = {"ablate": _check_ablate, "prepare-data": _check_config, "plan": _check_config}


def check_moetrain(argv: list[str], world_size: int = 1) -> None:
    """``moetrain ARGV`` as ``moetrain.cli.main`` dispatches it."""
    from moetrain.cli import COMMANDS

    if argv and argv[0] in COMMANDS and argv[0] != "train":
        args = parse_only(COMMANDS[argv[0]], argv[1:])
        if argv[0] in DEEPER:
            DEEPER[argv[0]](args)
        return
    if argv and argv[0] == "train":
        argv = argv[1:]
    assert not argv or argv[0].startswith("-") or "=" in argv[0], f"unknown command {argv[0]}"
    check_training(argv, world_size)


def check_tool(script: str, argv: list[str], world_size: int = 1) -> None:
    path = REPO / script
    assert path.is_file(), f"{script} does not exist"
    module = _load_tool(path)
    args = parse_only(module.main, argv)
    if hasattr(module, "check_args"):
        module.check_args(args, world_size)


def _torchrun(argv: list[str]) -> tuple[int, list[str]]:
    """(world size, the rest of the command line after torchrun's own options)."""
    nproc, nnodes, i = 1, 1, 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        name, _, value = argv[i].partition("=")
        if not value and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            value, i = argv[i + 1], i + 1
        if name in ("--nproc-per-node", "--nproc_per_node"):
            nproc = int(value)
        elif name == "--nnodes":
            nnodes = int(value.split(":")[-1])
        i += 1
    return nproc * nnodes, argv[i:]


def _sbatch(argv: list[str]) -> None:
    """``sbatch [--nodes=N] tools/slurm/train.sbatch CONFIG key=value ...``: the script exists,
    and its training command checks for the allocation's world size (N nodes of the script's
    default 8 processes)."""
    nodes, i = 2, 0  # the script's #SBATCH --nodes
    while i < len(argv) and argv[i].startswith("-"):
        name, _, value = argv[i].partition("=")
        if name in ("--nodes", "-N"):
            nodes = int(value)
        i += 1
    script, config, overrides = argv[i], argv[i + 1], argv[i + 2 :]
    assert (REPO / script).is_file(), f"{script} does not exist"
    if script == "tools/slurm/train.sbatch":
        check_training(["--config", config, *overrides], world_size=nodes * 8)


def check_command(argv: list[str]) -> bool:
    """Check one command line; False when it is not one this test knows (pip, tensorboard)."""
    program, rest = argv[0], argv[1:]
    world = 1
    if program == "sbatch":
        _sbatch(rest)
        return True
    if program == "torchrun":
        world, rest = _torchrun(rest)
        program = "python"
    elif program not in ("python", "python3"):
        if program != "moetrain":
            return False
        check_moetrain(rest)
        return True
    if rest[:2] == ["-m", "moetrain"]:
        check_moetrain(rest[2:], world)
    elif rest[:2] == ["-m", "moetrain.train"]:
        check_training(rest[2:], world)
    elif rest and rest[0].startswith("tools/") and rest[0].endswith(".py"):
        check_tool(rest[0], rest[1:], world)
    elif rest[:2] == ["-m", "pytest"]:
        for target in rest[2:]:
            if target.startswith("tests"):
                assert (REPO / target.split("::")[0]).exists(), f"{target} does not exist"
    else:
        return False
    return True


COMMANDS = [(page, number, argv) for page in PAGES for number, argv in commands(page)]


@pytest.mark.parametrize(
    "page, number, argv", COMMANDS, ids=[f"{_rel(p)}:{n}" for p, n, _ in COMMANDS]
)
def test_shown_commands_parse(
    page: Path, number: int, argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # commands are shown run from the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    check_command(argv)


def test_commands_are_found() -> None:
    """The extractor sees the README's quick start and everyday commands."""
    readme = {" ".join(argv) for page, _, argv in COMMANDS if page.name == "README.md"}
    assert "moetrain --config configs/tiny.yaml" in readme
    assert "moetrain ablate configs/sweeps/router.yaml --parallel 2" in readme
    checked = sum(check_command(argv) for _, _, argv in COMMANDS if argv[0] != "pip")
    assert checked >= 20, checked


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_commands_are_in_shell_fences(page: Path) -> None:
    """A command in a fence without a language (kept for diagrams, trees and output) would
    escape the checks above: such a fence must be marked ``bash``."""
    found = unlabeled_commands(page)
    problems = [f"{_rel(page)}:{n}: {line!r}: mark the fence bash" for n, line in found]
    assert not problems, "\n".join(problems)


def test_fence_check_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "```\nmoetrain --config configs/tiny.yaml\n```\n```\nroute -> experts\n```\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text)
    page = REPO / "docs" / "_probe.md"
    assert unlabeled_commands(page) == [(2, "moetrain --config configs/tiny.yaml")]
    assert list(commands(page)) == []  # neither fence is a shell fence: the diagram is no command


@pytest.mark.parametrize(
    "argv, error",
    [
        (["moetrain", "--config", "configs/tiny.yaml", "moe.topk=2"], "moe.topk: unknown key"),
        (["moetrain", "moe.top_k=1"], "training needs --config"),
        (
            ["sbatch", "tools/slurm/train.sbatch", "configs/gpu_1b.yaml", "parallel.tp=8"],
            "4 kv heads are not divisible by parallel.tp=8",
        ),
        (
            [
                "moetrain",
                "prepare-data",
                "--config",
                "configs/tiny.yaml",
                "data.datset=x.jsonl",
                "--out",
                "x",
            ],
            "data.datset: unknown key",
        ),  # fmt: skip
        (["moetrain", "no-such-command"], "unknown command"),
        (["moetrain", "ablate"], "SystemExit"),  # the sweep file is required
        (
            [
                "torchrun",
                "--nproc-per-node",
                "4",
                "-m",
                "moetrain.train",
                "--config",
                "configs/tiny.yaml",
            ],
            "train.global_batch_size: 16 is not divisible",
        ),
        (["python", "tools/expert_report.py", "--no-such-option"], "SystemExit"),
        (
            ["python", "tools/comm_report.py", "--nproc", "4", "--config", "configs/tiny.yaml"],
            "train.global_batch_size: 16 is not divisible",
        ),
    ],
)
def test_command_check_can_fail(argv: list[str], error: str, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(BaseException) as info:
        check_command(argv)
    assert error in f"{type(info.value).__name__}: {info.value}", info.value


# ----------------------------------------------------------------------------- TensorBoard tags


def _documented(tag: str, page: str) -> bool:
    """Whether ``tag`` (as a run writes it) appears in the dashboards page: top-level tags
    literally, per-layer tags by their name after ``moe/layer{L}/``, numbered experts and
    collective kinds as ``{e}`` / ``{kind}``."""
    tag = re.sub(r"/expert\d+$", "/expert{e}", tag)
    tag = re.sub(r"^comm/bytes_sent/\w+$", "comm/bytes_sent/{kind}", tag)
    layer = re.fullmatch(r"moe/layer\d+/(.+)", tag)
    return f"`{layer.group(1) if layer else tag}`" in page


def test_every_tensorboard_scalar_is_documented(tmp_path: Path) -> None:
    """A micro run's scalars (past the accounting step) each have a row in dashboards.md."""
    from moetrain.config import load_config
    from moetrain.train.metrics import read_scalars
    from moetrain.train.trainer import Trainer

    cfg = load_config(
        None,
        [
            "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=64",
            "model.max_seq_len=32", "moe.num_experts=4", "moe.expert_ffn_dim=32",
            "moe.token_group_seqs=null", "data.seq_len=16", "train.global_batch_size=2",
            "train.micro_batch_size=2", "train.eval_batches=1", "train.steps=2",
            "log.progress_bar=false", f"train.output_dir={tmp_path}",
        ],
    )  # fmt: skip
    Trainer(cfg).fit()
    tags = sorted(read_scalars(tmp_path))
    assert "perf/mfu" in tags and "moe/layer1/a2a_bytes" in tags and "memory/grad_bytes" in tags
    page = (REPO / "docs" / "dashboards.md").read_text()
    missing = [t for t in tags if not _documented(t, page)]
    assert not missing, f"written to TensorBoard but not in docs/dashboards.md: {missing}"
    assert not _documented("train/no_such_tag", page)


# ----------------------------------------------------------------------------- quoted figures

_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?%?")


def numbers(text: str) -> list[float]:
    """The numbers of ``text`` as values: ``1e-5``, ``1.5e-2``, ``0.1%`` (0.001), ``1,924``."""
    out = []
    for token in _NUMBER.findall(text):
        value = float(token.rstrip("%").replace(",", ""))
        out.append(value / 100 if token.endswith("%") else value)
    return out


def _constant(path: str, name: str) -> Any:
    """The literal a module assigns to ``name``, read from its source (nothing imported)."""
    import ast

    for node in ast.parse((REPO / path).read_text()).body:
        targets = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                   if isinstance(t, ast.Name)]  # fmt: skip
        if name in targets:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} assigns no {name}")


def _tolerance_rows() -> dict[str, list[float]]:
    """parallel.md's tolerance table, row by row, from ``TOLERANCES`` of tests/tolerances.py
    (the fp32 cell, the bf16 one, the "bf16 reordered" one) and ``CLAMPED``."""
    tol, clamped = (
        _constant("tests/tolerances.py", "TOLERANCES"),
        _constant("tests/tolerances.py", "CLAMPED"),
    )
    f, b, r = tol["fp32"], tol["bf16"], tol["bf16 reordered"]
    return {
        "losses, norms, MoE statistics": [f["value"]["atol"], f["value"]["rtol"],
                                          b["value"]["atol"], b["value"]["rtol"],
                                          r["value"]["atol"], r["value"]["rtol"]],
        "first step's gradients": [f["grad"]["first"], b["grad"]["first"], r["grad"]["first"]],
        "later steps' gradients, AdamW moments": [
            f["grad"]["later"], clamped["grad_later"], clamped["param"]["atol"],
            clamped["param"]["rtol"], b["grad"]["later"], r["grad"]["later"]],
        "final parameters": [f["param"]["atol"], f["param"]["rtol"], b["param"]["atol"],
                             b["param"]["rtol"], r["param"]["atol"]],
        "router scores in another histogram bin": [f["hist"]["moved"], b["hist"]["moved"],
                                                   r["hist"]["moved"]],
    }  # fmt: skip


def _table_row(text: str, first_cell: str) -> str:
    """The cells after the first of the table row that starts with ``first_cell``."""
    rows = [line for line in text.splitlines() if line.startswith(f"| {first_cell}")]
    assert len(rows) == 1, f"{len(rows)} rows start with {first_cell!r}"
    return rows[0].split("|", 2)[2]


def _accounting_bytes_sent() -> tuple[float, float, str]:
    """(lowest, highest, layout of the highest) "bytes sent / analytic" of docs/accounting.md,
    the page tests/parallel/test_accounting.py writes from what it measures."""
    page = (REPO / "docs/accounting.md").read_text().split("| layout | model state")[1]
    page = page.split("\n\n")[0].splitlines()  # the first table, model state and traffic
    row = re.compile(r"\| [A-Z].* \| \d\.\d{4} \| \d\.\d{4} \|")
    rows = [line.split("|")[1:-1] for line in page if row.match(line)]
    values = [(float(r[2]), r[0].strip()) for r in rows]
    return min(values)[0], max(values)[0], max(values)[1]


def _gpu_1b() -> dict[str, float]:
    """configs/gpu_1b.yaml's model on the meta device: parameters, FLOPs, analytic memory
    (``analytic_memory`` of tools/bench_e2e.py), the MFU denominator of an H100."""
    import torch

    from moetrain.config import load_config
    from moetrain.model import Transformer
    from moetrain.plan.hardware import GPUS

    cfg = load_config(REPO / "configs" / "gpu_1b.yaml", ["model.vocab_size=4096"])
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.moe)
    state, acts = _load_tool(REPO / "tools" / "bench_e2e.py").analytic_memory(
        cfg, model.num_params()
    )
    return {"total": model.num_params() / 1e9, "active": model.num_params(active=True) / 1e9,
            "gflop": model.flops_per_token(cfg.data.seq_len) / 1e9, "state": state / 1e9,
            "acts": acts / 1e9, "peak": GPUS["h100"].bf16_tflops}  # fmt: skip


def _h100() -> dict[str, float]:
    """The first GPU run's figures (one H100, 2026-11-27) from docs/data/benchmarks.csv, as the
    pages round them: grouped GEMM vs torch._grouped_mm, fused router, permute / unpermute,
    MoE layer / GEMMs, end to end, the kernel tests."""
    import csv

    with (DATA / "benchmarks.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["device"] == "NVIDIA H100 80GB HBM3"
                and r["timestamp"].startswith("2026-11-27")]  # fmt: skip

    def pick(bench: str, impl: str, ops: tuple[str, ...], key: str) -> list[float]:
        return [float(r[key]) for r in rows if r["benchmark"] == bench and r["impl"] == impl
                and r["op"] in ops and r[key] and r["status"] == "ok"]  # fmt: skip

    def one(bench: str, impl: str, op: str, key: str, case: str = "") -> float:
        (v,) = [float(r[key]) for r in rows if r["benchmark"] == bench and r["impl"] == impl
                and r["op"] == op and r["case"].startswith(case) and r[key]]  # fmt: skip
        return v

    gemm = pick("grouped_gemm", "triton", ("fwd", "dgrad", "wgrad"), "ratio_peer")
    peer = pick("grouped_gemm", "torch_gmm", ("fwd", "dgrad", "wgrad"), "tflops")
    router = pick("router", "triton", ("fwd+bwd",), "ratio_peer")
    permute = pick("permute", "triton", ("permute_fwd",), "ratio_ceiling")
    unpermute = pick("permute", "triton", ("unpermute_fwd",), "ratio_ceiling")
    tests = {r["op"]: int(r["value"]) for r in rows if r["benchmark"] == "correctness"
             and r["case"] == "pytest tests/kernels"}  # fmt: skip
    return {
        "gemm_lo": round(min(gemm), 2), "gemm_hi": round(max(gemm), 2),
        "peer_lo": round(min(peer)), "peer_hi": round(max(peer)),
        "router_lo": round(min(router), 2), "router_hi": round(max(router), 1),
        "permute_lo": round(min(permute), 2), "permute_hi": round(max(permute), 2),
        "unpermute_lo": round(min(unpermute), 2), "unpermute_hi": round(max(unpermute), 2),
        "layer_mixtral": round(one("moe_layer", "triton", "layer/gemms", "value", "mixtral"), 2),
        "layer_qwen3": round(one("moe_layer", "triton", "layer/gemms", "value", "qwen3"), 2),
        "step_ms": round(one("e2e", "torch/eager", "step", "ms")),
        "mfu": round(one("e2e", "torch/eager", "mfu", "value"), 3),
        "tokens_s": round(one("e2e", "torch/eager", "tokens_per_s", "value")),
        "peak_gib": round(one("e2e", "torch/eager", "peak_mem_gib", "value"), 1),
        "plan_ratio": round(one("e2e", "torch/eager", "plan_step", "value"), 1),
        "tests_passed": tests["passed"], "tests_failed": tests["failed"],
    }  # fmt: skip


def _tiny_params() -> float:
    """configs/tiny.yaml's parameters, millions (the default tokenizer's 4096 ids)."""
    import torch

    from moetrain.config import load_config
    from moetrain.model import Transformer

    cfg = load_config(REPO / "configs" / "tiny.yaml", ["model.vocab_size=4096"])
    with torch.device("meta"):
        return round(Transformer(cfg.model, cfg.moe).num_params() / 1e6, 1)


def _matrix_layouts() -> float:
    found = re.search(r"(\d+) option factors, (\d+) layouts", (REPO / "docs/matrix.md").read_text())
    return float(found.group(2))


def _sweep(name: str) -> dict[str, dict[str, float]]:
    """A sweep's summary (docs/data/sweeps/<name>_summary.csv, the ``summary.csv`` that
    ``moetrain ablate`` wrote): per run, every numeric column."""
    import csv

    with open(DATA / "sweeps" / f"{name}_summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for row in rows:
        values = {}
        for key, value in row.items():
            try:
                values[key] = float(value)
            except (TypeError, ValueError):
                continue
        out[row["run"]] = values
    return out


def _docs_sweep_caption() -> list[float]:
    """dashboards.md's figures of configs/sweeps/docs.yaml, in the order the caption writes
    them, rounded as it writes them."""
    s = _sweep("docs")
    base, none, bias = s["aux_loss_coef=0.01"], s["aux_loss_coef=0.0"], s["aux-free-bias"]

    def triple(row: dict[str, float], fig: str, scale: float = 1, digits: int = 4) -> list:
        return [round(scale * row[f"{fig}{k}"], digits) for k in ("mean", "lo", "hi")]

    return [
        *triple(base, "eval_loss_"), *triple(none, "eval_loss_"), *triple(bias, "eval_loss_"),
        *triple(none, "eval_loss_diff_"), *triple(bias, "eval_loss_diff_"),
        *triple(none, "dropped_fraction_diff_", 100, 1),
        *triple(bias, "dropped_fraction_diff_", 100, 1),
        -round(none["router_entropy_diff_mean"], 2),
        *triple(none, "router_entropy_diff_", 1, 2)[1:],
        -round(bias["router_entropy_diff_mean"], 2),
        *triple(bias, "router_entropy_diff_", 1, 2)[1:],
    ]  # fmt: skip


def _balancing_table() -> str:
    """moe.md's balancing table: tools/sweep_table.py on the sweep's summary and warnings."""
    tool = _load_tool(REPO / "tools" / "sweep_table.py")
    warnings = json.loads((DATA / "sweeps" / "balancing_warnings.json").read_text())
    summary = DATA / "sweeps" / "balancing_summary.csv"
    return tool.render(summary, warnings, bold="aux-0.01+bias-0.01")


def _quantile_table() -> str:
    """moe.md's quantile-balancing table: tools/sweep_table.py on the sweep's summary and
    warnings."""
    tool = _load_tool(REPO / "tools" / "sweep_table.py")
    warnings = json.loads((DATA / "sweeps" / "quantile_warnings.json").read_text())
    return tool.render(DATA / "sweeps" / "quantile_summary.csv", warnings, bold="quantile")


def _quantile_prose() -> list[float]:
    """The quantile sweep's figures moe.md's prose quotes, in its order, rounded as written."""
    s = _sweep("quantile")

    def diff(run: str, fig: str, scale: float, digits: int) -> list[float]:
        return [round(scale * s[run][f"{fig}_diff_{k}"], digits) for k in ("mean", "lo", "hi")]

    return [
        *diff("quantile", "max_over_mean", 1, 2),
        *diff("quantile", "dropped_fraction", 100, 1),
        *diff("quantile", "eval_loss", 1, 3),
        *diff("quantile-ema-0.9", "max_over_mean", 1, 2),
        *diff("quantile-ema-0.9", "dropped_fraction", 100, 1),
    ]


def _balancing_prose() -> list[float]:
    """The rerun's figures moe.md's prose quotes, in its order, rounded as it writes them."""
    s = _sweep("balancing")

    def diff(run: str, fig: str, scale: float, digits: int) -> list[float]:
        return [round(scale * s[run][f"{fig}_diff_{k}"], digits) for k in ("mean", "lo", "hi")]

    return [
        *diff("aux-0.01+bias-0.01", "dropped_fraction", 100, 1),
        *diff("aux-0.01+bias-0.01", "max_over_mean", 1, 2),
        *diff("aux-0.01+bias-0.02", "max_over_mean", 1, 2),
        *diff("aux-0.01+bias-0.02", "dropped_fraction", 100, 1),
        *diff("aux-0.01+bias-0.05", "dropped_fraction", 100, 1),
    ]


def _balancing_warning_steps() -> list[float]:
    """(first, last) warning step of the peak-lr-3e-3 variants, then the lr-1e-3 one's steps."""
    w = json.loads((DATA / "sweeps" / "balancing_warnings.json").read_text())
    fast = [step for run, v in w.items() if "lr-1e-3" not in run for step in v["steps"]]
    slow = sorted(step for run, v in w.items() if "lr-1e-3" in run for step in v["steps"])
    return [min(fast), max(fast), *slow]


def _plan_check_quotes() -> list[Quote]:
    """docs/plan.md's check of the step estimate (docs/data/plan_check.csv, tools/plan_check.py)
    and docs/kernels.md's measured choices (kernels/measured.py's source, benchmarks.csv)."""
    tool = lambda name: _load_tool(REPO / "tools" / f"{name}.py")  # noqa: E731

    def rows() -> dict[str, dict[str, str]]:
        return {r["variant"]: r for r in tool("plan_check").read_rows(
            str(DATA / "plan_check.csv"))}  # fmt: skip

    def prose() -> list[float]:
        r = rows()
        m, f, p = r["measured code"], r["bf16 experts"], r["measured profile"]
        return [
            float(m["planned_ms"]),
            float(m["planned_over_measured"]),
            float(m["measured_ms"]),
            float(m["expert_GEMMs_ms"]),
            float(p["expert_GEMMs_ms"]),
            float(p["measured_ms"]),
            float(f["planned_ms"]),
        ]

    def choices() -> str:
        kt = tool("kernel_table")
        return kt.render_choices(
            kt.build(kt.bc.read_rows(str(DATA / "benchmarks.csv")))["CHOICES"]
        )

    return [
        Quote(
            "docs/plan.md",
            "docs/data/plan_check.csv (written by tools/plan_check.py)",
            r"(?s)## Checked against the GPU run\n.*?\n\n(\| step of .*?\n)\n",
            lambda: tool("plan_check").render(
                tool("plan_check").read_rows(str(DATA / "plan_check.csv"))
            ),
        ),
        Quote(
            "docs/plan.md",
            "kernels/measured.py (tools/plan_check.py render_rates)",
            r"(?s)\(`python tools/plan_check.py --print`\):\n\n(\| work .*?\n)\n",
            lambda: tool("plan_check").render_rates(),
        ),
        Quote(
            "docs/plan.md",
            "docs/data/plan_check.csv (written by tools/plan_check.py)",
            r"(?s)says \*\*(\S+) ms\*\*, (\S+) of the \*\*(\S+) ms\*\* measured.*?rates, "
            r"(\S+) ms against the (\S+) ms the profile's.*?device time is (\S+) ms of.*?"
            r"checks: (\S+) ms\*\*",
            prose,
        ),
        Quote(
            "docs/kernels.md",
            "docs/data/benchmarks.csv (tools/kernel_table.py --print)",
            r"(?s)sigmoid router over 256 experts.*?:\n\n(\| arch \| op .*?\n)\n",
            choices,
        ),
    ]
def _fp8_convergence() -> list[float]:
    """fp8.md's convergence table (docs/data/ablation_fp8.csv, the FP8 sweep's summary, and
    docs/data/ablation_fp8_curves.csv), in its order, rounded as it writes them: bf16's eval loss;
    per recipe its eval loss, the paired difference, the last 100 steps' mean train-loss
    difference and the percentage of those steps whose interval spans zero."""
    import csv
    import statistics

    with open(DATA / "ablation_fp8.csv", newline="") as f:
        s = {r["run"]: r for r in csv.DictReader(f)}
    with open(DATA / "ablation_fp8_curves.csv", newline="") as f:
        curves = list(csv.DictReader(f))

    def three(run: str, key: str) -> list[float]:
        return [round(float(s[run][f"{key}_{k}"]), 4) for k in ("mean", "lo", "hi")]

    out = three("bf16", "eval_loss")
    for run in ("fp8-tensorwise", "fp8-rowwise"):
        late = [r for r in curves if r["run"] == run and int(r["step"]) > 200]
        gap = statistics.fmean(float(r["train_loss_diff_mean"]) for r in late)
        inside = statistics.fmean(
            float(r["train_loss_diff_lo"]) <= 0 <= float(r["train_loss_diff_hi"]) for r in late
        )
        out += [*three(run, "eval_loss"), *three(run, "eval_loss_diff"), round(gap, 4),
                round(100 * inside)]  # fmt: skip
    return out


OPTIM_FIGURES = ("eval_loss", "dropped_fraction", "max_over_mean", "router_entropy")


def _optim_best() -> str:
    """The Muon variant of configs/sweeps/optim.yaml with the lowest mean final eval loss."""
    muon = {run: v for run, v in _sweep("optim").items() if run.startswith("muon")}
    return min(muon, key=lambda run: muon[run]["eval_loss_mean"])


def _optim_table() -> str:
    """optim.md's sweep table: tools/sweep_table.py on the sweep's summary, the best Muon lr
    in bold."""
    tool = _load_tool(REPO / "tools" / "sweep_table.py")
    return tool.render(DATA / "sweeps" / "optim_summary.csv", None,
                       bold=_optim_best(), figures=OPTIM_FIGURES)  # fmt: skip


def _optim_prose() -> list[float]:
    """The figures optim.md's prose quotes, in its order, rounded as it writes them: the best
    Muon lr, its eval loss minus AdamW's (mean and interval), then its dropped-token points,
    max/mean and router-entropy differences (mean and interval each)."""
    s = _sweep("optim")
    best = s[_optim_best()]

    def diff(fig: str, scale: float, digits: int) -> list[float]:
        return [round(scale * best[f"{fig}_diff_{k}"], digits) for k in ("mean", "lo", "hi")]

    return [
        best["optim.lr"], *diff("eval_loss", 1, 3), *diff("dropped_fraction", 100, 2),
        *diff("max_over_mean", 1, 3), *diff("router_entropy", 1, 3),
    ]  # fmt: skip


def _ep_overlap_prose() -> list[float]:
    """The ep=2 figures the prose of docs/expert_parallel.md names: the bandwidth rows the
    wire sets (their slowest-first bound, the least and most hidden), the latency rows'
    hidden shares, the combine phase, the plan's worst error, the no-delay wait per
    transfer and ep=4's no-delay waits."""
    record = json.loads((DATA / "ep_overlap.json").read_text())
    tool = _load_tool(REPO / "tools" / "bench_ep_overlap.py")
    rows = {(r["ep"], r["wire"]): r for r in record["rows"]}
    errors = tool.plan_errors(record)
    checked = {wire for wire, _ in errors}
    bandwidth = [r for r in record["rows"] if r["ep"] == 2 and r["mbps"] and r["wire"] in checked]
    base = rows[(2, "no delay")]
    own = tool.own_wait(record)
    return [max(r["mbps"] for r in bandwidth), round(100 * min(r["hidden"] for r in bandwidth)),
            round(100 * max(r["hidden"] for r in bandwidth)),
            round(100 * rows[(2, "5 ms")]["hidden"]), round(100 * rows[(2, "10 ms")]["hidden"]),
            round(base["phases"]["combine"] * 1e3, 1), round(100 * max(errors.values())),
            round(own * 1e3, 1), round(rows[(4, "no delay")]["exposed_plain_s"] * 1e3)]


def _plan_overlap_prose() -> list[float]:
    """docs/plan.md's "Hiding the expert all-to-all": how much less of each run's expert
    all-to-all the halves leave exposed than the plain schedule, then the share of its step
    they save."""
    import csv

    with open(DATA / "plan_overlap.csv", newline="") as f:
        rows = {(r["run"], r["schedule"]): r for r in csv.DictReader(f)}
    runs = ["DeepSeek-V3 671B", "Qwen3-30B-A3B"]

    def share(run: str, key: str) -> float:
        return 1 - float(rows[(run, "halves")][key]) / float(rows[(run, "plain")][key])

    return [round(100 * share(r, "ep_exposed_s")) for r in runs] + [
        round(100 * share(r, "step_s")) for r in runs]


@dataclass(frozen=True)
class Quote:
    """A figure a page quotes and where it comes from. ``pattern`` finds the quote on the
    page (its first group: the text holding the figures); ``expected`` reads the figures
    from the source now, as numbers, rounded as the page writes them, or the exact text."""

    page: str
    source: str
    pattern: str
    expected: Callable[[], list[float] | str]


QUOTES = [
    Quote("README.md", "tests/interop/test_families.py (LOGIT_ATOL)",
          r"fp32 logits within (\S+) of transformers'",
          lambda: [_constant("tests/interop/test_families.py", "LOGIT_ATOL")]),
    Quote("docs/interop.md", "tests/interop/test_families.py (LOGIT_ATOL)",
          r"gives transformers' logits within (\S+) \(`LOGIT_ATOL`",
          lambda: [_constant("tests/interop/test_families.py", "LOGIT_ATOL")]),
    Quote("docs/interop.md", "tests/interop/test_self_contained.py (LOGIT_ATOL)",
          r"moetrain's within (\S+) \(`LOGIT_ATOL`\)",
          lambda: [_constant("tests/interop/test_self_contained.py", "LOGIT_ATOL")]),
    Quote("README.md", "configs/tiny.yaml (the model on the meta device)",
          r"the default run: a (\S+)M-parameter MoE", lambda: [_tiny_params()]),
    Quote("README.md", "docs/matrix.md (written by tests/parallel/test_matrix.py)",
          r"crossed with (\d+) layouts", lambda: [_matrix_layouts()]),
    Quote("docs/parallel.md", "docs/matrix.md (written by tests/parallel/test_matrix.py)",
          r"-- with (\d+) layouts", lambda: [_matrix_layouts()]),
    *[Quote("docs/parallel.md", "tests/tolerances.py (TOLERANCES, CLAMPED)",
            rf"(?m)^\| {re.escape(row)}[^|]*(\|.*)$", lambda row=row: _tolerance_rows()[row])
      for row in ("losses, norms, MoE statistics", "first step's gradients",
                  "later steps' gradients, AdamW moments", "final parameters",
                  "router scores in another histogram bin")],
    Quote("docs/parallel.md", "docs/accounting.md (written by tests/parallel/test_accounting.py)",
          r"The bytes-sent ratios sit (between \S+ and \S+ \([^)]*\))",
          lambda: f"between {_accounting_bytes_sent()[0]:.4f} and "
                  f"{_accounting_bytes_sent()[1]:.4f} ({_accounting_bytes_sent()[2]})"),
    Quote("docs/moe.md", "docs/data/default_run.json (written by tools/run_figures.py)",
          r"(?s)\*\*The default, 500 steps\*\*.*?\n\n(\| \| \|\n.*?\n)\n",
          lambda: _load_tool(REPO / "tools" / "run_figures.py").render_table(
              json.loads((DATA / "default_run.json").read_text()))),
    Quote("docs/dashboards.md", "docs/data/sweeps/docs_summary.csv (moetrain ablate's summary)",
          r"(?s)\(the baseline\) (\S+ \[\S+ \S+\]), no aux loss (\S+ \[\S+ \S+\]),\s+aux-loss-free "
          r"bias \(rate 0\.002\) (\S+ \[\S+ \S+\]);.*?\((\S+ \[\S+ \S+\]) and (\S+ \[\S+ \S+\])\),"
          r".*?aux loss (\S+) points more.*?\((\[\S+ \S+\])\), with the\s+bias (\S+) points "
          r"\((\[\S+ \S+\])\)\. The router entropy is not: (\S+) lower without the aux loss\s+"
          r"\((\[\S+ \S+\])\), (\S+) lower with the bias \((\[\S+ \S+\])\)",
          _docs_sweep_caption),
    Quote("docs/moe.md", "docs/data/sweeps/balancing_summary.csv and _warnings.json (sweep_table)",
          r"(?s)fails when the table below is not that\.\n\n(\| variant .*?\n)\n",
          _balancing_table),
    Quote("docs/moe.md", "docs/data/sweeps/quantile_summary.csv and _warnings.json (sweep_table)",
          r"(?s)renders the quantile sweep's table from the two\.\n\n(\| variant .*?\n)\n",
          _quantile_table),
    Quote("docs/moe.md", "docs/data/sweeps/quantile_summary.csv (moetrain ablate's summary)",
          r"(?s)below the switch loss beyond noise: max/mean\s+(\S+) (\[\S+ \S+\]), dropped (\S+) "
          r"points (\[\S+ \S+\]), at the same eval loss\s+\((\S+) (\[\S+ \S+\]), within noise\)"
          r".*?above the switch loss on both \(max/mean (\S+)\s+(\[\S+ \S+\]), dropped (\S+) "
          r"points (\[\S+ \S+\])\)", _quantile_prose),
    Quote("docs/moe.md", "docs/data/sweeps/balancing_summary.csv (moetrain ablate's summary)",
          r"(?s)differences are\s+within noise on every figure \(dropped (\S+) points "
          r"(\[\S+ \S+\]),\s+max/mean (\S+) (\[\S+\s+\S+\])\),.*?beyond noise on both "
          r"\(max/mean (\S+)\s+(\[\S+ \S+\]), dropped (\S+) (\[\S+ \S+\])\),"
          r".*?still drops more \((\S+)\s+points (\[\S+ \S+\])\)", _balancing_prose),
    Quote("docs/moe.md", "docs/data/sweeps/balancing_warnings.json (sweep_table --log)",
          r"(?s)routes each batch to one expert: at steps (\S+)-(\S+) of the runs with a peak lr "
          r"of 3e-3, at steps\s+(\S+) and (\S+) with a peak lr", _balancing_warning_steps),
    Quote("docs/fp8.md", "docs/data/ablation_fp8.csv and _curves.csv (the FP8 sweep's outputs)",
          r"(?s)\| bf16 \| (\S+ \[\S+ \S+\]) \|.*?\| FP8 tensorwise \| (\S+ \[\S+ \S+\]) \| "
          r"(\S+ \[\S+ \S+\])[^|]*\| (\S+) \| (\S+)% \|\n\| FP8 rowwise \| (\S+ \[\S+ \S+\]) \| "
          r"(\S+ \[\S+ \S+\])[^|]*\| (\S+) \| (\S+)% \|", _fp8_convergence),
    Quote("docs/optim.md",
          "docs/data/sweeps/optim_summary.csv (moetrain ablate's summary, sweep_table)",
          r"(?s)renders it from the summary\.\n\n(\| variant .*?\n)\n", _optim_table),
    Quote("docs/optim.md", "docs/data/sweeps/optim_summary.csv (moetrain ablate's summary)",
          r"(?s)Muon at its best lr \((\S+)\) ends (\S+ \[\S+ \S+\]) nats from AdamW.*?"
          r"dropped tokens (\S+ \[\S+ \S+\]) points, max/mean (\S+ \[\S+ \S+\]), router "
          r"entropy (\S+ \[\S+ \S+\])", _optim_prose),
    Quote("docs/optim.md", "docs/data/qk_clip.json (written by tools/qk_clip_runs.py)",
          r"(?s)with QK-clip\.\n\n(\| run \| largest logit.*?\n\ntau = [^\n]*\n)",
          lambda: _load_tool(REPO / "tools" / "qk_clip_runs.py").table(
              json.loads((DATA / "qk_clip.json").read_text())) + "\n"),
    Quote("docs/optim.md", "docs/data/muon_owners.json (written by tools/bench_muon.py)",
          r"(?s)own whole experts\):\n\n(\| layout \| mode \|.*?\n\n[^\n]* steps\.\n)",
          lambda: _load_tool(REPO / "tools" / "bench_muon.py").table(
              json.loads((DATA / "muon_owners.json").read_text()))),
    Quote("docs/plan.md", "docs/data/plan_overlap.csv (tools/plan_overlap.py)",
          r"(?s)the halves expose (\S+)% less of DeepSeek-V3's\s+expert all-to-all and (\S+)% "
          r"less of Qwen3-30B-A3B's, worth (\S+)% and (\S+)% of their steps",
          lambda: _plan_overlap_prose()),
    Quote("docs/expert_parallel.md", "docs/data/ep_overlap.json (tools/bench_ep_overlap.py)",
          r"(?s)step times' growth:\n\n(\| ep \| wire.*?\n\n[^\n]* steps, [^\n]*\n)",
          lambda: _load_tool(REPO / "tools" / "bench_ep_overlap.py").table(
              json.loads((DATA / "ep_overlap.json").read_text()))),
    Quote("docs/expert_parallel.md", "docs/data/ep_overlap.json (tools/bench_ep_overlap.py)",
          r"(?s)at ep=2, from (\S+) MB/s down, the halves hide (\S+)% to (\S+)% .*? hide (\S+)% "
          r"at 5 ms and (\S+)% at\s+10 ms.*?combine \(about (\S+) ms here\).*?within (\S+)% of "
          r"the measured.*?\(about (\S+) ms here:.*?waits alone are (\S+) ms",
          lambda: _ep_overlap_prose()),
    Quote("docs/gpu.md", "configs/gpu_1b.yaml (the model on the meta device)",
          r"\*\*(\S+)B parameters, (\S+)B active per token, (\S+) GFLOP per trained",
          lambda: [round(_gpu_1b()[k], n) for k, n in (("total", 3), ("active", 3),
                                                       ("gflop", 2))]),
    Quote("docs/gpu.md", "configs/gpu_1b.yaml and analytic_memory of tools/bench_e2e.py",
          r"(?s)per parameter \(fp32 weights.*?\*\*(\S+) GB\*\*.*?are \*\*(\S+) GB\*\*",
          lambda: [round(_gpu_1b()["state"], 1), round(_gpu_1b()["acts"], 1)]),
    Quote("docs/plan.md", "docs/data/startup_memory.csv (written by tools/startup_memory.py)",
          r"(?s)## Start-up, measured\n.*?\n\n(\| code \| layout .*?\n)\n",
          lambda: _load_tool(REPO / "tools" / "startup_memory.py").render(
              _load_tool(REPO / "tools" / "startup_memory.py").read_rows())),
    Quote("docs/gpu.md", "docs/data/benchmarks.csv (the H100 rows of 2026-11-27)",
          r"(?s)grouped GEMM ran at (\S+)x to (\S+)x of `torch._grouped_mm`.*?itself\s+(\S+) to "
          r"(\S+) TFLOP/s\);.*?at (\S+)x to (\S+)x of the unfused.*?permute at (\S+) to (\S+) of "
          r"the measured copy bandwidth, unpermute at (\S+) to\s+(\S+) \(",
          lambda: [_h100()[k] for k in ("gemm_lo", "gemm_hi", "peer_lo", "peer_hi", "router_lo",
                                        "router_hi", "permute_lo", "permute_hi", "unpermute_lo",
                                        "unpermute_hi")]),
    Quote("docs/gpu.md", "docs/data/benchmarks.csv (the H100 rows of 2026-11-27)",
          r"(?s)\*\*(\S+) MFU\*\*\s+\((\S+) ms a step, (\S+) tokens/s, (\S+) GiB peak\), (\S+) "
          r"times the step",
          lambda: [_h100()[k] for k in ("mfu", "step_ms", "tokens_s", "peak_gib", "plan_ratio")]),
    Quote("docs/gpu.md", "docs/data/benchmarks.csv (the H100 rows of 2026-11-27)",
          r"counted (\d+) passed and (\d+) failed",
          lambda: [_h100()["tests_passed"], _h100()["tests_failed"]]),
    Quote("docs/gpu.md", "docs/data/benchmarks.csv (the H100 rows of 2026-11-27)",
          r"(?s)The MoE layer took (\S+) times its grouped GEMMs' time on\s+Mixtral and (\S+) "
          r"times on Qwen3-30B-A3B",
          lambda: [_h100()[k] for k in ("layer_mixtral", "layer_qwen3")]),
    Quote("docs/kernels.md", "docs/data/kernels_compiled_oldest.csv (tools/kernels_compiled.py)",
          r"The record holds (\d+) compiled kernel variants",
          lambda: [len((DATA / "kernels_compiled_oldest.csv").read_text().splitlines())
                   - 1]),
    Quote("docs/fp8.md", "docs/data/fp8_error.csv (tests/kernels/test_kernels_fp8.py)",
          r"\| grouped \| tensorwise \| (\S+) \| (\S+) \| (\S+) \|",
          lambda: [float(line.rsplit(",", 1)[1]) for line
                   in (DATA / "fp8_error.csv").read_text().splitlines()
                   if line.startswith("grouped,tensorwise,")]),
    Quote("docs/gpu.md", "GPUS of moetrain/plan/hardware.py (the MFU denominator)",
          r"datasheet bf16 peak, (\S+) TFLOP/s for an H100", lambda: [_gpu_1b()["peak"]]),
    *_plan_check_quotes(),
]  # fmt: skip


UNCHECKED = {
    "docs/moe.md": "the early_routing screen's table and the forward-hook study before it, and "
    "the per-step token shares and the chosen variant's differences of the balancing run that "
    "chose the default: run before sweep summaries were kept beside the docs, on code that has "
    "changed since (the balancing screen's rerun is checked; the early_routing screen takes "
    "hours of CPU to repeat)",
}
"""Figures a page quotes that no file backs, with why: named on the page itself (it says
`UNCHECKED`), never silently. Figures added since are quoted from a file, in ``QUOTES``."""


def test_unchecked_figures_say_so() -> None:
    for page in UNCHECKED:
        assert "`UNCHECKED`" in (REPO / page).read_text(), f"{page} does not say which figures"


def quote_problems(quote: Quote, text: str | None = None) -> list[str]:
    """What differs between ``quote``'s page and its source (``text``: the page, if given)."""
    text = (REPO / quote.page).read_text() if text is None else text
    found = re.search(quote.pattern, text)
    if found is None:
        return [f"{quote.page}: no quote matches {quote.pattern!r} (rephrased? update QUOTES)"]
    quoted = "".join(found.groups())
    want = quote.expected()
    if isinstance(want, str):
        same = quoted.strip() == want.strip()
    else:
        got = numbers(" ".join(found.groups()))
        same = len(got) == len(want) and all(math.isclose(a, b, rel_tol=1e-9) for a, b in
                                             zip(got, want, strict=True))  # fmt: skip
    if same:
        return []
    return [f"{quote.page} quotes {quoted.strip()!r}, but {quote.source} says {want!r}"]


@pytest.mark.parametrize("quote", QUOTES, ids=[f"{q.page}:{q.source.split()[0]}" for q in QUOTES])
def test_quoted_figures_match_their_sources(quote: Quote) -> None:
    problems = quote_problems(quote)
    assert not problems, "\n".join(problems)


def test_a_stale_figure_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check fails when the page changes (README's old "1e-6" tolerance) and when the
    source changes (a rerun whose eval loss differs, in docs/data/default_run.json)."""
    readme = QUOTES[0]
    text = (REPO / readme.page).read_text()
    stale = text.replace("fp32 logits within 1e-5", "fp32 logits within 1e-6")
    assert stale != text
    assert quote_problems(readme, stale) == [
        "README.md quotes '1e-6', but tests/interop/test_families.py (LOGIT_ATOL) says [1e-05]"
    ]
    table = next(q for q in QUOTES if q.page == "docs/moe.md")
    data = json.loads((DATA / "default_run.json").read_text())
    last = list(data["figures"]["eval_loss"])[-1]
    data["figures"]["eval_loss"][last] += 0.01
    (tmp_path / "default_run.json").write_text(json.dumps(data))
    original = Path.read_text

    def read(self: Path, *args: Any, **kwargs: Any) -> str:
        if self == DATA / "default_run.json":
            return original(tmp_path / "default_run.json", *args, **kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read)
    problems = quote_problems(table)
    assert len(problems) == 1 and "eval loss at steps" in problems[0], problems
