"""The ``adaptmem`` console script: ``adaptmem demo`` and ``adaptmem plan MODEL``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import torch
from torch import nn

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


def _cmd_plan(args: argparse.Namespace) -> int:
    from ._planner import plan

    model = _build_model(args.model)
    example = torch.empty(1, 3, args.image_size, args.image_size, device="meta")
    try:
        example_inputs = example if ":" not in args.model else None
        if args.mode == "page":
            result = plan(model, unit_bytes=args.budget, example_inputs=example_inputs)
        else:
            devices = {args.device: args.budget}
            if args.mode == "chunk" or args.device != "cpu":
                devices["cpu"] = None
            result = plan(model, devices=devices, example_inputs=example_inputs)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"adaptmem plan: {exc}") from None
    print(result.to_json(indent=2) if args.json else result)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_demo(seconds=args.seconds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adaptmem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="classify synthetic images under a memory cap")
    demo.add_argument("--seconds", type=float, default=10.0, help="time spent per phase")
    demo.set_defaults(func=_cmd_demo)

    p = sub.add_parser("plan", help="print how a model would be paged or placed")
    p.add_argument("model", help="torchvision model name or 'package.module:factory'")
    p.add_argument("--mode", choices=("page", "chunk", "split"), default="page")
    p.add_argument("--device", default="cuda:0", help="device for chunk/split (default cuda:0)")
    p.add_argument("--budget", default=None, help="unit size (page) or device capacity, e.g. 100MiB")
    p.add_argument("--image-size", type=int, default=224, help="example input size for vision models")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
