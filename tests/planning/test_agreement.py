"""One planner: ``adaptive.plan``, ``split`` (from the devices, and from the plan's own
device_map), ``chunk`` and ``adaptmem plan`` give the same placement for every model of the
zoo and for a Hugging Face GPT-2."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from models import ZOO, hf_gpt2, hf_gpt2_example
from torch import nn

from adaptmem import adaptive
from adaptmem._planning import Plan, module_sizes, split_inputs
from adaptmem.cli import main

# name -> (CLI arguments naming the model and its example inputs)
TORCHVISION_SIZES = {"resnet50": 64, "densenet121": 64, "inception_v3": 75,
                     "mobilenet_v3_large": 64, "vit_b_16": 224, "swin_t": 64}
CLI_MODELS = {
    **{name: [name, "--image-size", str(size)] for name, size in TORCHVISION_SIZES.items()},
    "vit_small": ["models:small_vit", "--example", "models:vit_small_example"],
    "tiny_gpt": ["models:TinyGPT", "--example", "models:tiny_gpt_example"],
    "hf_gpt2": ["models:hf_gpt2", "--example", "models:hf_gpt2_example"],
}


def _case(name: str) -> tuple[nn.Module, Any]:
    if name == "hf_gpt2":
        return hf_gpt2(), hf_gpt2_example()
    model, args, kwargs = ZOO[name]()
    return model, (kwargs if kwargs else args[0] if len(args) == 1 else args)


def _placement(plan: Plan) -> list[tuple[str, str]]:
    return [(u.name, str(u.placement)) for u in plan.units]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Plan:
    assert main(["plan", *argv, "--json"]) == 0
    return Plan.from_dict(json.loads(capsys.readouterr().out))


@pytest.fixture
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(CLI_MODELS))
def test_plan_split_chunk_and_the_cli_agree(name: str, capsys: pytest.CaptureFixture[str],
                                           one_thread: None) -> None:
    model, example = _case(name)
    capacity = module_sizes(model).total_bytes  # about half the model in float64 bytes
    devices = {"cpu@float64": capacity, "cpu": None}
    planned = adaptive.plan(model, devices=devices, example_inputs=example)
    assert {str(u.placement) for u in planned.units} == {"cpu@float64", "cpu"}

    with adaptive.split(model, devices, example_inputs=example) as splitter:
        assert _placement(splitter.plan) == _placement(planned)
        assert splitter.device_map == planned.device_map
    with adaptive.split(model, devices, device_map=planned.device_map) as splitter:
        assert splitter.device_map == planned.device_map  # the planner's map, as it is
        with torch.no_grad():
            args, kwargs = split_inputs(example)
            model(*args, **kwargs)  # and it runs
    with adaptive.chunk(model, "cpu", capacity=capacity, dtype=torch.float64,
                        example_inputs=example) as chunker:
        assert _placement(chunker.plan) == _placement(planned)

    split_cli = _cli([*CLI_MODELS[name], "--mode", "split", "--device",
                      f"cpu@float64={capacity}", "--device", "cpu"], capsys)
    assert _placement(split_cli) == _placement(planned)
    assert split_cli.device_map == planned.device_map
    chunk_cli = _cli([*CLI_MODELS[name], "--mode", "chunk", "--device", "cpu@float64",
                      "--budget", str(capacity)], capsys)
    assert _placement(chunk_cli) == _placement(planned)
