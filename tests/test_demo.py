"""The README's first command: `adaptmem demo` runs every lever and says what happened."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_demo_loads_adapts_and_pages() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "adaptmem.cli", "demo", "--seconds", "30"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "adaptive.load" in out
    assert "ran out of memory at batchsize=384" in out  # the cap forced a real adaptation
    assert "outputs identical" in out
    # Quiet once it has settled: at most one retry after the second call (however many
    # calls the time limit allows on a loaded machine).
    retries = {int(n): int(k or 0) for n, k in re.findall(
        r"call (\d+): batch size \d+(?: after (\d+) out-of-memory retries)?", out)}
    assert 1 in retries, out
    assert sum(k for n, k in retries.items() if n > 2) <= 1, out


@pytest.mark.slow
def test_the_demo_runs_its_gpu_branch_on_a_simulated_device() -> None:
    # No GPU here: the simulated one takes the CUDA branch (memory fraction, side-stream
    # paging from pinned masters), and the output says it is simulated.
    result = subprocess.run(
        [sys.executable, "-m", "adaptmem.cli", "demo", "--simulate-gpu", "--seconds", "5"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "adaptmem demo on cuda:0" in out
    assert "SIMULATED GPU" in out
    assert "1. adaptive.load" in out
    assert "under a CUDA memory fraction" in out
    assert "ran out of memory at batchsize=384" in out  # the simulated allocator said no
    assert "outputs identical" in out
    assert " 0 transfers" not in out
