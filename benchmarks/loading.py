"""Loading a GPT-2-large-shaped checkpoint: peak memory and time of each way to load it.

    python benchmarks/loading.py                    # GPT-2 large (774M, fp32), device auto
    python benchmarks/loading.py --model xl          # GPT-2 XL (1.56B) where memory allows
    python benchmarks/loading.py --model tiny        # a seconds-long smoke run

The model is built from a config with random weights (transformers' GPT2LMHeadModel when
installed, else an equivalent built here), saved as .pt, .safetensors and one file per
tensor, then every method runs in a fresh subprocess so peaks do not mix. Each process
samples its RSS in a thread (every 2 ms) and reports:

- build s / load s: building the model (real, or on meta) / reading the weights into it;
- peak above start: highest RSS during build + load, minus RSS before building;
- after load / after use: RSS minus start once loaded, and once every weight was read
  (a checksum over all tensors, which also checks the load; zero-copy methods only pay for
  pages when they are touched);
- device peak: torch.cuda.max_memory_allocated() on a GPU.

The page cache is warmed before each run (every method reads from memory, not disk).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from torch import nn

SHAPES = {  # GPT-2 sizes: width, layers, heads
    "tiny": (256, 4, 4),
    "large": (1280, 36, 20),
    "xl": (1600, 48, 25),
}
VOCAB, POSITIONS = 50257, 1024

METHODS = [
    # name, checkpoint kind
    ("baseline: to(device) + load_state_dict(torch.load)", "pt"),
    ("param-by-param copy", "pt"),
    ("meta + torch.load(mmap) + assign", "pt"),
    ("per-tensor files, meta + assign", "dir"),
    ("accelerate load_checkpoint_in_model + dispatch (.pt)", "pt"),
    ("accelerate load_checkpoint_in_model + dispatch (.safetensors)", "safetensors"),
    ("adaptmem (.pt)", "pt"),
    ("adaptmem (.safetensors)", "safetensors"),
    ("adaptmem (per-tensor files)", "dir"),
    ("adaptmem copy=False (.safetensors, file-backed)", "safetensors"),
]


# -- the model ------------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


class _GPT2(nn.Module):
    """Parameter-for-parameter a GPT-2 of this shape, for machines without transformers."""

    def __init__(self, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(POSITIONS, width)
        self.h = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.wte.weight


def factory(model: str) -> Callable[[], nn.Module]:
    width, layers, heads = SHAPES[model]
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return lambda: _GPT2(width, layers, heads)
    config = GPT2Config(n_embd=width, n_layer=layers, n_head=heads, vocab_size=VOCAB,
                        n_positions=POSITIONS)
    return lambda: GPT2LMHeadModel(config)


# -- one method, in its own process ---------------------------------------------------------

def _rss() -> int:
    return psutil.Process().memory_info().rss


class _Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _rss()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, _rss())


def _build_and_load(method: str, build: Callable[[], nn.Module], work: Path,
                    device: torch.device) -> tuple[nn.Module, float]:
    """Run ``method``; return the model and the seconds spent building it."""
    pt, st, per = work / "model.pt", work / "model.safetensors", work / "per-tensor"
    t0 = time.perf_counter()
    if method.startswith("baseline"):
        model = build().to(device)
        built = time.perf_counter() - t0
        model.load_state_dict(torch.load(pt, weights_only=True))
        return model, built
    if method.startswith("param-by-param"):
        model = build().to(device)
        built = time.perf_counter() - t0
        state = torch.load(pt, map_location="cpu", weights_only=True)
        with torch.no_grad():
            for name, tensor in model.state_dict(keep_vars=True).items():
                tensor.copy_(state.pop(name))
        return model, built
    if method.startswith("meta + torch.load"):
        with torch.device("meta"):
            model = build()
        built = time.perf_counter() - t0
        model.load_state_dict(torch.load(pt, mmap=True, weights_only=True), assign=True)
        return model.to(device), built
    if method.startswith("per-tensor files, meta"):
        with torch.device("meta"):
            model = build()
        built = time.perf_counter() - t0
        for f in sorted(per.iterdir()):
            tensor = torch.load(f, map_location=device, weights_only=True)
            model.load_state_dict({f.stem: tensor}, strict=False, assign=True)
        return model, built
    if method.startswith("accelerate"):
        from accelerate import dispatch_model, init_empty_weights, load_checkpoint_in_model

        with init_empty_weights():
            model = build()
        model.tie_weights()  # init_empty_weights re-wraps the tied parameter, untying it
        built = time.perf_counter() - t0
        path = st if "safetensors" in method else pt
        # accelerate wants a GPU index; torch.device("cuda") has none until it is resolved
        index = torch.cuda.current_device() if device.index is None else device.index
        device_map = {"": index if device.type == "cuda" else str(device)}
        # load_checkpoint_and_dispatch, with the re-tie accelerate's docs ask for in between
        # (a safetensors file stores a tied weight once).
        load_checkpoint_in_model(model, str(path), device_map=device_map)
        model.tie_weights()
        return dispatch_model(model, device_map=device_map), built
    if method.startswith("adaptmem"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from adaptmem import adaptive

        model = adaptive.empty_model(build)
        built = time.perf_counter() - t0
        path = per if "per-tensor" in method else st if "safetensors" in method else pt
        return adaptive.load(model, path, device=device, copy="copy=False" not in method), built
    raise SystemExit(f"unknown method {method!r}")


def worker(method: str, model_name: str, work: Path, device_name: str) -> None:
    device = torch.device(device_name)
    build = factory(model_name)
    if device.type == "cuda":
        torch.cuda.init()
    gc.collect()
    start = _rss()
    sampler = _Sampler()
    sampler.start()
    t0 = time.perf_counter()
    with torch.no_grad():
        model, built = _build_and_load(method, build, work, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    after = _rss()
    sums = {k: float(v.double().sum()) for k, v in model.state_dict().items()}
    used = _rss()
    expected = json.loads((work / "sums.json").read_text())
    bad = [k for k, v in expected.items() if abs(sums.get(k, float("nan")) - v) > 1e-6 * (1 + abs(v))]
    result = {
        "method": method, "build_s": built, "load_s": seconds - built,
        "peak_above_start": peak - start, "after_load": after - start, "after_use": used - start,
        "device_peak": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "wrong_tensors": bad[:5],
    }
    print("RESULT " + json.dumps(result))


# -- the driver -----------------------------------------------------------------------------

def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _warm(path: Path) -> None:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    buf = bytearray(64 * 2**20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="large")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (deleted afterwards)")
    ap.add_argument("--only", default=None, help="run methods whose name contains this")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds one method may take before it is recorded as failed")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.worker:
        worker(args.worker, args.model, Path(args.workdir), device)
        return

    work = Path(tempfile.mkdtemp(prefix="adaptmem-bench-", dir=args.workdir))
    try:
        print(f"building {args.model} with random weights ...", flush=True)
        torch.manual_seed(0)
        source = factory(args.model)().eval()
        state = source.state_dict()
        n_params = sum(p.numel() for p in source.parameters())
        model_bytes = sum(p.nbytes for p in source.parameters()) + sum(
            b.nbytes for b in source.buffers())
        largest = max(t.nbytes for t in state.values())
        (work / "sums.json").write_text(json.dumps(
            {k: float(v.double().sum()) for k, v in state.items()}))
        torch.save(state, work / "model.pt")
        from safetensors.torch import save_file

        # As save_pretrained does: a tied tensor is stored once, under its first name.
        seen: set[int] = set()
        unique = {}
        for k, v in state.items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                unique[k] = v.contiguous()
        save_file(unique, str(work / "model.safetensors"), metadata={"format": "pt"})
        del unique
        (work / "per-tensor").mkdir()
        for k, v in state.items():
            torch.save(v.clone(), work / "per-tensor" / f"{k}.pt")
        del source, state
        gc.collect()
        print(f"{n_params / 1e6:.0f}M parameters, {_gib(model_bytes)} GiB, largest tensor "
              f"{largest / 2**20:.0f} MiB; device {device}", flush=True)

        rows = []
        for method, kind in METHODS:
            if args.only and args.only not in method:
                continue
            _warm({"pt": work / "model.pt", "safetensors": work / "model.safetensors",
                   "dir": work / "per-tensor"}[kind])
            try:
                proc = subprocess.run(
                    [sys.executable, __file__, "--worker", method, "--model", args.model,
                     "--workdir", str(work), "--device", device],
                    capture_output=True, text=True, timeout=args.timeout,
                )
            except subprocess.TimeoutExpired:
                print(f"{method}: FAILED (over {args.timeout} s)", flush=True)
                rows.append({"method": method, "failed": f"over {args.timeout} s"})
                continue
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"{method}: FAILED ({tail[:160]})", flush=True)
                rows.append({"method": method, "failed": tail[:100]})
                continue
            r = json.loads(line[7:])
            rows.append(r)
            print(f"{method}: build {r['build_s']:.1f}s load {r['load_s']:.1f}s peak "
                  f"{_gib(r['peak_above_start'])} GiB", flush=True)

        print()
        print(f"{args.model}: {n_params / 1e6:.0f}M parameters, {_gib(model_bytes)} GiB fp32, "
              f"largest tensor {largest / 2**20:.0f} MiB, device {device}")
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, "
              f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, torch {torch.__version__}")
        print()
        print("| method | build s | load s | host peak above start GiB | after load GiB | "
              "after use GiB | device peak GiB |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            if "failed" in r:
                print(f"| {r['method']} | failed: {r['failed']} | | | | | |")
                continue
            wrong = f" (WRONG: {r['wrong_tensors']})" if r["wrong_tensors"] else ""
            print(f"| {r['method']}{wrong} | {r['build_s']:.1f} | {r['load_s']:.1f} | "
                  f"{_gib(r['peak_above_start'])} | {_gib(r['after_load'])} | "
                  f"{_gib(r['after_use'])} | {_gib(r['device_peak'])} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
