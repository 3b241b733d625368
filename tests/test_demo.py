"""The README's first command: `adaptmem demo` runs every lever and says what happened."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def _demo(*options: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "adaptmem.cli", "demo", *options],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_the_demo_loads_adapts_and_pages_on_the_cpu_and_on_a_simulated_gpu() -> None:
    # Both runs at once (each is one process): the suite waits for the slower only.
    runs = {"cpu": _demo("--seconds", "30"),
            "simulated": _demo("--simulate-gpu", "--seconds", "5")}
    outs = {}
    try:
        for name, run in runs.items():
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, (name, out + err)
            outs[name] = out
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()

    out = outs["cpu"]
    assert "adaptive.load" in out
    assert "ran out of memory at batchsize=384" in out  # the cap forced a real adaptation
    assert "outputs identical" in out
    # Quiet once it has settled: at most one retry after the second call (however many
    # calls the time limit allows on a loaded machine).
    retries = {int(n): int(k or 0) for n, k in re.findall(
        r"call (\d+): batch size \d+(?: after (\d+) out-of-memory retr(?:y|ies))?", out)}
    assert 1 in retries, out
    assert sum(k for n, k in retries.items() if n > 2) <= 1, out

    # No GPU here: the simulated one takes the CUDA branch (memory fraction, side-stream
    # paging from pinned masters), and the output says it is simulated.
    out = outs["simulated"]
    assert "adaptmem demo on cuda:0" in out
    assert "SIMULATED GPU" in out
    assert "1. adaptive.load" in out
    assert "under a CUDA memory fraction" in out
    assert "ran out of memory at batchsize=384" in out  # the simulated allocator said no
    assert "outputs identical" in out
    assert " 0 transfers" not in out


_INTERRUPTED_IN_THE_CAPPED_PHASE = """
import resource, torch
import adaptmem._demo as demo

before = resource.getrlimit(resource.RLIMIT_DATA), torch.backends.mkldnn.enabled
say = demo._say

def say_then_interrupt(text):
    say(text)
    if text.startswith("   call 1:"):
        raise KeyboardInterrupt

demo._say = say_then_interrupt
try:
    demo.run_demo(seconds=30)
except KeyboardInterrupt:
    print("interrupted")
after = resource.getrlimit(resource.RLIMIT_DATA), torch.backends.mkldnn.enabled
print("restored" if after == before else f"NOT RESTORED: {before} -> {after}")
"""


@pytest.mark.slow
def test_ctrl_c_in_the_capped_phase_puts_the_cap_and_kernels_back() -> None:
    # Once Ctrl-C there left the process under the demo's memory cap, oneDNN off.
    run = subprocess.run([sys.executable, "-c", _INTERRUPTED_IN_THE_CAPPED_PHASE],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-2:] == ["interrupted", "restored"], run.stdout


_OFF_LINUX = """
import sys, torch
import adaptmem._demo as demo

sys.platform = "darwin"  # after the imports: the demo's own choices see macOS
sys.exit(demo.run_demo(seconds=1))
"""


@pytest.mark.slow
def test_off_linux_the_demo_runs_uncapped_and_says_so() -> None:
    # Once it set the Linux-only CPU cap regardless, which raised OSError on macOS.
    run = subprocess.run([sys.executable, "-c", _OFF_LINUX], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "without a memory cap" in run.stdout and "on darwin" in run.stdout
    assert "outputs identical" in run.stdout
