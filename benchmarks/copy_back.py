"""What copying small paged buffers back after every use costs (see [Note: buffers written
without a version bump] in adaptmem/_paging/writeback.py).

    python benchmarks/copy_back.py                  # CPU pager: many tiny BatchNorms, ResNet-101
    python benchmarks/copy_back.py --gpu            # also ResNet-101 512x512 paged on CUDA
    python benchmarks/copy_back.py --gpu --write    # ... and replace its RESULTS.md section

Each workload is paged three ways in one process, timed in interleaved rounds: "version
only" sets ``COPY_BACK_BYTES`` to -1, so a buffer is copied back only when its version
counter moved (the pager before the fix, which lost batch norm's and fake-quant's writes);
"copy back" is the pager as it is (on CUDA the copies back are queued on the compute stream
and waited for at the end of each call); "copy back, blocking" (CUDA only) makes each copy
back a synchronous one, the simpler design it was measured against. The models are in eval
mode, so no buffer is written: the figures are the cost of copying back buffers that did not
change, which is what a paged CNN pays.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _report import header, markdown_table, write_section  # noqa: E402

from adaptmem import adaptive  # noqa: E402
from adaptmem._paging import writeback  # noqa: E402

SECTION = "Copying small buffers back"


def _paged(model: nn.Module, device: torch.device, blocking: bool, version_only: bool,
           **options: Any) -> tuple[nn.Module, Any]:
    model = copy.deepcopy(model)
    default = writeback.COPY_BACK_BYTES
    writeback.COPY_BACK_BYTES = -1 if version_only else default  # read when paging starts
    try:
        pager = adaptive.page(model, device, **options)
    finally:
        writeback.COPY_BACK_BYTES = default
    if blocking:
        pager._table.transfer.copy_back = lambda master, c: master.copy_(c)
    return model, pager


def compare(name: str, model: nn.Module, x: torch.Tensor, device: torch.device, *,
            rounds: int, per_round: int, clock: Callable[[], float],
            sync: Callable[[], None], **options: Any) -> list[list[object]]:
    """Median and best seconds per forward of each way of paging ``model``, interleaved."""
    ways = {"version only": (False, True), "copy back": (False, False)}
    if device.type == "cuda":
        ways["copy back, blocking"] = (True, False)
    paged = {w: _paged(model, device, b, v, **options) for w, (b, v) in ways.items()}
    buffers = sum(1 for m in model.modules() for b in m._buffers.values() if b is not None)
    times: dict[str, list[float]] = {w: [] for w in ways}
    with torch.no_grad():
        for m, _ in paged.values():  # learn the order, warm up
            m(x)
            m(x)
        sync()
        for _ in range(rounds):
            for way, (m, _) in paged.items():
                start = clock()
                for _ in range(per_round):
                    m(x)
                sync()
                times[way].append((clock() - start) / per_round)
    base = statistics.median(times["version only"])
    rows = []
    for way, t in times.items():
        med = statistics.median(t)
        units = sum(u.placement == "paged" for u in paged[way][1].plan.units)
        rows.append([name, way, f"{med * 1e3:.3f}", f"{min(t) * 1e3:.3f}", f"{med / base:.3f}x",
                     f"{(med - base) / buffers * 1e6:+.2f}", f"{buffers} / {units}"])
        paged[way][1].remove()
    return rows


HEAD = ["workload", "pager", "median ms / forward", "best ms", "vs version only",
        "us per buffer", "buffers / paged units"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="also ResNet-101 paged on CUDA")
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--write", action="store_true", help=f"replace '{SECTION}' in RESULTS.md")
    args = parser.parse_args()
    import torchvision

    torch.manual_seed(0)
    resnet = torchvision.models.resnet101(weights=None).eval()
    rows: list[list[object]] = []
    if not args.gpu_only:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # process time: other jobs on the machine count less
        cpu, none = torch.device("cpu"), lambda: None
        tiny = nn.Sequential(*[m for _ in range(64)
                               for m in (nn.Linear(16, 16), nn.BatchNorm1d(16))]).eval()
        rows += compare("CPU: 64 x (Linear(16,16), BatchNorm1d(16)), batch 1", tiny,
                        torch.randn(1, 16), cpu, rounds=3 * args.rounds, per_round=20,
                        clock=time.process_time, sync=none, unit_bytes=0, resident_bytes=0)
        print(markdown_table(HEAD, rows), flush=True)
        rows += compare("CPU: ResNet-101 224x224, batch 1", resnet, torch.randn(1, 3, 224, 224),
                        cpu, rounds=max(3, args.rounds // 3), per_round=2,
                        clock=time.process_time, sync=none, unit_bytes="16MiB",
                        resident_bytes=0)
        print(markdown_table(HEAD, rows), flush=True)
        torch.set_num_threads(threads)
    if args.gpu or args.gpu_only:
        device = torch.device("cuda", torch.cuda.current_device())
        weights = sum(t.numel() * t.element_size()
                      for t in [*resnet.parameters(), *resnet.buffers()])
        for batch in (1, 16, 64):
            x = torch.randn(batch, 3, 512, 512, device=device)
            # As benchmarks/paging.py pages it: a quarter of the weights on the device.
            rows += compare(f"CUDA: ResNet-101 512x512, batch {batch}", resnet, x, device,
                            rounds=args.rounds, per_round=3, clock=time.perf_counter,
                            sync=lambda: torch.cuda.synchronize(device), resident_bytes=0,
                            device_budget=weights // 4)
            print(markdown_table(HEAD, rows), flush=True)
    text = (header(" ".join(["python benchmarks/copy_back.py", *sys.argv[1:]]))
            + "\n" + markdown_table(HEAD, rows))
    print(text)
    if args.write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
