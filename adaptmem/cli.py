"""The ``adaptmem`` console script: ``adaptmem demo`` and ``adaptmem plan MODEL``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import torch
from torch import nn

from ._devices import format_bytes

__all__ = ["main"]


def _build_model(spec: str) -> nn.Module:
    """A model on the meta device from a torchvision name or a ``module:attribute`` factory."""
    with torch.device("meta"):
        if ":" in spec:
            module_name, _, attr = spec.partition(":")
            factory = getattr(importlib.import_module(module_name), attr)
            model = factory() if callable(factory) and not isinstance(factory, nn.Module) else factory
        else:
            import torchvision

            try:
                model = torchvision.models.get_model(spec, weights=None)
            except ValueError as exc:
                raise SystemExit(
                    f"adaptmem plan: unknown model {spec!r}; give a torchvision model name "
                    f"(e.g. resnet101) or a 'package.module:factory' path"
                ) from exc
    if not isinstance(model, nn.Module):
        raise SystemExit(f"adaptmem plan: {spec!r} did not give an nn.Module")
    return model.eval()


def _placement_targets(args: argparse.Namespace) -> list:
    """Targets for --mode chunk/split; devices are parsed, not probed (plan for any machine)."""
    from ._devices import parse_size, resolve_device
    from ._placement_plan import Target, auto_capacity, parse_dtype, qualify_labels

    dtype = parse_dtype(args.dtype, "--dtype")
    specs = args.device or ["cuda:0"]
    if args.mode == "chunk":
        if len(specs) != 1:
            raise ValueError(f"--mode chunk takes one --device, got {specs}; use --mode split")
        if args.budget not in (None, "auto"):
            parse_size(args.budget, "--budget")
        specs = [f"{specs[0]}={args.budget or 'auto'}", "cpu"]
    elif args.budget is not None:
        raise ValueError("--budget is for page and chunk; with --mode split write "
                         "--device cuda:0=20GiB --device cpu")
    pairs = []
    for i, spec in enumerate(specs):
        name, _, capacity = spec.partition("=")
        try:
            device = torch.device(name)
        except (RuntimeError, ValueError):
            raise ValueError(f"--device {spec!r}: {name!r} is not a device name such as "
                             f"'cuda:0' or 'cpu'") from None
        placed_dtype = dtype if i == 0 or args.mode == "split" else None
        cap: int | None
        if capacity == "auto":
            cap, _ = auto_capacity(resolve_device(name, "--device"))
        else:
            cap = parse_size(capacity, f"--device {spec!r} capacity") if capacity else None
        pairs.append((device, cap, placed_dtype))
    labels = qualify_labels([(d, t) for d, _, t in pairs])
    return [Target(d, c, t, label) for (d, c, t), label in zip(pairs, labels, strict=True)]


def _cmd_plan(args: argparse.Namespace) -> int:
    from ._errors import AdaptmemError
    from ._placement_plan import plan_placement, record_forward
    from ._planner import module_sizes, plan

    model = _build_model(args.model)
    example = torch.empty(1, 3, args.image_size, args.image_size, device="meta")
    example_inputs = example if ":" not in args.model else None
    try:
        if args.mode == "page":
            if args.device or args.dtype:
                raise ValueError("--device and --dtype are for --mode chunk or split")
            result = plan(model, unit_bytes=args.budget, example_inputs=example_inputs)
        else:
            targets = _placement_targets(args)
            recording = (record_forward(model, (example_inputs,), {})
                         if example_inputs is not None else None)
            result = plan_placement(model, module_sizes(model), targets, recording,
                                    mode=args.mode)
    except (TypeError, ValueError, AdaptmemError) as exc:
        raise SystemExit(f"adaptmem plan: {exc}") from None
    if args.json:
        print(result.to_json(indent=2))
        return 0
    print(result)
    placed = result.options.get("placed_bytes")
    if placed and result.options.get("dtypes"):
        print("placed (in each device's dtype): " + ", ".join(
            f"{label} {format_bytes(n)}" for label, n in placed.items()))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_demo(seconds=args.seconds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adaptmem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="classify synthetic images under a memory cap")
    demo.add_argument("--seconds", type=float, default=60.0,
                      help="longest time the batch-size phase keeps calling (default 60)")
    demo.set_defaults(func=_cmd_demo)

    p = sub.add_parser("plan", help="print how a model would be paged or placed")
    p.add_argument("model", help="torchvision model name or 'package.module:factory'")
    p.add_argument("--mode", choices=("page", "chunk", "split"), default="page")
    p.add_argument("--device", action="append", default=None, metavar="DEVICE[=CAPACITY]",
                   help="chunk: the resident device (default cuda:0); split: repeat in order, "
                        "e.g. --device cuda:0=20GiB --device cuda:1=20GiB --device cpu")
    p.add_argument("--budget", default=None,
                   help="unit size (page) or resident capacity (chunk), e.g. 100MiB; chunk "
                        "defaults to 'auto' (free memory minus a reserve; needs the device)")
    p.add_argument("--dtype", default=None, help="dtype weights take on the placed device(s), "
                   "e.g. float16 or bfloat16 (chunk: the resident device only)")
    p.add_argument("--image-size", type=int, default=224, help="example input size for vision models")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    from ._example_train import add_example_parser

    add_example_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
