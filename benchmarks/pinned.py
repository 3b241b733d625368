"""Pinned host memory of a paged model: pinned at its size against torch's allocator.

    python benchmarks/pinned.py            # measure and print
    python benchmarks/pinned.py --write    # ... and replace its section in RESULTS.md

Pages three models with ``resident_bytes=0`` (every weight in pinned host masters) two
ways in the same run: as ``adaptive.page`` does now (packs of 1 MiB and up registered with
``cudaHostRegister`` at their size; see [Note: pinned memory at its size]) and with every
pack pinned by torch's host allocator, which rounds each up to a power of two (what it did
before). Reports the page-locked bytes against the weights' bytes, and the time ``page()``
took. Without a GPU it runs on the simulated device (``simulated_cuda``), whose
``pinned_bytes`` counts torch's blocks at the size CUDA's allocator rounds them to: the
bytes are exact arithmetic, the times are the host's and labelled simulated. On a GPU the
bytes are torch's ``host_memory_stats`` (where this torch has it) plus what was registered.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _report import header, markdown_table, write_section  # noqa: E402
from paging import GPT  # noqa: E402

from adaptmem import adaptive  # noqa: E402
from adaptmem._common import pinning  # noqa: E402
from adaptmem.testing import simulated_cuda  # noqa: E402

TITLE = "Pinned host memory of a paged model"
NOTE = """Every weight is in pinned host masters (`resident_bytes=0`), one pack per unit and
dtype. *torch's allocator* is every pack pinned with `pin_memory=True` (as before
2026-11-28), *at its size* is `adaptive.page` now: packs of 1 MiB and up registered with
`cudaHostRegister`, smaller ones from torch's allocator. The two run interleaved in the same
process; *page() s* is the median time to page the model. On the simulated device the bytes
are exact (the rounding is arithmetic) and the times are the host's work, registering
nothing. Real-GPU figures (the time `cudaHostRegister` takes, against `cudaHostAlloc`'s)
are pending: `python benchmarks/pinned.py` on a GPU host (`STEPS=pinned` in
`benchmarks/on_gpu.sh`).
"""


class _LlamaLayer(nn.Module):
    """A Llama-2-13B decoder layer's weights (width 5120, MLP 13824), without the maths."""

    def __init__(self, dim: int = 5120, hidden: int = 13824) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = (nn.Linear(dim, hidden, bias=False) for _ in range(2))
        self.down = nn.Linear(hidden, dim, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.o(self.q(h) + self.k(h) + self.v(h))
        h = self.norm2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def _models(quick: bool) -> list[tuple[str, Callable[[], nn.Module]]]:
    import torchvision

    def gpt() -> nn.Module:
        with torch.device("meta"):
            model = GPT(layers=12 if quick else 48).half().eval()
        model = model.to_empty(device="cpu")
        model.lm_head.weight = model.wte.weight
        return model

    def llama() -> nn.Module:
        with torch.device("meta"):
            model = nn.Sequential(*(_LlamaLayer() for _ in range(2))).half().eval()
        return model.to_empty(device="cpu")

    return [("ResNet-101, fp32", lambda: torchvision.models.resnet101(weights=None).eval()),
            (f"GPT-2-XL shape{', 12 of 48 layers' if quick else ''}, fp16", gpt),
            ("2 Llama-2-13B-shaped layers, fp16", llama)]


@contextlib.contextmanager
def _counted(registered: list[int]) -> Iterator[None]:
    """Record the bytes each cudaHostRegister call asks for."""
    real = torch.cuda.cudart()
    original = torch.cuda.cudart

    def register(ptr: int, size: int, flags: int) -> Any:
        registered.append(size)
        return real.cudaHostRegister(ptr, size, flags)

    counting = types.SimpleNamespace(cudaHostRegister=register,
                                     cudaHostUnregister=real.cudaHostUnregister,
                                     cudaGetLastError=getattr(real, "cudaGetLastError", None))
    torch.cuda.cudart = lambda: counting  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.cudart = original  # type: ignore[assignment]


def _pinned_now(sim: Any, registered: list[int]) -> int:
    if sim is not None:
        return int(sim.pinned_bytes)
    stats = getattr(torch.cuda, "host_memory_stats", None)
    held = stats().get("active_bytes.current", 0) if stats is not None else 0
    return int(held) + sum(registered)


def _measure(model: nn.Module, exact: bool, sim: Any) -> tuple[int, float]:
    """Page-locked bytes while ``model`` is paged, and the seconds ``page()`` took."""
    registered: list[int] = []
    saved = pinning.EXACT_FROM
    pinning.EXACT_FROM = saved if exact else 1 << 62  # never: torch's allocator pins all
    try:
        with _counted(registered):
            before = _pinned_now(sim, registered)
            start = time.perf_counter()
            pager = adaptive.page(model, "cuda", resident_bytes=0)
            seconds = time.perf_counter() - start
            held = _pinned_now(sim, registered) - before
            pager.remove()
    finally:
        pinning.EXACT_FROM = saved
    return held, seconds


def rows(quick: bool, rounds: int) -> list[list[object]]:
    out: list[list[object]] = []
    real = torch.cuda.is_available()
    for name, build in _models(quick):
        model = build()
        weights = sum(t.numel() * t.element_size() for t in
                      {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
        held: dict[bool, int] = {}
        times: dict[bool, list[float]] = {True: [], False: []}
        with contextlib.nullcontext() if real else simulated_cuda(
                total_memory="140GiB") as sim:
            for _ in range(rounds):
                for exact in (False, True):  # interleaved
                    held[exact], seconds = _measure(model, exact, sim)
                    times[exact].append(seconds)
        gib = 2**30
        out.append([name, f"{weights / gib:.2f}",
                    f"{held[False] / gib:.2f} ({held[False] / weights:.2f}x)",
                    f"{held[True] / gib:.2f} ({held[True] / weights:.2f}x)",
                    f"{held[True] / held[False]:.2f}",
                    f"{statistics.median(times[False]):.2f}",
                    f"{statistics.median(times[True]):.2f}"])
        del model
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 of GPT-2-XL's 48 layers")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--write", action="store_true", help=f"replace '{TITLE}' in RESULTS.md")
    args = parser.parse_args()
    command = ("python benchmarks/pinned.py " + " ".join(sys.argv[1:])).strip()
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else "SIMULATED (simulated_cuda): bytes as CUDA's host allocator rounds them, "
                   "times of the simulation's host work")
    table = markdown_table(
        ["model", "weights GiB", "torch's allocator GiB (x weights)",
         "at its size GiB (x weights)", "at its size / allocator", "page() s, allocator",
         "page() s, at its size"], rows(args.quick, args.rounds))
    body = header(command) + f"- Device: {device}\n\n" + table + "\n" + NOTE
    print(f"## {TITLE}\n\n{body}")
    if args.write:
        write_section(TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
