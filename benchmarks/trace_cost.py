"""What the first call's prediction costs: host time per traced op of ``initial_batchsize=
"auto"`` / ``model=`` (see [Note: starting where it fits] in ``adaptmem/_execution/auto.py``).

    python benchmarks/trace_cost.py [--rounds 5] [--write]

A function that loops over 1024 items through eight ``Linear(512, 512)`` layers is traced on
fake tensors at size 8 (128 forwards, about 3,200 ops), on the CPU and on the simulated CUDA
device, the way the first call traces it: each real tensor converted to a fake once per trace
([Note: one fake per real tensor]), against the same trace converting a weight at every op
that reads it (torch's default, which drops a fake as soon as nothing holds it). Rounds
alternate the two, so load from other processes weighs on both alike; the best round counts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _report import header, markdown_table, write_section  # noqa: E402
from dispatch import LAYERS, WIDTH, build  # noqa: E402  # the model= benchmark's model
from torch import nn  # noqa: E402

from adaptmem._execution import auto  # noqa: E402
from adaptmem.testing import simulated_cuda  # noqa: E402

ITEMS, SIZE = 1024, 8


def _timed_trace(model: nn.Module, data: torch.Tensor, device: torch.device) -> tuple[float, int]:
    """Seconds and ops of one trace at ``SIZE``."""
    ops = 0
    guard = auto._Guard.__torch_dispatch__

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal ops
        ops += 1
        return guard(self, *args, **kwargs)

    auto._Guard.__torch_dispatch__ = counting  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        auto._trace(lambda n: torch.cat([model(c) for c in data.split(n)]), SIZE, device)
        return time.perf_counter() - started, ops
    finally:
        auto._Guard.__torch_dispatch__ = guard  # type: ignore[method-assign]


def _measure(device: str, rounds: int) -> dict[str, tuple[float, int]]:
    keep = auto._keep_conversions
    best: dict[str, tuple[float, int]] = {}
    model, data = build(), torch.randn(ITEMS, WIDTH)
    if device == "cuda":
        model.cuda()
        data = data.cuda()
    dev = torch.device(device)
    _timed_trace(model, data, dev)  # first trace: torch's compiler imports and caches
    for r in range(rounds):
        for variant in (("kept", "per op") if r % 2 == 0 else ("per op", "kept")):
            auto._keep_conversions = keep if variant == "kept" else (lambda mode: {})
            try:
                seconds, ops = _timed_trace(model, data, dev)
            finally:
                auto._keep_conversions = keep
            if variant not in best or seconds < best[variant][0]:
                best[variant] = (seconds, ops)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="write the RESULTS.md section")
    args = parser.parse_args()
    rows = []
    for device in ("cpu", "cuda"):
        if device == "cuda" and not torch.cuda.is_available():
            with simulated_cuda(total_memory="4GiB"):
                got = _measure(device, args.rounds)
            label = "cuda (SIMULATED)"
        else:
            got = _measure(device, args.rounds)
            label = device
        (kept_s, ops), (per_op_s, _) = got["kept"], got["per op"]
        rows.append([label, ops, f"{kept_s:.2f}", f"{kept_s / ops * 1e3:.2f}",
                     f"{per_op_s:.2f}", f"{per_op_s / ops * 1e3:.2f}",
                     f"{kept_s / per_op_s:.2f}"])
    table = markdown_table(["device", "ops traced", "kept: s", "kept: ms/op",
                            "per op: s", "per op: ms/op", "kept / per op"], rows)
    print(table)
    if args.write:
        write_section(
            "First-call trace cost",
            header(f"python benchmarks/trace_cost.py --rounds {args.rounds} --write") + "\n"
            + f"One trace at size {SIZE} of a loop over {ITEMS} items through {LAYERS} "
            f"`Linear({WIDTH}, {WIDTH})` layers (what the first call of `initial_batchsize="
            f"\"auto\"` or `model=` runs for such a function), best of {args.rounds} rounds "
            f"each, alternating. 'kept': each real tensor turned into a fake once per trace "
            f"(adaptmem since 2026-11-27); 'per op': a weight converted again at every op "
            f"that reads it (torch's default, what adaptmem did before). The simulated "
            f"device's figures include the simulation's own cost per op.\n\n" + table)


if __name__ == "__main__":
    main()
