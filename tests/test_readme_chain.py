"""The README's commands, run for real in the order a new user runs them.

The commands are read from README.md's shell blocks (``tests/doc_commands.py``), so the
test follows the README: the quick start's training, running it again (nothing to train:
exit 2), an override example in its own ``train.output_dir`` and the same without it (the
resume is refused, naming the key), the torchrun example, ``--print-config``, the HTML
report, a router ablation sweep, prepare-data on a JSON-lines file and training on the
prepared data, the offline ablation, generate, export-hf and a transformers load of the
export whose logits must equal moetrain's (``LOGIT_ATOL``).

What it substitutes, and nothing else: **sizes** (``MICRO``: a 2-layer, width-32 model, a
few steps of 4 sequences of 32 tokens, appended as overrides so they win over the README's
and the configs' values; ``--parallel 1`` for the sweep, whose ten runs would otherwise each
start an interpreter) and **paths** (everything runs in a scratch directory holding links to
``configs/`` and ``tools/``, ``big.jsonl`` is a small file of short documents, and the
README's ``train.output_dir`` is removed once to show the refusal). The README's
``tensorboard`` (a viewer), its 8-process torchrun layout (the equivalence matrix runs it,
tests/parallel/) and the GPU suite (tests/tools/test_gpu_suite.py dry-runs it) are not run
here; a README command this test neither runs nor lists as not run fails it.

Cost: about a minute on 2 CPU cores (the quick start and the torchrun example start their
own interpreters; everything else runs in this process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from doc_commands import commands

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
LOGIT_ATOL = 1e-5
"""fp32 max abs logit error of an export against moetrain's model (tests/interop)."""

MICRO = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
    "model.ffn_dim=64", "model.max_seq_len=32", "moe.num_experts=4", "moe.expert_ffn_dim=32",
    "moe.token_group_seqs=2", "data.seq_len=32", "train.steps=1", "train.global_batch_size=4",
    "train.micro_batch_size=2", "train.eval_every=1", "train.eval_batches=1",
    "train.checkpoint_every=1", "optim.warmup_steps=1", "log.log_every=1",
    "log.progress_bar=false",
]  # fmt: skip
"""The sizes this test substitutes: appended to every training, sweep and prepare-data
command (later overrides win)."""

NOT_RUN = {
    "tensorboard": "a viewer of the event files the runs write",
    "torchrun --nproc-per-node 8": "the 8-process layout: tests/parallel/ runs it",
    "bash tools/gpu_suite.sh": "needs a GPU: tests/tools/test_gpu_suite.py dry-runs it",
    "pip": "the environment this test runs in",
    "git": "the checkout this test runs in",
    "python3 -m venv": "the environment this test runs in",
    "python -m pytest": "this very suite",
    "cd ": "the checkout this test runs in",
    ". ": "the environment this test runs in",
}


def readme_commands() -> list[list[str]]:
    return [argv for _, argv in commands(README)]


def find(*words: str, exact: bool = False) -> list[str]:
    """The one README command that starts with ``words`` (is ``words``, with ``exact``)."""
    found = [argv for argv in readme_commands()
             if (argv == list(words) if exact else argv[: len(words)] == list(words))]  # fmt: skip
    assert len(found) == 1, f"README: {len(found)} commands start with {' '.join(words)}"
    return found[0]


def _ran_or_listed(argv: list[str], ran: list[list[str]]) -> bool:
    line = " ".join(argv)
    return argv in ran or any(line.startswith(prefix) for prefix in NOT_RUN)


def _moetrain_script() -> list[str]:
    script = Path(sys.executable).with_name("moetrain")
    return [str(script)] if script.exists() else [sys.executable, "-m", "moetrain"]


def _sized(argv: list[str]) -> list[str]:
    """``argv`` with the sizes appended (an ablate or train command's overrides)."""
    return [*argv, *MICRO]


def _in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``moetrain ARGV`` or ``python tools/X.py ARGV`` in this process."""
    capsys.readouterr()
    if argv[0] == "moetrain":
        from moetrain.cli import main

        code = main(argv[1:])
    else:
        assert argv[0] == "python" and argv[1].startswith("tools/"), argv
        import importlib.util

        spec = importlib.util.spec_from_file_location(f"_chain_{Path(argv[1]).stem}", argv[1])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        result = module.main(argv[2:])
        code = result if isinstance(result, int) else 0
    out, err = capsys.readouterr()
    return code, out, err


def _write_jsonl(path: Path, n: int = 400) -> None:
    """A small JSON-lines corpus: the first ``n`` short documents of the embedded corpus's
    prose (the tests' short-document dataset)."""
    from short_docs import short_docs_dataset

    with open(short_docs_dataset()) as src, open(path, "w") as dst:
        for _, line in zip(range(n), src, strict=False):
            dst.write(line)


@pytest.mark.slow
def test_the_readme_chain_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("configs", "tools"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1"}
    ran: list[list[str]] = []
    clock, laps = [time.perf_counter()], []

    def lap(what: list[str]) -> None:  # seconds per command: the test's cost by part
        now = time.perf_counter()
        laps.append(f"{now - clock[0]:6.1f} s  {' '.join(what)[:90]}")
        clock[0] = now

    # Quick start, through the console script a user types.
    quick = find("moetrain", "--config", "configs/tiny.yaml", exact=True)
    run = subprocess.run([*_moetrain_script(), *_sized(quick)[1:]], capture_output=True,
                         text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "outputs/tiny/checkpoints/step_00000001/manifest.json").is_file()
    assert "done: eval loss" in run.stdout
    ran.append(quick)
    lap(quick)

    # The same command again: a finished run has nothing to train, and says so.
    code, _, err = _in_process(_sized(quick), capsys)
    assert code == 2 and "nothing to train" in err, err

    # The override example writes its own run; without its train.output_dir (a path: the one
    # substitution of meaning) it would resume the quick start's run, and is refused.
    override = next(
        a for a in readme_commands()
        if a[0] == "moetrain" and "moe.top_k=1" in a and "--print-config" not in a
    )  # fmt: skip
    code, out, err = _in_process(_sized(override), capsys)
    assert code == 0, err
    own = next(w.split("=", 1)[1] for w in override if w.startswith("train.output_dir="))
    assert (tmp_path / own / "checkpoints/step_00000001").is_dir()
    ran.append(override)
    lap(override)
    shared = [w for w in override if not w.startswith("train.output_dir=")]
    code, _, err = _in_process(_sized(shared), capsys)
    assert code == 2 and "moe.top_k 2 -> 1" in err, err
    assert "train.resume_allow_changes=[moe.top_k" in err, err

    # The torchrun example, launched as written (one process).
    launch = find("torchrun", "--nproc-per-node", "1")
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run([str(torchrun) if torchrun.exists() else "torchrun",
                          *_sized(launch)[1:]], capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    ran.append(launch)
    lap(launch)

    show = next(a for a in readme_commands() if "--print-config" in a)
    code, out, _ = _in_process(show, capsys)
    assert code == 0 and "  top_k: 1\n" in out
    ran.append(show)
    lap(show)

    report = find("python", "tools/expert_report.py")
    code, _, err = _in_process(report, capsys)
    assert code == 0 and (tmp_path / "report.html").stat().st_size > 10_000, err
    ran.append(report)
    lap(report)

    sweep = find("moetrain", "ablate")
    serial = list(sweep)
    if "--parallel" in serial:
        serial[serial.index("--parallel") + 1] = "1"
    code, _, err = _in_process(_sized(serial), capsys)
    assert code == 0, err
    results = tmp_path / "outputs/sweeps/router/results.csv"
    assert len(results.read_text().splitlines()) == 1 + 10  # a row per variant
    ran.append(sweep)
    lap(sweep)

    # Your own data: prepare it, train on it.
    prepare = find("moetrain", "prepare-data")
    big = next(w.split("=", 1)[1] for w in prepare if w.startswith("data.dataset="))
    _write_jsonl(tmp_path / big)
    code, _, err = _in_process(_sized(prepare), capsys)
    assert code == 0, err
    ran.append(prepare)
    lap(prepare)
    prepared = prepare[prepare.index("--out") + 1]
    on_prepared = next(a for a in readme_commands()
                       if a[0] == "moetrain" and f"data.dataset={prepared}" in a)  # fmt: skip
    code, _, err = _in_process(_sized(on_prepared), capsys)
    assert code == 0, err
    ran.append(on_prepared)
    lap(on_prepared)

    offline = find("python", "tools/offline_ablation.py")
    code, _, err = _in_process(offline, capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "offline_ablation/ablation.json").read_text())
    ran.append(offline)
    lap(offline)

    gen = find("moetrain", "generate")
    code, out, err = _in_process(gen, capsys)
    prompt = gen[gen.index("--prompt") + 1]
    assert code == 0 and out.startswith(prompt) and len(out) > len(prompt) + 1, err
    ran.append(gen)
    lap(gen)

    export = find("moetrain", "export-hf")
    code, _, err = _in_process(export, capsys)
    assert code == 0, err
    ran.append(export)
    lap(export)
    _check_export(tmp_path / export[2], tmp_path / export[3])
    lap(["transformers load of the export"])

    # Planning runs the published configs at their sizes (meta device: nothing allocated).
    for plan in [a for a in readme_commands() if a[:2] == ["moetrain", "plan"]]:
        code, out, err = _in_process(plan, capsys)
        assert code in (0, 1), err  # 1: the layout does not fit, which plan says
        shows = "fastest that fit" if "--search" in plan else "memory per rank"
        assert shows in out, out[-2000:]
        ran.append(plan)
        lap(plan)
    print("\n".join(laps))

    missing = [" ".join(a) for a in readme_commands() if not _ran_or_listed(a, ran)]
    assert not missing, f"README commands this test neither runs nor lists in NOT_RUN: {missing}"


def _check_export(run: Path, hf_dir: Path) -> None:
    """transformers loads the export and gives moetrain's logits (dropless, as inference)."""
    from transformers import AutoModelForCausalLM

    from moetrain.interop.checkpoints import checkpoint_info, load_model

    info = checkpoint_info(run)
    info.moe.capacity_factor = info.moe.token_group_seqs = None
    ours = load_model(info).eval()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
    tokens = torch.randint(
        0, info.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        err = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert err <= LOGIT_ATOL, err


def test_the_chain_finds_every_command_it_runs() -> None:
    """Cheap: the commands the chain looks for are in the README, one each (a renamed or
    removed README command fails here before the slow test runs)."""
    find("moetrain", "--config", "configs/tiny.yaml", exact=True)
    for words in (("torchrun", "--nproc-per-node", "1"), ("python", "tools/expert_report.py"),
                  ("moetrain", "ablate"), ("moetrain", "prepare-data"),
                  ("python", "tools/offline_ablation.py"), ("moetrain", "generate"),
                  ("moetrain", "export-hf")):  # fmt: skip
        find(*words)


WALKTHROUGH = REPO / "docs" / "your_data.md"


def _write_corpus(folder: Path, n: int = 600) -> None:
    """A folder of two JSON-lines files of short documents (the tests' short-document set)."""
    from short_docs import short_docs_dataset

    folder.mkdir()
    lines = Path(short_docs_dataset()).read_text().splitlines()[:n]
    for i, part in enumerate((lines[: n // 2], lines[n // 2 :])):
        (folder / f"part-{i:03d}.jsonl").write_text("\n".join(part) + "\n")


@pytest.mark.slow
def test_the_walkthrough_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/your_data.md, every command in order, on a folder of 600 short documents: sizes
    substituted as above (``MICRO`` appended to the commands that train or prepare), nothing
    else. About 30 s on 2 CPU cores."""
    for name in ("configs", "tools"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    steps = [argv for _, argv in commands(WALKTHROUGH)]
    prepare = next(a for a in steps if a[:2] == ["moetrain", "prepare-data"])
    folder = next(w.split("=", 1)[1] for w in prepare if w.startswith("data.dataset="))
    _write_corpus(tmp_path / folder)
    ran = []
    for argv in steps:
        if any(" ".join(argv).startswith(prefix) for prefix in NOT_RUN):
            continue
        trains = argv[0] == "moetrain" and (argv[1] in ("ablate", "prepare-data")
                                            or argv[1] == "--config")  # fmt: skip
        code, out, err = _in_process(_sized(argv) if trains else argv, capsys)
        assert code == 0, f"{' '.join(argv)}: {err}"
        ran.append(argv[:2])
        if argv[:2] == ["moetrain", "generate"]:
            assert out.startswith(argv[argv.index("--prompt") + 1]), out
    assert [a[1] for a in ran] == [
        "prepare-data", "--config", "tools/expert_report.py", "ablate",
        "tools/expert_report.py", "export-hf", "generate", "generate",
    ]  # fmt: skip
    sweep = next(a for a in steps if a[:2] == ["moetrain", "ablate"])
    results = tmp_path / sweep[sweep.index("--out") + 1] / "results.csv"
    assert len(results.read_text().splitlines()) == 3  # top-1 and top-2
    export = next(a for a in steps if a[:2] == ["moetrain", "export-hf"])
    _check_export(tmp_path / export[2], tmp_path / export[3])
