"""Spilling saved activations: step time, disk throughput, and memory under a cap.

    python benchmarks/spill.py                 # CPU: the three parts below
    python benchmarks/spill.py --write         # and put the figures into RESULTS.md
    python benchmarks/spill.py --quick         # a smoke run (small sizes, few rounds)

1. Step time (forward + backward of a training step, where every variant fits): no spilling;
   ``adaptive.spill(limit="auto")`` with memory plentiful (the hooks' own cost: nothing is
   spilled); ``adaptive.spill(limit=0)`` spilling every saved tensor of 1 MiB or more to
   disk (CPU) / pinned host memory (GPU); ``torch.autograd.graph.save_on_cpu``, the
   alternative, which copies every saved tensor, synchronously. Interleaved rounds; the
   median and best are reported.
2. The disk tier's throughput (bytes spilled / time the background copies took) against the
   disk's sequential speed measured in the same run: buffered ``pwrite`` of 8 MiB blocks
   (what the tier does), the same with ``fsync`` (the device itself), and reads (warm,
   and cold after ``posix_fadvise(DONTNEED)``).
3. Memory: a step whose activations do not fit under ``set_cpu_memory_limit`` runs out of
   memory without spilling and completes with it; each run in its own process, with the
   peak anonymous resident memory sampled every millisecond.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import header, markdown_table, write_section  # noqa: E402

from adaptmem import adaptive  # noqa: E402


def _models(quick: bool) -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], Any]]]:
    import torchvision

    image = 32 if quick else 64
    batch = 4 if quick else 16

    def encoder() -> torch.nn.Module:
        layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
        return torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)

    return {
        f"ResNet-18 {image}x{image}, batch {batch}": (
            lambda: torchvision.models.resnet18(num_classes=10),
            lambda: torch.randn(batch, 3, image, image)),
        f"TransformerEncoder 4x256, seq 256, batch {batch // 2}": (
            encoder, lambda: torch.randn(batch // 2, 256, 256)),
    }


def _variants(device: torch.device, scratch: str) -> dict[str, Callable[[], Any]]:
    to: str | None = scratch if device.type == "cpu" else "host"
    return {
        "no spilling": lambda: None,
        "spill, limit=auto (nothing to spill)": lambda: adaptive.spill(to=to),
        "spill, limit=0 (all >= 1 MiB)": lambda: adaptive.spill(limit=0, to=to),
        "torch save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(
            pin_memory=device.type == "cuda"),
    }


def step_times(device: torch.device, rounds: int, quick: bool, scratch: str
               ) -> tuple[list[list[object]], dict[str, Any]]:
    rows: list[list[object]] = []
    disk: dict[str, Any] = {"bytes_out": 0, "bytes_in": 0, "seconds_writing": 0.0,
                            "seconds_reading": 0.0}
    for name, (build, data) in _models(quick).items():
        torch.manual_seed(0)
        model = build().to(device).train()
        x = data().to(device)
        variants = _variants(device, scratch)
        times: dict[str, list[float]] = {v: [] for v in variants}
        spilled: dict[str, int] = {}
        for r in range(rounds + 1):  # round 0 warms up
            for vname, make in variants.items():
                ctx = make()
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                if ctx is None:
                    model(x).float().pow(2).mean().backward()
                else:
                    with ctx:
                        model(x).float().pow(2).mean().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                took = time.perf_counter() - start
                if r:
                    times[vname].append(took)
                    stats = getattr(ctx, "stats", None)
                    if stats is not None:
                        spilled[vname] = stats.bytes_out
                        if vname.startswith("spill, limit=0") and device.type == "cpu":
                            for k in disk:
                                disk[k] += getattr(stats, k)
        base = statistics.median(times["no spilling"])
        for vname, ts in times.items():
            med = statistics.median(ts)
            moved = spilled.get(vname)
            rows.append([name, vname, f"{med * 1e3:.0f} ms", f"{min(ts) * 1e3:.0f} ms",
                         f"{med / base:.2f}x",
                         "-" if moved is None else f"{moved / 2**20:.0f} MiB"])
    return rows, disk


class _Chain(torch.nn.Module):
    """48 layers of tanh(x * w): one 8 MiB activation saved per layer, almost no compute."""

    def __init__(self, layers: int = 48) -> None:
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(1024))
                                        for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.w:
            x = torch.tanh(x * w)
        return x


def tier_speed(directory: str, layers: int) -> tuple[float, float]:
    """The disk tier's (out, in) bytes per second on a step that is nearly all copying."""
    model, x = _Chain(layers), torch.randn(2048, 1024)
    best = (0.0, 0.0)
    for _ in range(3):
        with adaptive.spill(limit=0, to=directory) as handle:
            model(x).sum().backward()
        s = handle.stats
        best = (max(best[0], s.bytes_out / s.seconds_writing),
                max(best[1], s.bytes_in / s.seconds_reading))
    return best


def disk_speed(directory: str, nbytes: int) -> dict[str, float]:
    """Sequential MB/s of the disk under ``directory``: buffered and fsync'd writes of 8 MiB
    blocks, warm and cold reads."""
    block = os.urandom(8 << 20)
    out: dict[str, float] = {}
    for label, sync in (("write, buffered", False), ("write, fsync", True)):
        best = 0.0
        for _ in range(2):  # a fresh file each time, the faster of two
            fd, path = tempfile.mkstemp(dir=directory)
            try:
                start = time.perf_counter()
                for off in range(0, nbytes, len(block)):
                    os.pwrite(fd, block, off)
                if sync:
                    os.fsync(fd)
                best = max(best, nbytes / (time.perf_counter() - start))
            finally:
                os.close(fd)
                os.unlink(path)
        out[label] = best
    fd, path = tempfile.mkstemp(dir=directory)
    try:
        for off in range(0, nbytes, len(block)):
            os.pwrite(fd, block, off)
        os.fsync(fd)
        for label, cold in (("read, warm", False), ("read, cold", True)):
            if cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            off = 0
            while off < nbytes:
                off += len(os.pread(fd, len(block), off))
            out[label] = nbytes / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)
    return out


_CHILD = """
import ctypes, sys, threading, time, torch
from adaptmem import adaptive
from adaptmem._spilling._stats import in_use_bytes
ctypes.CDLL(None).mallopt(-3, 1 << 20)  # spill(mmap_threshold="1MiB")'s setting, all runs
torch.set_num_threads(1)
mode, headroom = sys.argv[1], int(sys.argv[2])

class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1024))

    def forward(self, x):
        return torch.tanh(x * self.w)

model = torch.nn.Sequential(*[Layer() for _ in range(48)])
x = torch.randn(2048, 1024)
cpu = torch.device("cpu")
start = in_use_bytes(cpu)
peak, done = [start], False

def sample():
    while not done:
        peak[0] = max(peak[0], in_use_bytes(cpu))
        time.sleep(0.001)

threading.Thread(target=sample, daemon=True).start()
if headroom:
    adaptive.cpu_memory.set_cpu_memory_limit((start + headroom) / 2**30)
t0 = time.perf_counter()
try:
    if mode == "spill":
        with adaptive.spill() as handle:
            model(x).sum().backward()
    else:
        model(x).sum().backward()
    result = "completed"
except RuntimeError as exc:
    result = "out of memory" if adaptive.is_oom(exc) else repr(exc)
done = True
spilled = handle.stats.bytes_out if mode == "spill" and result == "completed" else 0
print("RESULT", result.replace(" ", "_"), peak[0] - start, start + headroom, spilled,
      time.perf_counter() - t0)
"""


def memory_under_cap(headroom: int) -> list[list[object]]:
    rows = []
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for mode, cap in (("no spilling, no cap", 0), ("no spilling", headroom),
                      ("adaptive.spill()", headroom)):
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_CHILD),
             "spill" if "spill(" in mode else "plain", str(cap)],
            capture_output=True, text=True, timeout=600, env=env)
        line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT")), None)
        if line is None:
            rows.append([mode, "crashed: " + proc.stderr.strip()[-200:], "-", "-", "-", "-"])
            continue
        _, result, peak, limit, spilled, took = line.split()
        rows.append([mode, result.replace("_", " "),
                     f"{int(peak) / 2**20:.0f} MiB",
                     "none" if not cap else f"{int(cap) / 2**20:.0f} MiB",
                     f"{int(spilled) / 2**20:.0f} MiB", f"{float(took):.2f} s"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--dir", default=None, help="spill directory (default: the temp dir)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write", action="store_true", help="write the figures to RESULTS.md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    scratch = args.dir or tempfile.gettempdir()
    load = os.getloadavg()[0]

    rows, disk = step_times(device, 1 if args.quick else args.rounds, args.quick, scratch)
    steps = markdown_table(["model", "variant", "median step", "best step", "vs no spilling",
                            "spilled / step"], rows)
    print(steps)

    parts = [header("python benchmarks/spill.py " + " ".join(sys.argv[1:]))
             + f"- load average at start {load:.1f}\n", "### Step time (every variant fits)\n",
             steps]
    if device.type == "cpu":
        speed = disk_speed(scratch, (128 if args.quick else 512) << 20)
        during = (disk["bytes_out"] / disk["seconds_writing"] if disk["seconds_writing"] else 0,
                  disk["bytes_in"] / disk["seconds_reading"] if disk["seconds_reading"] else 0)
        alone = tier_speed(scratch, 12 if args.quick else 48)
        mb = 1e6
        disk_rows = [[k, f"{v / mb:.0f} MB/s", "-"] for k, v in speed.items()]
        for what, (tier_w, tier_r) in (("a copy-bound step (tanh chain)", alone),
                                       ("the model steps above", during)):
            disk_rows += [
                [f"spill tier out, {what}", f"{tier_w / mb:.0f} MB/s",
                 f"{tier_w / speed['write, buffered']:.2f}x buffered, "
                 f"{tier_w / speed['write, fsync']:.2f}x fsync"],
                [f"spill tier back, {what}", f"{tier_r / mb:.0f} MB/s",
                 f"{tier_r / speed['read, warm']:.2f}x warm, "
                 f"{tier_r / speed['read, cold']:.2f}x cold"],
            ]
        table = markdown_table(["what", "throughput", "vs the disk"], disk_rows)
        print(table)
        parts += [f"### Disk tier against the disk ({scratch})\n", table]
        mem = memory_under_cap(176 << 20 if args.quick else 288 << 20)
        mtable = markdown_table(["run", "result", "peak held above start", "cap above start",
                                 "spilled", "time"], mem)
        print(mtable)
        parts += ["### A step that does not fit under a memory cap\n", mtable]
    if args.write:
        title = "Spilling" if device.type == "cpu" else "Spilling on a GPU"
        write_section(title, "\n".join(parts) + "\n" + NOTES)


NOTES = """\
Step time: median and best of interleaved rounds; 'spilled / step' is what the spill
handle copied out in the last round. On the CPU, save_on_cpu copies each saved tensor into
another CPU tensor (it frees nothing there) and spilling writes it to a scratch file: both
are the price of moving activations, paid here with no memory pressure at all. Disk tier:
the tier's throughput is bytes moved over the time its background thread spent (wall
time: on a busy 2-core machine that includes waiting for a core while the step computes),
to compare with the buffered sequential speed of the same disk (what the tier does: the
page cache absorbs writes, the kernel writes back behind) and the device's own (fsync,
cold read). Copies back read into freshly allocated tensors, whose first touch costs page
faults that the disk's warm-read figure (one reused buffer) does not pay.
Memory: 48 layers of tanh(x * w) on 2048x1024 fp32 inputs (8 MiB per activation, 384 MiB
saved), each run in its own process; the cap is `set_cpu_memory_limit` at the memory in use
at start plus the headroom shown; peak held is the anonymous resident memory (what the cap
counts) sampled every millisecond, minus that at start. All runs use the allocator setting
that `spill(mmap_threshold="1MiB")` makes under a cap (glibc mmap threshold 1 MiB), so the
runs differ only in spilling.
"""


if __name__ == "__main__":
    main()
