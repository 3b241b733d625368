"""The README's first command: `adaptmem demo` runs every lever and says what happened."""

from __future__ import annotations

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
