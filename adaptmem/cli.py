"""The ``adaptmem`` console script: ``adaptmem demo``, ``adaptmem plan MODEL`` and
``adaptmem example train``.

Mistakes on the command line (a bad size, a factory that cannot build a model, an input size
the model rejects) end with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch
from torch import nn

from ._common.devices import format_bytes
from ._common.errors import CommandLineError as _UsageError
from ._common.errors import first_line

__all__ = ["main"]

# Options whose values may start with "-" ("--budget -5MiB" must reach the size parser, which
# says what is wrong with it, rather than argparse's "expected one argument").
_DASH_VALUE_OPTIONS = ("--budget", "--image-size", "--batch", "--cap", "--threshold", "--limit",
                       "--seconds")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


@contextlib.contextmanager
def _no_downloads(spec: str) -> Iterator[None]:
    """Building a model to plan it needs its architecture only: a constructor that tries to
    download weights (torch.hub, as torchvision's builders do) is refused, not waited on."""
    import torch.hub

    original = torch.hub.download_url_to_file

    def refuse(url: str, *args: Any, **kwargs: Any) -> None:
        raise _UsageError(
            f"building {spec!r} tried to download weights ({url}); adaptmem plan needs the "
            f"architecture only: make the factory build it without pretrained weights "
            f"(e.g. weights=None)")

    torch.hub.download_url_to_file = refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.hub.download_url_to_file = original  # type: ignore[assignment]


def _torchvision_builder(spec: str) -> Any:
    try:
        import torchvision
    except ImportError:
        raise _UsageError(
            f"model {spec!r} is read as a torchvision model name, but torchvision is not "
            f"installed; install it or give a 'package.module:factory' path") from None
    try:
        return torchvision.models.get_model_builder(spec)
    except ValueError:
        raise _UsageError(
            f"unknown model {spec!r}; give a torchvision model name (e.g. resnet101) or a "
            f"'package.module:factory' path") from None


def _factory(spec: str, label: str = "model", wanted: str = "factory",
             role: str = "a function or class that builds the model") -> Any:
    """The object ``spec`` (``package.module:attribute``) names; errors start with ``label``
    ("model 'x'", "--example 'x'") and ask for a ``wanted`` that is ``role``."""
    label = f"{label} {spec!r}"
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        like = "torchvision.models:resnet18" if wanted == "factory" else "mymodels:make_inputs"
        raise _UsageError(f"{label}: write a {wanted} as 'package.module:{wanted}', e.g. "
                          f"{like!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's path
        raise _UsageError(f"{label}: cannot import {module_name!r} ({first_line(exc)}); "
                          f"check the module path and that it is importable here") from None
    found: Any = module
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise _UsageError(f"{label}: {module_name!r} has no attribute {attr!r}; "
                              f"name {role}") from None
    return found


def _build_model(spec: str) -> nn.Module:
    """A model on the meta device from a torchvision name or a ``module:attribute`` factory,
    built with random (never downloaded) weights."""
    if ":" in spec:
        factory, kwargs, what = _factory(spec), {}, f"calling {spec!r}"
    else:
        factory = _torchvision_builder(spec)
        # Detection and segmentation builders download a pretrained backbone unless told
        # not to (weights_backbone): every weights argument is None.
        kwargs = {name: None for name in inspect.signature(factory).parameters
                  if name.startswith("weights")}
        what = f"building torchvision model {spec!r}"
    if isinstance(factory, nn.Module) or not callable(factory):
        model = factory
    else:
        model = _call_factory(spec, factory, kwargs, what)
    if not isinstance(model, nn.Module):
        raise _UsageError(f"{spec!r} gave {type(model).__name__}, not a torch.nn.Module; name "
                          f"a function or class that returns the model")
    return model.eval()


def _call_factory(spec: str, factory: Any, kwargs: dict[str, Any], what: str) -> Any:
    """``factory(**kwargs)`` on the meta device; a constructor that computes with tensors
    (RegNet) is built again with only its parameters on meta (buffers are small)."""
    from ._loading.loader import empty_model
    from ._planning import cannot_run_on_meta

    try:
        with _no_downloads(spec):
            try:
                with torch.device("meta"):
                    return factory(**kwargs)
            except Exception as exc:  # noqa: BLE001 - retried below, then reported
                if not cannot_run_on_meta(exc):
                    raise
            return empty_model(lambda: factory(**kwargs))
    except _UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - a factory's failure is reported, not dumped
        raise _UsageError(f"{what} failed ({first_line(exc)}); the factory must build the "
                          f"model with no arguments") from None


def _example_args(spec: str, size: int) -> tuple[Any, ...] | None:
    """Example inputs on meta for a torchvision model (video models take frames, optical
    flow models two images); None for a factory, whose inputs are unknown."""
    if ":" in spec:
        return None
    kind = _torchvision_builder(spec).__module__
    if ".video." in kind:
        return (torch.empty(1, 3, 16, size, size, device="meta"),)
    image = torch.empty(1, 3, size, size, device="meta")
    if ".optical_flow." in kind:
        return (image, image)
    return (image,)


def _example_from(spec: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inputs an ``--example package.module:function`` gives, made on the meta device:
    a tensor, a tuple of positional inputs or a dict of keyword inputs."""
    from ._planning import split_inputs

    maker = _factory(spec, "--example", "function", "a function that returns the example inputs")
    if not callable(maker):
        raise _UsageError(f"--example {spec!r} is {type(maker).__name__}, not a function; name "
                          f"a function that returns the example inputs")
    try:
        with torch.device("meta"):
            return split_inputs(maker())
    except Exception as exc:  # noqa: BLE001 - the user's function failed: one line
        raise _UsageError(f"--example {spec!r} failed ({first_line(exc)}); it must return "
                          f"a tensor, a tuple or a dict of inputs, with no arguments") from None


def _record(model: nn.Module, spec: str, size: int, example_spec: str | None
            ) -> tuple[Any, bool]:
    """The recorded forward on the example input, or None where there is none to run or
    the model cannot run on meta; and whether there was an example input."""
    from ._planning import cannot_run_on_meta, record_forward

    if example_spec is not None:
        args, kwargs = _example_from(example_spec)
        what, fix = f"the --example {example_spec!r} inputs", "check what --example returns"
    else:
        example = _example_args(spec, size)
        if example is None:
            print(f"adaptmem plan: note: no example inputs for {spec}; units are in "
                  f"registration order (give --example package.module:function for the "
                  f"execution order)", file=sys.stderr)
            return None, False
        args, kwargs = example, {}
        shape = "x".join(str(n) for n in example[0].shape)
        what, fix = f"a {shape} example input", "give --image-size a size the model accepts"
    try:
        return record_forward(model, args, kwargs), True
    except Exception as exc:  # noqa: BLE001 - the model's own failure, reported in one line
        if cannot_run_on_meta(exc):
            print(f"adaptmem plan: note: {spec} cannot run on the meta device "
                  f"({first_line(exc)}); units are in registration order, not execution "
                  f"order", file=sys.stderr)
            return None, True
        raise _UsageError(f"{spec} does not run on {what} ({first_line(exc)}); "
                          f"{fix}") from None


def _device_spec(spec: str, dtype: torch.dtype | None
                 ) -> tuple[torch.device, torch.dtype | None, str]:
    """``DEVICE[@DTYPE][=CAPACITY]`` -> (device, dtype, capacity text), parsed not probed,
    so a plan can be made for any machine."""
    from ._common.devices import parse_device
    from ._planning import parse_dtype

    name, equals, capacity = spec.partition("=")
    if equals and not capacity.strip():
        raise _UsageError(f"--device {spec!r}: the capacity after '=' is empty; give a size "
                          f"such as {name}=20GiB, or leave out '=' for no limit")
    name, at, dtype_name = name.partition("@")
    try:
        device = parse_device(name, f"--device {spec!r}:")
    except ValueError as exc:
        raise _UsageError(f"{exc} (optionally with a dtype: 'cpu@bfloat16')") from None
    if at:
        given = parse_dtype(dtype_name, f"the dtype in --device {spec!r}")
        if dtype is not None and given != dtype:
            raise _UsageError(f"--device {spec!r} asks for {given} but --dtype for {dtype}; "
                              f"give the dtype once")
        dtype = given
    return device, dtype, capacity


def _size(text: str, name: str) -> int:
    from ._common.devices import parse_size

    if text.strip().startswith("-"):
        raise _UsageError(f"{name} must be zero or more bytes, got {text!r}; write a size "
                          f"such as 100MiB")
    return parse_size(text, name)


def _capacity(text: str, device: torch.device, name: str) -> int | None:
    from ._common.devices import resolve_device
    from ._planning import auto_capacity

    if text == "auto":
        try:
            here = resolve_device(str(device), "--device")
        except ValueError as exc:  # its advice "or None" is the API's, not the command's
            said = str(exc).removesuffix("; use 'cpu' or None")
            raise _UsageError(f"{name} 'auto' reads the free memory of {device}, which this "
                              f"machine cannot ({said}); give a size such as 20GiB to plan for "
                              f"another machine") from None
        return auto_capacity(here)[0]
    return _size(text, name) if text else None


def _placement_targets(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    """Targets for --mode chunk/split, as ``adaptive.chunk`` / ``adaptive.split`` make them,
    and the plan options those record."""
    from ._placement import chunk_targets
    from ._planning import parse_dtype, targets_from_devices

    dtype = parse_dtype(args.dtype, "--dtype")
    specs = args.device or ["cuda:0"]
    if args.mode == "chunk":
        if len(specs) != 1:
            raise _UsageError(f"--mode chunk takes one --device, got {specs}; use --mode split")
        device, dt, capacity = _device_spec(specs[0], dtype)
        if capacity:
            raise _UsageError(f"--device {specs[0]!r}: with --mode chunk give the capacity as "
                              f"--budget {capacity}")
        budget = args.budget if args.budget is not None else "auto"
        cap = _capacity(budget, device, "--budget")
        return chunk_targets(device, cap, dt), {"capacity": cap, "reserve": "auto"}
    if args.budget is not None:
        raise _UsageError("--budget is for page and chunk; with --mode split write "
                          "--device cuda:0=20GiB --device cpu")
    # As adaptive.split reads its devices: "auto" keys on one device share its budget (See
    # [Note: one budget per device] in _planning/targets.py).
    devices: dict[Any, Any] = {}
    for spec in specs:
        device, dt, text = _device_spec(spec, dtype)
        size = _capacity(text, device, f"--device {spec!r} capacity")  # "auto": here?
        key = str(device) if dt is None else (str(device), dt)
        if key in devices:
            raise _UsageError(f"--device {spec!r} names {device}"
                              f"{'' if dt is None else f' in {dt}'} again; give each once")
        devices[key] = "auto" if text == "auto" else size
    return targets_from_devices(devices, None, "auto", probe=False), {"reserve": "auto"}


def _cmd_plan(args: argparse.Namespace) -> int:
    from ._common.errors import AdaptmemError
    from ._planning import module_sizes, plan, plan_placement

    if args.image_size is not None and (args.example is not None or ":" in args.model):
        why = ("--example gives the inputs" if args.example is not None else
               f"{args.model!r} is a factory, not a torchvision model")
        raise _UsageError(f"--image-size sizes the example input of a torchvision model, but "
                          f"{why}, so it would be ignored; leave it out")
    if args.image_size is None:
        args.image_size = 224
    if args.image_size <= 0:
        raise _UsageError(f"--image-size must be a positive number of pixels, got "
                          f"{args.image_size}")
    try:
        if args.mode == "page":
            if args.device or args.dtype:
                raise _UsageError("--device and --dtype are for --mode chunk or split")
            if args.budget is not None and args.budget.strip() == "auto":
                # adaptive.page's "auto" reads the device's free memory; a plan has none.
                raise _UsageError("--budget 'auto' is for --mode chunk; with --mode page "
                                  "--budget is the unit size: give one such as 64MiB, or "
                                  "leave it out for the whole model as one unit")
            unit_bytes = None if args.budget is None else _size(args.budget, "--budget")
        else:
            targets, options = _placement_targets(args)
        model = _build_model(args.model)
        recording, example = _record(model, args.model, args.image_size, args.example)
        if args.mode == "page":
            result = plan(model, unit_bytes=unit_bytes,
                          order=None if recording is None else recording.order)
        else:
            result = plan_placement(model, module_sizes(model), targets, recording,
                                    mode=args.mode, options=options)
        if example:  # as adaptive.plan(..., example_inputs=...) reports them, or why not
            _report_activations(result, model, args)
    except (TypeError, ValueError, AdaptmemError) as exc:
        raise _UsageError(exc) from None
    if args.json:
        print(result.to_json(indent=2))
        return 0
    print(result)
    placed = result.options.get("placed_bytes")
    if placed and result.options.get("dtypes"):
        print("placed (in each device's dtype): " + ", ".join(
            f"{label} {format_bytes(n)}" for label, n in placed.items()))
    return 0


def _report_activations(result: Any, model: nn.Module, args: argparse.Namespace) -> None:
    """Add the predicted activation bytes per item (and the largest batch left room for on the
    first device) to ``result.options``, from the same example inputs as the recording."""
    from ._planning import activation_report

    if args.example is not None:
        inputs = _example_from(args.example)
    else:
        inputs = (_example_args(args.model, args.image_size) or (), {})
    first = result.units[0].placement if result.units else None
    capacity = result.options.get("devices", {}).get(str(first)) if first else None
    room = None
    if capacity is not None:
        room = max(0, capacity - result.options.get("placed_bytes", {}).get(str(first), 0))
    result.options["activations"] = activation_report(
        model, *inputs, room, result.dtype_of(first) if first else None)


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    if not args.seconds > 0:
        raise _UsageError(f"--seconds must be a positive number of seconds, got {args.seconds}")
    if importlib.util.find_spec("torchvision") is None:
        raise _UsageError("the demo runs a torchvision model, but torchvision is not "
                          "installed; install it (pip install torchvision, the build that "
                          "matches your torch)")
    return run_demo(seconds=args.seconds, simulate_gpu=args.simulate_gpu)


def _join_dash_values(argv: list[str]) -> list[str]:
    """``--budget -5MiB`` -> ``--budget=-5MiB``, so argparse passes the value on."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (token in _DASH_VALUE_OPTIONS and nxt is not None and nxt.startswith("-")
                and not nxt.startswith("--")):
            out.append(f"{token}={nxt}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors in one line, as the command's own are: the usage
    it would print first is a --help away. Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    """The console script's parser: every subcommand and option, with its help."""
    parser = _Parser(
        prog="adaptmem",
        description="Run PyTorch inference on whatever memory a machine has: 'adaptmem demo' "
                    "shows the levers on this machine, 'adaptmem plan MODEL' prints what would "
                    "go where, 'adaptmem example train' spills a training step's activations. "
                    "Mistakes on the command line end with one line on stderr and exit status "
                    "2, never a traceback.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"adaptmem {__version__} "
                        f"(torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="classify synthetic images under a memory cap")
    demo.add_argument("--seconds", type=float, default=60.0,
                      help="longest time the batch-size phase keeps calling (default 60)")
    demo.add_argument("--simulate-gpu", action="store_true",
                      help="run the GPU branch on a simulated CUDA device "
                           "(adaptmem.testing.simulated_cuda), whatever is here")
    demo.set_defaults(func=_cmd_demo)

    p = sub.add_parser("plan", help="print how a model would be paged or placed")
    p.add_argument("model", help="torchvision model name (built with random weights, nothing "
                                 "is downloaded) or 'package.module:factory'")
    p.add_argument("--mode", choices=("page", "chunk", "split"), default="page",
                   help="page: the units adaptive.page streams (default); chunk: what "
                        "adaptive.chunk keeps on one device; split: adaptive.split over "
                        "several --device")
    p.add_argument("--device", action="append", default=None,
                   metavar="DEVICE[@DTYPE][=CAPACITY]",
                   help="chunk: the resident device (default cuda:0); split: repeat in order, "
                        "e.g. --device cuda:0=20GiB --device cpu@bfloat16=8GiB --device cpu")
    p.add_argument("--budget", default=None,
                   help="page: the largest unit, e.g. 64MiB (default: the whole model as "
                        "one unit, as adaptive.plan; 0 for the finest units); chunk: the "
                        "resident capacity, e.g. 100MiB (default 'auto': free memory minus a "
                        "reserve; needs the device); not for split (sizes go in --device)")
    p.add_argument("--dtype", default=None, help="dtype weights take on the placed device(s), "
                   "e.g. float16 or bfloat16 (chunk: the resident device only)")
    p.add_argument("--image-size", type=int, default=None,
                   help="example input size for torchvision models (default 224); not with "
                        "a factory or --example")
    p.add_argument("--example", default=None, metavar="PACKAGE.MODULE:FUNCTION",
                   help="a function returning example inputs (a tensor, tuple or dict of "
                        "keyword inputs, made on meta) whose forward gives the execution "
                        "order; torchvision models get one from --image-size")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    from ._example_train import add_example_parser

    add_example_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the console script on ``argv`` (default ``sys.argv[1:]``) and return its exit
    status; mistakes in the request exit with status 2 and one line on stderr."""
    parser = _parser()
    args = parser.parse_args(_join_dash_values(list(sys.argv[1:] if argv is None else argv)))
    # The subcommand's own name ("adaptmem example train"), as argparse's errors give it.
    prog = getattr(args, "prog", f"adaptmem {args.command}")
    try:
        return int(args.func(args))
    except _UsageError as exc:
        parser.exit(2, f"{prog}: error: {_one_line(exc)}\n")
    except KeyboardInterrupt:  # Ctrl-C: the user's choice, not a crash to show a traceback of
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it
    except BrokenPipeError:  # `adaptmem plan ... | head`: the reader left, which is fine
        devnull = os.open(os.devnull, os.O_WRONLY)  # no second error flushing stdout at exit
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    raise AssertionError("unreachable")  # parser.exit raises SystemExit


if __name__ == "__main__":
    sys.exit(main())
