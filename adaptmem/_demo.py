"""``adaptmem demo``: load, adapt and page a real torchvision model on whatever is here."""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import adaptive
from ._common.devices import default_device, format_bytes, memory_info
from ._spilling import fixed_mmap_threshold

__all__ = ["run_demo"]

IMAGE_SIZE = 96
IMAGES = 384
HEADROOM = 384 * 2**20  # memory left for activations under the cap
MAX_CALLS = 12  # of the batch-size phase, however long --seconds allows


def _say(text: str) -> None:
    print(text, flush=True)


SIMULATED_MEMORY = "16GiB"
SIMULATED_LINK = 25.0  # GB/s


def run_demo(seconds: float = 10.0, simulate_gpu: bool = False) -> int:
    """Run the three levers on resnet18 with random weights; returns a process exit code.

    ``simulate_gpu``: run the GPU branch (a CUDA memory fraction, side-stream paging) on
    ``adaptmem.testing.simulated_cuda`` instead of whatever device is here."""
    if simulate_gpu:
        from ._simcuda import simulated_cuda

        with simulated_cuda(total_memory=SIMULATED_MEMORY, bandwidth=SIMULATED_LINK):
            return _run(seconds, simulated=True)
    return _run(seconds, simulated=False)


def _run(seconds: float, simulated: bool) -> int:
    import torchvision

    torch.manual_seed(0)
    device = default_device()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  [adaptmem] %(message)s"))
    log = logging.getLogger("adaptmem")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        _say(f"adaptmem demo on {device} (torch {torch.__version__})")
        if simulated:
            _say(f"   {device} is a SIMULATED GPU (adaptmem.testing.simulated_cuda: "
                 f"{SIMULATED_MEMORY}, a {SIMULATED_LINK:g} GB/s link); it computes on this "
                 f"CPU, so its speeds are the CPU's, not a GPU's")

        # 1. Loading: a checkpoint on disk, read tensor by tensor onto its final device.
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = Path(tmp) / "resnet18.pt"
            torch.save(torchvision.models.resnet18(weights=None).state_dict(), checkpoint)
            model, stats = adaptive.load(
                lambda: torchvision.models.resnet18(weights=None), checkpoint, device=device,
                return_stats=True,
            )
        model.eval()
        _say(f"1. adaptive.load: {stats.tensors} tensors, {format_bytes(stats.bytes_read)} "
             f"read in {stats.seconds:.2f} s, built on meta first (no second copy)")

        images = torch.randn(IMAGES, 3, IMAGE_SIZE, IMAGE_SIZE)
        sizes: list[int] = []  # every batch size tried, out-of-memory attempts included

        @adaptive.batch(initial_batchsize=IMAGES)
        def classify(batchsize: int, images: torch.Tensor) -> torch.Tensor:
            sizes.append(batchsize)
            with torch.inference_mode():
                return torch.cat([model(chunk.to(device)).argmax(1).cpu()
                                  for chunk in images.split(batchsize)])

        # 2. Adaptive batch size under a memory cap.
        # oneDNN reports a failed allocation as "could not create a primitive", which is not
        # reliably an out-of-memory error, so the capped phase uses torch's own kernels.
        mkldnn = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
        # Freed activations go back to the system, as a device allocator hands them back:
        # see [Note: glibc heap] (the cap would count what glibc keeps otherwise).
        with fixed_mmap_threshold(128 * 1024):
            limit = _cap_memory(device)
            try:  # the cap and kernels are put back on Ctrl-C too
                _say(f"2. @adaptive.batch(initial_batchsize={IMAGES}) "
                     + (f"under {limit}" if limit else
                        f"without a memory cap (the demo caps CUDA, or the CPU on Linux; "
                        f"this is {device} on {sys.platform}), so no call runs out unless "
                        f"the machine does"))
                start = time.perf_counter()
                labels = None
                calls = 0
                settled = False
                # Until two calls in a row use one size with no retry, within the limits.
                while not settled and time.perf_counter() - start < seconds and calls < MAX_CALLS:
                    before = len(sizes)
                    tick = time.perf_counter()
                    labels = classify(images)  # one call site: learned sizes carry over
                    took = time.perf_counter() - tick
                    calls += 1
                    retries = len(sizes) - before - 1
                    settled = calls > 1 and not retries and sizes[-1] == sizes[before - 1]
                    _say(f"   call {calls}: batch size {sizes[-1]}"
                         + (f" after {retries} out-of-memory "
                            f"{'retry' if retries == 1 else 'retries'}" if retries
                            else f", {IMAGES / took:.0f} images/s"))
                why = "settled" if settled else (
                    f"stopped ({MAX_CALLS} calls)" if calls == MAX_CALLS
                    else f"stopped (--seconds {seconds:g} reached)")
                _say(f"   {why} at batch size {sizes[-1]}")
            finally:
                if limit:
                    _uncap_memory(device)
                torch.backends.mkldnn.enabled = mkldnn  # type: ignore[assignment]

        # 3. Paging: weights streamed to the device unit by unit, outputs unchanged.
        budget = sum(p.numel() * p.element_size() for p in model.parameters()) // 4
        with torch.inference_mode():
            reference = model(images[:16].to(device)).cpu()
        with adaptive.page(model, device, resident_bytes=0, device_budget=budget) as pager:
            tick = time.perf_counter()
            with torch.inference_mode():
                paged = model(images[:16].to(device)).cpu()
            took = time.perf_counter() - tick
        same = torch.equal(paged, reference)
        s = pager.stats
        _say(f"3. adaptive.page with a device budget of {format_bytes(budget)} (a quarter of "
             f"the weights): {len(pager.plan.units)} units, {s.transfers} transfers, "
             f"{format_bytes(s.bytes_moved)} moved, {s.refinements} refinements, "
             f"{16 / took:.0f} images/s; outputs {'identical' if same else 'DIFFERENT'}")
        _say("done: every lever ran; see README.md for what each one is for.")
        return 0 if same and labels is not None else 1
    finally:
        log.removeHandler(handler)


def _cap_memory(device: torch.device) -> str | None:
    """What caps the device's memory for the batch phase, set; None where nothing can (the
    CPU cap needs Linux, and MPS and other devices are left uncapped)."""
    if device.type == "cuda":
        free, total = memory_info(device)
        fraction = (torch.cuda.memory_allocated(device) + HEADROOM) / total
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        return f"a CUDA memory fraction of {fraction:.3f} ({format_bytes(fraction * total)})"
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return None
    gib = (adaptive.cpu_memory.held_bytes() + HEADROOM) / 2**30
    adaptive.cpu_memory.set_cpu_memory_limit(gib)
    return f"a CPU memory cap of {gib:.2f} GiB (what the process holds + {format_bytes(HEADROOM)})"


def _uncap_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    else:
        adaptive.cpu_memory.set_cpu_memory_limit(None)
