"""CUDA-only code paths: each one runs in a CPU test with a fake, or docs/cuda_paths.md lists
it as untested on CPU with its reason.

The scan reads the package's source (moetrain/ and kernels/) and finds every CUDA-only site:
`torch.cuda.*` / `torch.backends.cuda*` use, a comparison with or a value of the strings
"cuda" and "nccl", `non_blocking=` and `pin_memory` (asynchronous copies from pinned memory),
`.record_stream`, `.cuda()`, `torch.Stream` / `torch.Event`. Sites are grouped per function;
the docs table must name every function that has one, with exactly its sites, and say which
test below fakes it or why it is untested. A new CUDA branch that is in neither fails here.
"""

from __future__ import annotations

import ast
import functools
import re
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cuda_paths.md"
PACKAGE_DIRS = ("moetrain", "kernels")

CUDA_STRINGS = {"cuda", "nccl"}
CUDA_MODULES = ("torch.cuda", "torch.backends.cuda", "torch.backends.cudnn")
CUDA_NAMES = {"torch.Stream", "torch.Event"}
CUDA_KEYWORDS = {"non_blocking", "pin_memory"}
CUDA_METHODS = {"pin_memory", "record_stream", "cuda"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


class _Scanner(ast.NodeVisitor):
    """Collects {qualified function name: {site tokens}} from one module."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.sites: dict[str, set[str]] = {}

    def _add(self, token: str) -> None:
        self.sites.setdefault(".".join(self.scope) or "<module>", set()).add(token)

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)
        # Annotations name types, they do not branch (`device: Literal["cpu", "cuda"]`).
        for child in ast.iter_child_nodes(node):
            if child is not getattr(node, "returns", None):
                self.visit(child)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_arg(self, node: ast.arg) -> None:
        pass  # an argument's annotation

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value in CUDA_STRINGS:
            self._add(f'"{node.value}"')

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = _dotted(node)
        if name and (name in CUDA_NAMES or any(name == m or name.startswith(m + ".")
                                               for m in CUDA_MODULES)):  # fmt: skip
            self._add(name)
            return  # the longest chain only: torch.cuda.synchronize, not torch.cuda too
        if node.attr in CUDA_METHODS:
            self._add(f".{node.attr}")
        self.generic_visit(node)

    def visit_keyword(self, node: ast.keyword) -> None:
        if node.arg in CUDA_KEYWORDS:
            self._add(f"{node.arg}=")
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and any(node.module.startswith(m) for m in CUDA_MODULES):
            self._add(f"from {node.module} import")


def scan_source(source: str) -> dict[str, set[str]]:
    scanner = _Scanner()
    scanner.visit(ast.parse(source))
    return scanner.sites


@functools.cache
def _scan_package() -> dict[tuple[str, str], frozenset[str]]:
    found = {}
    for top in PACKAGE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for func, tokens in scan_source(path.read_text()).items():
                found[(rel, func)] = frozenset(tokens)
    return found


def scan_package() -> dict[tuple[str, str], set[str]]:
    """{(file relative to the repo, function): {site tokens}} over the whole package."""
    return {key: set(tokens) for key, tokens in _scan_package().items()}


ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*`([^`]+)`\s*\|(.*)\|(.*)\|\s*$")


def documented() -> dict[tuple[str, str], tuple[set[str], str]]:
    """The docs table: {(file, function): ({site tokens}, how it is covered)}."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            tokens = set(re.findall(r"`([^`]+)`", m.group(3)))
            rows[(m.group(1), m.group(2))] = (tokens, m.group(4).strip())
    return rows


TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def coverage_problems(
    found: dict[tuple[str, str], set[str]], doc: dict[tuple[str, str], tuple[set[str], str]]
) -> list[str]:
    """What keeps the docs table from matching the scan (empty when it matches)."""
    problems = []
    for key, tokens in sorted(found.items()):
        where = f"{key[0]}::{key[1]}"
        if key not in doc:
            problems.append(f"{where}: CUDA-only code {sorted(tokens)} is not in {DOC.name}: "
                            "fake it in a CPU test or list it as untested")  # fmt: skip
            continue
        listed, how = doc[key]
        if listed != tokens:
            problems.append(f"{where}: the scan finds {sorted(tokens)}, {DOC.name} lists "
                            f"{sorted(listed)}")  # fmt: skip
        refs = TEST_REF.findall(how)
        if not refs and not how.startswith("untested on CPU:"):
            problems.append(f"{where}: coverage must name a test (`tests/x.py::test_y`) or "
                            "start with 'untested on CPU:' and say why")  # fmt: skip
        for path, name in refs:
            file = ROOT / path
            if not file.is_file() or f"def {name}(" not in file.read_text():
                problems.append(f"{where}: {path}::{name} does not exist")
    for key in sorted(set(doc) - set(found)):
        problems.append(f"{key[0]}::{key[1]}: listed in {DOC.name} but has no CUDA-only code")
    return problems


def test_every_cuda_path_is_faked_or_listed():
    problems = coverage_problems(scan_package(), documented())
    assert not problems, "\n".join(problems)


def test_scan_finds_a_new_cuda_branch():
    """The check can fail: a CUDA branch added to a copy of a listed function, and a new
    function with one, are both reported; an annotation naming "cuda" is not a site."""
    found = scan_package()
    doc = documented()
    key = ("moetrain/train/runtime.py", "pick_device")
    assert found[key] == doc[key][0]
    extra = scan_source(
        "def pick_device(name):\n"
        "    torch.cuda.set_sync_debug_mode(1)\n"
        "def new(x, device: 'cuda'):\n"
        "    x.pin_memory()\n"
        "    return x.to(device, non_blocking=True)\n"
    )
    assert extra == {"pick_device": {"torch.cuda.set_sync_debug_mode"},
                     "new": {".pin_memory", "non_blocking="}}  # fmt: skip
    found[key] = found[key] | extra["pick_device"]
    found[("moetrain/train/trainer.py", "new")] = extra["new"]
    problems = coverage_problems(found, doc)
    assert len(problems) == 2, problems
    assert any("pick_device: the scan finds" in p for p in problems), problems
    assert any("trainer.py::new: CUDA-only code" in p for p in problems), problems
    # A row whose function lost its CUDA code, and a row naming a test that does not exist.
    doc[("moetrain/gone.py", "f")] = ({'"cuda"'}, "`tests/test_cuda_paths.py::test_nothing`")
    found[("moetrain/gone.py", "f")] = {'"cuda"'}
    problems = coverage_problems(found, doc)
    assert any("test_nothing does not exist" in p for p in problems), problems
    del found[("moetrain/gone.py", "f")]
    problems = coverage_problems(found, doc)
    assert any("gone.py::f: listed" in p for p in problems), problems


# ---------------------------------------------------------------------------------------------
# The CUDA paths, run on CPU with a fake torch.cuda
# ---------------------------------------------------------------------------------------------


class FakeCuda:
    """Stands in for torch.cuda: a machine with `count` devices; records what was called."""

    def __init__(self, count: int = 2, name: str = "NVIDIA H100 80GB HBM3", capability=(9, 0)):
        self.count, self.name, self.capability = count, name, capability
        self.calls: list[tuple] = []
        self.rng = [torch.tensor([i], dtype=torch.uint8) for i in range(count)]

    def is_available(self) -> bool:
        return self.count > 0

    def get_device_name(self, device) -> str:
        return self.name

    def get_device_capability(self, device) -> tuple[int, int]:
        return self.capability

    def synchronize(self, device) -> None:
        self.calls.append(("synchronize", device))

    def set_device(self, device) -> None:
        self.calls.append(("set_device", device))

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.rng]

    def set_rng_state_all(self, states) -> None:
        self.calls.append(("set_rng_state_all", [s.clone() for s in states]))

    def mem_get_info(self, device) -> tuple[int, int]:
        self.calls.append(("mem_get_info", device))
        return 60 * 2**30, 80 * 2**30


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("is_available", "get_device_name", "get_device_capability", "synchronize",
                 "set_device", "get_rng_state_all", "set_rng_state_all",
                 "mem_get_info"):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


CUDA0 = torch.device("cuda", 0)


def test_pick_device_and_dtype(fake_cuda, monkeypatch):
    from moetrain.config import ConfigError
    from moetrain.model.precision import Precision
    from moetrain.train.runtime import pick_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pick_device("auto") == torch.device("cuda", 1)  # torchrun's local rank
    assert pick_device("cuda") == torch.device("cuda", 1)
    assert pick_device("cpu") == torch.device("cpu")
    assert Precision.choose("auto", CUDA0.type).dtype == torch.bfloat16
    assert Precision.choose("auto", "cpu").dtype == torch.float32
    assert Precision.choose("fp32", CUDA0.type).dtype == torch.float32
    fake_cuda.count = 0
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="train.device: 'cuda' requested but no CUDA"):
        pick_device("cuda")


def test_rng_state_carries_every_cuda_generator(fake_cuda):
    from moetrain.train.runtime import rng_state, set_rng_state

    state = rng_state()
    assert [s.tolist() for s in state["cuda"]] == [[0], [1]]
    fake_cuda.rng = [torch.tensor([7], dtype=torch.uint8)] * 2  # the generators move on
    set_rng_state(state)
    (call,) = fake_cuda.calls
    assert call[0] == "set_rng_state_all" and [s.tolist() for s in call[1]] == [[0], [1]]
    # A checkpoint saved without CUDA restores none; one saved with CUDA, resumed without, too.
    fake_cuda.calls.clear()
    set_rng_state({k: v for k, v in state.items() if k != "cuda"})
    fake_cuda.count = 0
    set_rng_state(state)
    assert fake_cuda.calls == []


def test_init_distributed_picks_nccl_and_the_local_device(fake_cuda, monkeypatch):
    import torch.distributed as dist

    from moetrain.train import runtime

    started = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, timeout: started.append((backend, timeout)))  # fmt: skip
    runtime.init_distributed(torch.device("cuda", 1), 30)
    runtime.init_distributed(torch.device("cpu"), 30)
    assert fake_cuda.calls == [("set_device", torch.device("cuda", 1))]
    assert started == [("nccl", timedelta(seconds=30)), ("gloo", timedelta(seconds=30))]


def test_memory_check_reads_the_gpus_free_memory(fake_cuda, monkeypatch):
    """On CUDA the trainer's memory check budgets the device's free memory (what
    ``torch.cuda.mem_get_info`` reports), not the host's MemAvailable."""
    from moetrain.plan.planner import available_memory

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # ignored on a GPU: each rank has its own
    free, source = available_memory(CUDA0)
    assert free == 60 * 2**30 and source == "free memory of NVIDIA H100 80GB HBM3"
    assert fake_cuda.calls == [("mem_get_info", CUDA0)]
    cpu_free, cpu_source = available_memory(torch.device("cpu"))
    assert "8 local rank(s)" in cpu_source and cpu_free > 0


def test_fp8_backend_and_grouped_gemm_eligibility_on_cuda(fake_cuda):
    """``train.fp8_backend: auto`` takes FP8 tensor cores from sm89 on, emulation below; the
    scaled grouped GEMM needs sm90 and K, M multiples of 16 (a CUDA operand stands in: only
    its device and shape are read)."""
    from moetrain.kernels import fp8

    assert fp8.resolve_backend("auto", CUDA0) == "scaled_mm"  # the fake is an H100 (9, 0)
    fake_cuda.capability = (8, 9)
    assert fp8.resolve_backend("auto", CUDA0) == "scaled_mm"
    fake_cuda.capability = (8, 0)
    assert fp8.resolve_backend("auto", CUDA0) == "emulated"

    def operand(*shape):
        return types.SimpleNamespace(device=CUDA0, shape=shape)

    assert not fp8._native_grouped_ok(operand(64, 32), operand(4, 32, 64))  # sm80
    fake_cuda.capability = (9, 0)
    assert fp8._native_grouped_ok(operand(64, 32), operand(4, 32, 64))
    assert not fp8._native_grouped_ok(operand(64, 24), operand(4, 24, 64))  # K % 16
    assert not fp8._native_grouped_ok(operand(64, 32), operand(4, 32, 40))  # M % 16
    assert not fp8._native_grouped_ok(torch.zeros(64, 32), torch.zeros(4, 32, 64))  # CPU


def test_synchronize_and_peak_flops_on_cuda(fake_cuda):
    """The MFU denominator of a known GPU is its bf16 dense datasheet peak, read from the one
    GPU table ``moetrain plan`` prices with: an H100's 989 TFLOP/s, a B200's 2,250 (HGX B200
    datasheet; a B200 once fell back to a measured matmul), an A100's 312, an L40's 181."""
    from moetrain.plan.hardware import GPUS, gpu_of_device
    from moetrain.train.metrics import peak_flops, synchronize

    synchronize(CUDA0)
    synchronize(torch.device("cpu"))
    assert fake_cuda.calls == [("synchronize", CUDA0)]
    flops, source = peak_flops(CUDA0)
    assert flops == 989e12 and source == "NVIDIA H100 80GB HBM3 bf16 peak"
    for name, datasheet in (("NVIDIA B200", 2250e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                            ("NVIDIA L40", 181e12), ("NVIDIA H200", 989e12)):  # fmt: skip
        fake_cuda.name = name
        assert peak_flops(CUDA0) == (datasheet, f"{name} bf16 peak")
        assert gpu_of_device(name).bf16_tflops * 1e12 == datasheet  # the plan's row
    assert gpu_of_device("NVIDIA RTX 4090") is None and set(GPUS) >= {"b200", "l40"}


class _SaysCuda(torch.Tensor):
    """A CPU tensor that says it is on a GPU (``is_cuda``): what ``Staging`` branches on."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_checkpoint_staging_pins_copies_asynchronously_and_waits_once(fake_cuda, monkeypatch):
    """An asynchronous checkpoint stages a GPU tensor into pinned host memory with a
    non-blocking copy, and synchronizes once, after every copy was issued, before the
    background thread reads them; a CPU tensor's buffer is plain memory. The buffers are
    reused by the next save."""
    from moetrain.train.checkpoint import write

    pinned = []
    empty = torch.empty

    def fake_empty(*shape, pin_memory=False, **kw):
        pinned.append(pin_memory)
        return empty(*shape, **kw)  # a CPU-only torch has no pinned memory

    monkeypatch.setattr(write.torch, "empty", fake_empty)
    gpu = torch.Tensor._make_subclass(_SaysCuda, torch.arange(6.0).reshape(2, 3))
    state = {"model": {"w": gpu, "b": torch.ones(2)}, "optim": {"lr": 0.1}}
    staging = write.Staging()
    staged = staging.stage(state)
    assert pinned == [True, False] and fake_cuda.calls == [("synchronize", gpu.device)]
    assert torch.equal(staged["model"]["w"], gpu) and staged["optim"] == {"lr": 0.1}
    first = staged["model"]["w"]
    assert staging.stage(state)["model"]["w"] is first and len(pinned) == 2


def test_generate_defaults_to_cuda(fake_cuda, monkeypatch, capsys):
    from moetrain.config import ConfigError
    from moetrain.interop import cli

    devices = []

    def load(path, device):
        devices.append(device)
        raise ConfigError("stop here")

    monkeypatch.setattr(cli, "load_for_generation", load)
    assert cli.generate_main(["run", "--prompt", "x"]) != 0
    fake_cuda.count = 0
    assert cli.generate_main(["run", "--prompt", "x"]) != 0
    assert devices == ["cuda", "cpu"]


def test_resolve_backend_and_device_check_on_cuda(monkeypatch):
    from moetrain.kernels import common

    from moetrain import kernels

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(kernels, "_triton_available", lambda: True)
    assert kernels.resolve_backend("auto", CUDA0) == "triton"
    assert kernels.resolve_backend("triton", CUDA0) == "triton"
    assert kernels.resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(RuntimeError, match="needs the Triton CPU interpreter"):
        kernels.resolve_backend("triton", "cpu")
    common.check_triton_device("op", types.SimpleNamespace(device=CUDA0))
    with pytest.raises(RuntimeError, match="op: triton backend needs a CUDA tensor"):
        common.check_triton_device("op", torch.zeros(1))


class _OnCuda:
    """A CPU tensor that reports a CUDA device (what the torch grouped GEMM's eligibility
    check reads)."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.device = CUDA0

    def __getattr__(self, name):
        return getattr(self._t, name)


def test_torch_grouped_mm_eligibility_on_cuda(fake_cuda):
    from moetrain.kernels.grouped_gemm.torch_backend import _native_ok

    def ok(dtype, capability):
        fake_cuda.capability = capability
        a = _OnCuda(torch.zeros(64, 32, dtype=dtype))
        b = _OnCuda(torch.zeros(4, 32, 16, dtype=dtype))
        return _native_ok(a, b, 16)

    # CUTLASS's sm90 bf16 grouped GEMM: Hopper and newer, bf16 only.
    assert ok(torch.bfloat16, (9, 0)) and ok(torch.bfloat16, (10, 0))
    assert not ok(torch.bfloat16, (8, 0))
    assert not ok(torch.float32, (9, 0)) and not ok(torch.float16, (9, 0))


def test_kernels_auto_picks_each_op_by_measurement_and_says_why(fake_cuda, monkeypatch, caplog):
    """``moe.kernels: auto`` on a (faked) H100 takes each op's implementation from the
    measured table (torch._grouped_mm for the GEMMs, Triton for router and permute) and logs
    one line per op with the speed-up and its rows, once; a B200 (no row) keeps the default;
    an explicit name forces one implementation; off CUDA it is torch."""
    import logging

    from moetrain.kernels import selection

    from moetrain import kernels

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(kernels, "_triton_available", lambda: True)
    monkeypatch.setattr(selection, "_MEMO", {})
    monkeypatch.setattr(selection, "_LOGGED", set())
    x = types.SimpleNamespace(device=CUDA0, shape=(8192, 2048), dtype=torch.bfloat16)
    moe = {"experts": 8, "top_k": 2, "ffn": 2816}
    with caplog.at_level(logging.INFO, logger="moetrain.kernels"):
        c = kernels.select_kernels("auto", x, **moe)
        assert kernels.select_kernels("auto", x, **moe) is c  # memoised, logged once
    assert isinstance(c, kernels.KernelChoice) and c.arch == "sm_90"
    assert [c.backend(op, torch.bfloat16) for op in ("fwd", "dgrad", "wgrad")] == ["torch"] * 3
    assert [c.backend(op, torch.bfloat16) for op in ("permute", "unpermute")] == ["triton"] * 2
    assert c.backend("route", torch.float32) == "triton"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 + len(selection.OPS), lines
    assert "NVIDIA H100 80GB HBM3, sm_90" in lines[0]
    assert "fwd: torch in bfloat16: Triton 0.99x torch._grouped_mm on the mixtral class" in (
        lines[1]), lines[1]  # fmt: skip
    assert "docs/data/benchmarks.csv" in lines[1]
    assert "grouped_gemm mixtral/T16384/{down,up}" in lines[1]
    assert "gather: triton (default: no measurement" in lines[4]
    # DeepSeek-V3's sigmoid router over 256 experts at 8,192 tokens: measured slower in Triton.
    dsv3 = types.SimpleNamespace(device=CUDA0, shape=(8192, 7168), dtype=torch.bfloat16)
    d = kernels.select_kernels("auto", dsv3, experts=256, top_k=8, ffn=2048, score_func="sigmoid")
    assert d.backend("route", torch.float32) == "torch" and "0.52x" in d.route.why
    # No measurement on Blackwell: Triton everywhere, the documented default.
    fake_cuda.capability = (10, 0)
    b = kernels.select_kernels("auto", types.SimpleNamespace(device=torch.device("cuda", 1),
                               shape=(8192, 2048), dtype=torch.bfloat16), **moe)  # fmt: skip
    assert b.arch == "sm_100"
    assert {b.backend(op, torch.bfloat16) for op in selection.OPS} == {selection.DEFAULT}
    # Explicit names force one implementation; auto off CUDA is torch.
    assert kernels.select_kernels("torch", x, **moe) == "torch"
    assert kernels.select_kernels("triton", x, **moe) == "triton"
    cpu = types.SimpleNamespace(device=torch.device("cpu"), shape=(8192, 2048),
                                dtype=torch.float32)  # fmt: skip
    assert kernels.select_kernels("auto", cpu, **moe) == "torch"


def test_the_trainer_chooses_the_kernels_at_start_up(tmp_path, monkeypatch):
    """The trainer asks for the MoE layers' kernel choice before anything is built, with the
    shape a layer sees (micro-batch x seq_len tokens of this rank) and the compute dtype:
    on CUDA that call logs the choice, one line per op (faked above)."""
    from moetrain.kernels import selection
    from multirank import micro_config

    from moetrain.train.trainer import Trainer

    calls = []
    real = selection.choose_kernels
    monkeypatch.setattr(selection, "choose_kernels",
                        lambda *a: calls.append(a) or real(*a))  # fmt: skip
    cfg = micro_config(tmp_path, "train.memory_check=false")
    Trainer(cfg).close()
    m = cfg.moe
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    assert calls == [(m.kernels, torch.device("cpu"), selection.MoEShape(
        tokens, cfg.model.dim, m.expert_ffn_dim, m.num_experts, m.top_k, m.score_func),
        torch.float32)]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The FP8 CUDA path against torch's own contract for each CUDA op, on CPU
# ---------------------------------------------------------------------------------------------


def _as_meta(v):
    """The same shape, strides and dtype on the meta device (other arguments as they are)."""
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


def _scaled_grouped_mm_on_cpu(a, b, scale_a, scale_b, offs=None, out_dtype=None, **_):
    """What ``torch._scaled_grouped_mm`` (2-D a, 3-D b) computes: per group, the scaled
    product rounded to bf16; rows past the last group NaN (the CUDA kernel leaves them)."""
    y = torch.full((a.shape[0], b.shape[2]), float("nan"))
    start = 0
    for g, end in enumerate(offs.tolist()):
        y[start:end] = (a[start:end].float() * scale_a[start:end, None]) @ (
            b[g].float() * scale_b[g][None, :]
        )
        start = end
    return y.to(out_dtype or torch.bfloat16)


def _scaled_mm_on_cpu(a, b, scale_a, scale_b, out_dtype=None, **_):
    """What ``torch._scaled_mm`` computes with row-wise scales (any torch: 2.11's CPU build
    has no such kernel for these operands)."""
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype or a.dtype)


class CudaContract:
    """torch's CUDA GEMMs on CPU: every call first replays its operands as meta tensors through
    the real op -- torch's meta kernel, which applies the CUDA kernel's checks (dtypes, row-
    and column-major operands, multiples of 16, scale shapes and dtypes, bf16 output) -- then
    computes with a CPU stand-in. Records (op, operand dtypes) of each call."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, tuple]] = []
        grouped_mm_cpu = torch._grouped_mm
        for name, cpu in (("_scaled_grouped_mm", _scaled_grouped_mm_on_cpu),
                          ("_scaled_mm", _scaled_mm_on_cpu),
                          ("_grouped_mm", grouped_mm_cpu)):  # fmt: skip
            monkeypatch.setattr(torch, name, self._wrap(name, cpu))

    def _wrap(self, name, cpu):
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            op(*map(_as_meta, args), **{k: _as_meta(v) for k, v in kwargs.items()})
            dtypes = tuple(str(a.dtype)[6:] for a in args[:2])
            self.calls.append((name, dtypes))
            return cpu(*args, **kwargs)

        return call


def _cuda_eligibility(monkeypatch, fake_cuda):
    """The FP8 and bf16 grouped GEMMs' CUDA eligibility rules applied to CPU operands (an
    H100, sm90): the operands report a CUDA device to the checks."""
    from moetrain.kernels import fp8
    from moetrain.kernels.grouped_gemm import torch_backend as gemm_torch

    grouped_ok, native_ok = fp8._native_grouped_ok, gemm_torch._native_ok
    monkeypatch.setattr(fp8, "_native_grouped_ok", lambda a, b: grouped_ok(_OnCuda(a), _OnCuda(b)))
    monkeypatch.setattr(gemm_torch, "_native_ok",
                        lambda a, b, cols: native_ok(_OnCuda(a), _OnCuda(b), cols))  # fmt: skip


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_cuda_path_meets_each_ops_contract(recipe, fake_cuda, monkeypatch):
    """The `scaled_mm` backend as it runs on an H100 -- expert groups through
    `torch._scaled_grouped_mm` (forward, dgrad), the weight gradient through the bf16
    `torch._grouped_mm`, linears through `torch._scaled_mm` (forward, dgrad) -- with every call
    checked by torch's own meta kernel, and the results equal to the emulated recipe's. The
    grouped dgrad once passed e5m2 gradients, which `_scaled_grouped_mm` refuses."""
    from moetrain.kernels import fp8

    r = fp8.get_recipe(recipe)
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor([10, 10, 25, 37], dtype=torch.int32)  # unaligned groups, a tail
    x = torch.randn(40, 32, generator=gen)
    w = torch.randn(4, 32, 48, generator=gen)
    lw = torch.randn(64, 32, generator=gen)
    dy, dz = torch.randn(40, 48, generator=gen), torch.randn(40, 64, generator=gen)
    runs = {}
    for backend in ("emulated", "scaled_mm"):
        if backend == "scaled_mm":
            contract = CudaContract(monkeypatch)
            _cuda_eligibility(monkeypatch, fake_cuda)
        xs, ws, lws = (t.clone().requires_grad_() for t in (x, w, lw))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fp8.fp8_grouped_mm(xs, ws, offs, r, backend)
            x2 = x.clone().requires_grad_()
            z = fp8.fp8_linear(x2, lws, None, r, backend)
        (y.float() * dy).sum().backward()
        (z.float() * dz).sum().backward()
        runs[backend] = (y, xs.grad, ws.grad, z, x2.grad, lws.grad)
    e4m3 = ("float8_e4m3fn", "float8_e4m3fn")
    grouped = [c for c in contract.calls if c[0] == "_scaled_grouped_mm"]
    assert grouped == [("_scaled_grouped_mm", e4m3)] * 2, contract.calls  # forward, dgrad
    assert [c for c in contract.calls if c[0] == "_grouped_mm"] == [
        ("_grouped_mm", ("bfloat16", "bfloat16"))
    ]  # the weight gradient
    assert len([c for c in contract.calls if c[0] == "_scaled_mm"]) == 2  # linear fwd, dgrad
    for name, a, b in zip(("y", "dx", "dw", "linear y", "linear dx", "linear dw"),
                          runs["scaled_mm"], runs["emulated"], strict=True):  # fmt: skip
        a, b = a.detach().double(), b.detach().double()
        err = float((a - b).norm() / b.norm())
        assert err <= 0.01, (name, err)


def test_the_contract_check_catches_what_cuda_refuses(monkeypatch):
    """The meta replay fails where the CUDA kernel would: e5m2 operands of the grouped GEMM,
    a row-major second operand, an fp32 grouped GEMM (CUDA's is bf16 only)."""
    CudaContract(monkeypatch)
    offs = torch.tensor([16, 32], dtype=torch.int32)
    a = torch.zeros(32, 32, dtype=torch.float8_e4m3fn)
    b_col = torch.zeros(2, 48, 32, dtype=torch.float8_e4m3fn).transpose(1, 2)
    sa, sb = torch.ones(32), torch.ones(2, 48)
    torch._scaled_grouped_mm(a, b_col, sa, sb, offs=offs, out_dtype=torch.bfloat16)  # fine
    with pytest.raises(RuntimeError, match="E4M3"):
        torch._scaled_grouped_mm(a.to(torch.float8_e5m2), b_col.to(torch.float8_e5m2), sa, sb,
                                 offs=offs, out_dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(RuntimeError, match="column major"):
        torch._scaled_grouped_mm(a, b_col.contiguous(), sa, sb, offs=offs,
                                 out_dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(torch.zeros(32, 32), torch.zeros(2, 32, 48), offs=offs)
