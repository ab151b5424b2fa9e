"""tools/machine_info.py names the CPU, its vector instructions and torch's build."""

from __future__ import annotations

import torch
from conftest import load_tool


def test_machine_info_names_the_cpu_and_the_torch_build(capsys) -> None:
    tool = load_tool("machine_info")
    assert tool.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== machine: ")
    assert f"CPU capability {torch.backends.cpu.get_cpu_capability()}" in out
    assert "inductor CPU vector ISA: " in out and "PyTorch built with" in out
