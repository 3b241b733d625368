"""Gradient accumulation under ``@adaptive.batch(accumulate=model)``: what it costs.

    python benchmarks/accumulate.py            # print the figures
    python benchmarks/accumulate.py --write    # and put them into RESULTS.md
    python benchmarks/accumulate.py --quick    # a smoke run (few rounds)

1. The success path: a training step (forward + backward over micro-batches, no failure)
   written as a plain loop, against the same step under ``@adaptive.batch(accumulate=
   model)``, with no gradient at the start (``zero_grad()``: nothing to copy) and with
   gradients at the start (``zero_grad(set_to_none=False)``: they are copied to the host
   once per call). Interleaved rounds; median and best.
2. A step whose full batch runs out of memory in backward (fault injection at a quarter of
   the batch): its time against the same micro-batches run from the start (the price of
   the failed attempts), and its gradients against the full batch's (max relative
   difference; a LayerNorm model, so only the summation order differs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import header, markdown_table, write_section  # noqa: E402

from adaptmem import adaptive  # noqa: E402
from adaptmem.testing import MemoryCeiling  # noqa: E402


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ceiling: MemoryCeiling | None) -> torch.Tensor:
        ctx.ceiling = ceiling
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.ceiling is not None:
            ctx.ceiling.require(grad.shape[0])
        return grad, None


class Encoder(nn.Module):
    """A transformer encoder; backward runs out of memory under ``ceiling`` after the upper
    layers' gradients were added."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 256)
        self.lower = nn.TransformerEncoderLayer(256, 4, 512, batch_first=True, dropout=0.0)
        self.upper = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(256, 4, 512, batch_first=True, dropout=0.0), 3,
            enable_nested_tensor=False)
        self.head = nn.Linear(256, 10)
        self.ceiling: MemoryCeiling | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Gate.apply(self.lower(self.embed(x)), self.ceiling)
        return self.head(self.upper(h).mean(1))


def _loop(model: nn.Module, batchsize: int, x: torch.Tensor, y: torch.Tensor) -> None:
    for xb, yb, weight in adaptive.microbatches(batchsize, x, y):
        (F.cross_entropy(model(xb), yb) * weight).backward()


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def success_path(rounds: int, batch: int, micro: int) -> tuple[list[list[object]], str]:
    torch.manual_seed(0)
    model = Encoder()
    x, y = torch.randn(batch, 32, 64), torch.randint(0, 10, (batch,))

    @adaptive.batch(initial_batchsize=micro, accumulate=model, cache=adaptive.NoBatchsizeCache)
    def guarded(batchsize: int) -> None:
        _loop(model, batchsize, x, y)

    def run(variant: str) -> float:
        model.zero_grad(set_to_none=not variant.endswith("grads"))
        if variant.startswith("plain"):
            return _time(lambda: _loop(model, micro, x, y))
        return _time(guarded)

    variants = ["plain", "accumulate", "plain, grads", "accumulate, grads"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for v in variants:
        run(v)  # warm up
    for _ in range(rounds):
        for v in variants:
            times[v].append(run(v))
    rows: list[list[object]] = []
    for v in variants:
        base = statistics.median(times["plain" + (", grads" if "grads" in v else "")])
        med = statistics.median(times[v])
        rows.append([v, f"{med * 1e3:.1f}", f"{min(times[v]) * 1e3:.1f}", f"{med / base:.3f}"])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    note = (f"Encoder of {params / 2**20:.1f} MiB of fp32 parameters, batch {batch} x 32 "
            f"tokens, micro-batches of {micro}, {rounds} interleaved rounds. The snapshot "
            f"copies nothing without gradients and {params / 2**20:.1f} MiB to the host with "
            f"them (plus the buffers, none here); read the ratios against the spread between "
            f"median and best, which a loaded machine widens.")
    return rows, note


def with_failures(rounds: int, batch: int) -> tuple[list[list[object]], str]:
    capacity = batch // 4
    torch.manual_seed(0)
    model = Encoder()
    x, y = torch.randn(batch, 32, 64), torch.randint(0, 10, (batch,))
    ceiling = MemoryCeiling(capacity)

    @adaptive.batch(initial_batchsize=batch, accumulate=model, cache=adaptive.NoBatchsizeCache)
    def step(batchsize: int) -> int:
        _loop(model, batchsize, x, y)
        return batchsize

    failing, plain, used = [], [], 0
    for _ in range(rounds):
        model.zero_grad()
        model.ceiling = ceiling
        ceiling.reset()
        start = time.perf_counter()
        used = step()
        failing.append(time.perf_counter() - start)
        failures = list(ceiling.failures)
        model.zero_grad()
        model.ceiling = None
        start = time.perf_counter()
        _loop(model, used, x, y)
        plain.append(time.perf_counter() - start)
    model.zero_grad()
    model.ceiling = ceiling
    step()
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    model.ceiling = None
    model.zero_grad()
    _loop(model, batch, x, y)
    worst = max(float((accumulated[n] - p.grad).abs().max()  # type: ignore[operator]
                      / p.grad.abs().max().clamp_min(1e-30))  # type: ignore[union-attr]
                for n, p in model.named_parameters())
    rows: list[list[object]] = [[f"full batch {batch} fails at {failures}, settles at {used}",
             f"{statistics.median(failing) * 1e3:.1f}",
             f"{statistics.median(plain) * 1e3:.1f}",
             f"{statistics.median(failing) / statistics.median(plain):.2f}",
             f"{worst:.1e}"]]
    return rows, (f"Backward runs out of memory above {capacity} samples (fault injection after "
                  f"the upper three layers' gradients were added); {rounds} rounds. The ratio "
                  f"is the failed attempts (a forward and part of a backward at each failed "
                  f"size, then a garbage collection), paid by the call that finds the size; "
                  f"the default cache starts later calls at the size that fitted.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write RESULTS.md")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 3 if args.quick else 15
    rows1, note1 = success_path(rounds, batch=32, micro=8)
    head1 = ["step", "median (ms)", "best (ms)", "median / plain loop"]
    rows2, note2 = with_failures(max(2, rounds // 3), batch=32)
    head2 = ["step", "with failures (ms)", "same micro-batches from the start (ms)", "ratio",
             "max rel. gradient difference vs full batch"]
    body = (header("python benchmarks/accumulate.py --write") + "\n"
            "### The success path\n\n" + markdown_table(head1, rows1) + "\n" + note1 + "\n\n"
            "### A step that runs out of memory in backward\n\n"
            + markdown_table(head2, rows2) + "\n" + note2 + " Load on the machine: "
            f"{' '.join(f'{v:.1f}' for v in os.getloadavg())} (1, 5, 15 min).\n")
    print(body)
    if args.write:
        write_section("Gradient accumulation", body)


if __name__ == "__main__":
    main()
