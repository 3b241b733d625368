"""``adaptmem example train``: a training step that runs out of memory, then fits with
``adaptive.spill`` (as Large Model Support's ManyModel example showed)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import math
import time
import warnings
from typing import Any

import torch
from torch import nn

from ._common.devices import format_bytes, parse_size, resolve_device
from ._common.errors import CommandLineError, first_line
from ._common.oom import drop_frames, is_oom
from ._spilling import fixed_mmap_threshold, memory_stats, spill

__all__ = ["add_example_parser"]


def add_example_parser(sub: Any) -> None:
    """Register ``adaptmem example train`` on the console script's subcommands."""
    example = sub.add_parser("example", help="runnable examples (train: spilling activations)")
    kinds = example.add_subparsers(dest="example", required=True)
    # A missing example is named by its choices, "{train}", not the internal dest: the
    # metavar is set below, once they are known (argparse's usage shows the same).
    train = kinds.add_parser(
        "train", help="a training step without spilling, then with adaptive.spill",
        description="Train one step of a torchvision model on synthetic images, first "
                    "without spilling and then with adaptive.spill, and print the memory "
                    "statistics. --cap makes the CPU run out for real.")
    train.add_argument("--model", default="resnet50",
                       help="torchvision image classifier name (default resnet50; random "
                            "weights, nothing is downloaded)")
    train.add_argument("--image-size", type=int, default=224,
                       help="side of the synthetic square images in pixels (default 224)")
    train.add_argument("--batch", type=int, default=16,
                       help="images in the step, 2 or more (default 16)")
    train.add_argument("--device", default=None, help="default: the GPU if any, else the CPU")
    train.add_argument("--cap", default=None, metavar="SIZE",
                       help="CPU only: the memory this process may hold, in GiB (1.5) or "
                            "with a unit (1.5GiB, 1600MB) "
                            "(adaptive.cpu_memory.set_cpu_memory_limit)")
    train.add_argument("--threshold", default="1MiB", help="adaptive.spill threshold")
    train.add_argument("--limit", default="auto", help="adaptive.spill limit (bytes, 'auto')")
    train.add_argument("--to", default=None, help="adaptive.spill tier: 'host' or a directory")
    train.set_defaults(func=_cmd_train, prog=train.prog)
    kinds.metavar = "{" + ",".join(kinds.choices) + "}"


def _step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    return float(loss.detach())


def _attempt(label: str, run: Any) -> bool:
    start = time.perf_counter()
    try:
        loss = run()
    except (RuntimeError, MemoryError) as exc:
        # Under a cap oneDNN reports a failed allocation as "could not create a primitive".
        what = "out of memory" if is_oom(exc) else "failed"
        first = first_line(exc, 110, typed=False)
        drop_frames(exc)  # the failed step's activations go with its frames
        del exc
        gc.collect()
        print(f"{label}: {what} after {time.perf_counter() - start:.1f} s ({first})")
        return False
    print(f"{label}: done in {time.perf_counter() - start:.1f} s, loss {loss:.4f}")
    return True


def _check_image_size(builder: Any, name: str, size: int) -> None:
    """Refuse an image size the model rejects (a vision transformer's fixed 224, a size
    that pools to nothing) before anything runs, from a forward of the same model on the
    meta device: no memory, no compute. An op meta cannot run leaves the check to the
    steps themselves."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the builder's own, shown for the real model
            twin = builder(**{n: None for n in inspect.signature(builder).parameters
                              if n.startswith("weights")})
            images = torch.empty(2, 3, size, size)
    except NotImplementedError:  # a builder that reads values (regnet's) cannot run there
        return
    try:
        with torch.no_grad():
            twin.train()(images)
    except NotImplementedError:
        return
    except Exception as exc:  # noqa: BLE001 - the model's own refusal, of any type
        said = first_line(exc, 150, typed=False)
        raise CommandLineError(
            f"--image-size {size}: {name} does not take {size}x{size} images ({said}); "
            f"give a size it takes (224 for most torchvision classifiers, 299 for "
            f"inception_v3)") from None


def _classifies(model: nn.Module) -> bool:
    """Whether torchvision ``model`` is an image classifier (not detection, segmentation,
    video or optical flow): the modules its builders come from."""
    return type(model).__module__.startswith("torchvision.models.") and not any(
        part in type(model).__module__ for part in
        (".detection.", ".segmentation.", ".video.", ".optical_flow.", ".quantization."))


def _cap_gib(text: str) -> float:
    """``--cap``: a number of GiB (``1.5``) or a size with a unit (``1.5GiB``, ``1600MB``)."""
    try:
        gib = float(text)
    except ValueError:
        try:
            gib = parse_size(text, "--cap") / 2**30
        except ValueError:
            raise CommandLineError(
                f"--cap {text!r} is not a memory size; give GiB as a number (1.5) or a size "
                f"with a unit (1.5GiB, 1600MB)") from None
    if not (gib > 0 and math.isfinite(gib)):
        raise CommandLineError(f"--cap must be a positive, finite memory size, got {text!r}; "
                               f"give GiB as a number (1.5) or a size with a unit (1.5GiB)")
    return gib


def _cmd_train(args: argparse.Namespace) -> int:
    try:
        import torchvision
    except ImportError:
        raise CommandLineError(
            "it trains a torchvision model, but torchvision is not installed; install it "
            "(pip install torchvision, the build that matches your torch)") from None

    from .cpu_memory import held_bytes, set_cpu_memory_limit

    if args.batch < 2:  # a training step of these models normalises over the batch
        raise CommandLineError(f"--batch must be 2 or more images (batch norm needs more "
                               f"than one value per channel), got {args.batch}")
    if args.image_size < 1:
        raise CommandLineError(f"--image-size must be a positive number of pixels, got "
                               f"{args.image_size}")
    cap = None if args.cap is None else _cap_gib(args.cap)
    try:
        device = resolve_device(args.device, "--device")
    except ValueError as exc:  # its advice "or None" is the API's: here, leave --device out
        said, api_advice = str(exc), "; use 'cpu' or None"
        if said.endswith(api_advice):
            said = (said[:-len(api_advice)] + "; give --device cpu, or leave --device out for "
                    "the GPU if any, else the CPU")
        raise CommandLineError(said) from None
    try:
        handle = spill(args.threshold, args.limit, args.to)
    except (TypeError, ValueError) as exc:
        raise CommandLineError(exc) from None
    try:
        builder = torchvision.models.get_model_builder(args.model)
    except ValueError:
        raise CommandLineError(
            f"--model {args.model!r} is not a torchvision model; give an image classifier's "
            f"name, e.g. resnet50 or efficientnet_b0 (torchvision.models.list_models() "
            f"lists them)") from None
    # Detection and segmentation builders download a pretrained backbone unless told
    # not to: every weights argument is None, so nothing is downloaded.
    model = builder(**{name: None for name in inspect.signature(builder).parameters
                       if name.startswith("weights")})
    if not _classifies(model):
        raise CommandLineError(f"--model {args.model!r} is not an image classifier (its step "
                               f"takes images and class labels); try resnet50 or "
                               f"efficientnet_b0")
    if cap is not None and device.type != "cpu":
        raise CommandLineError("--cap is for the CPU; on a GPU the step runs against the "
                               "device's own memory (leave out --cap, or give --device cpu)")
    _check_image_size(builder, args.model, args.image_size)
    model = model.to(device).train()
    torch.manual_seed(0)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, 1000, (args.batch,), device=device)
    if cap is not None:  # before the header: a cap refused is a mistake on the command line
        held = held_bytes()
        if cap * 2**30 <= held:
            raise CommandLineError(
                f"--cap {args.cap} is below the {format_bytes(held)} this process holds with "
                f"the model and the step's inputs made; give more than {held / 2**30:.2f} GiB, "
                f"or leave --cap out")
        try:
            set_cpu_memory_limit(cap)
        except ValueError as exc:  # above the hard limit
            raise CommandLineError(f"--cap {args.cap}: {exc}") from None
    where = f"{device}" + (f", this process capped at {cap:g} GiB" if cap else "")
    print(f"adaptmem example train: {args.model}, {args.batch} images of "
          f"{args.image_size}x{args.image_size} on {where}; {handle}")
    # A cap counts address space, which glibc's heap keeps after a free: under one, both
    # steps map large tensors of their own (see adaptive.spill's mmap_threshold).
    with fixed_mmap_threshold(1 << 20) if cap is not None else contextlib.nullcontext():
        _attempt("step without spilling", lambda: _step(model, images, labels))
        while True:  # limit="auto" keeps more memory free after a step ran out
            keep_free = handle.keep_free
            ok = _attempt(f"step with adaptive.spill (keeping {keep_free:.0%} of free memory)"
                          if handle.limit == "auto" else "step with adaptive.spill",
                          lambda: handle(_step)(model, images, labels))
            if ok or handle.keep_free == keep_free:  # done, or nothing left to adapt
                break
    s = handle.stats
    print(f"spilled {format_bytes(s.bytes_out)} in {s.tensors_spilled} tensors "
          f"({s.tensors_shared} more saved views of them), restored {format_bytes(s.bytes_in)}; "
          f"prefetch hits {s.prefetch_hits}, misses {s.prefetch_misses}; "
          f"waited {s.seconds_waiting:.2f} s")
    print(memory_stats())
    return 0 if ok else 1
