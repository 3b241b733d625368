from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptmem import adaptive
from adaptmem._planning import Plan
from adaptmem.cli import main


def test_plan_prints_a_chunk_table_for_resnet101_with_a_100mib_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "resnet101", "--mode", "chunk", "--budget", "100MiB"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("adaptmem plan (chunk):")
    assert "unit" in lines[1] and "bytes" in lines[1] and "placement" in lines[1]
    assert "conv1" in out and "fc" in out
    totals = next(line for line in lines if line.startswith("totals: "))
    assert totals.startswith("totals: cuda:0 ") and ", cpu " in totals
    assert lines[-1].startswith("activations (predicted on meta): ")
    assert lines[-1].endswith("left on cuda:0: 0")  # 100 MiB of weights leave no room
    resident = float(totals.split("cuda:0 ")[1].split(" MiB")[0])
    assert 90 < resident <= 100



def test_plan_in_page_mode_reports_activations_as_adaptive_plan_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torchvision

    model = torchvision.models.resnet18(weights=None).eval()
    want = adaptive.plan(model, example_inputs=torch.randn(1, 3, 64, 64))
    assert main(["plan", "resnet18", "--image-size", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("adaptmem plan (page):")
    assert lines[-1] == str(want).splitlines()[-1]
    assert lines[-1].startswith("activations (predicted on meta): ")
    assert main(["plan", "resnet18", "--image-size", "64", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["options"]["activations"]
    assert got == want.options["activations"]


def test_plan_json_is_valid_and_names_every_unit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "resnet101", "--mode", "chunk", "--budget", "100MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "chunk"
    assert {u["placement"] for u in data["units"]} == {"cuda:0", "cpu"}
    assert data["options"]["placed_bytes"]["cuda:0"] <= 100 * 2**20
    assert sum(u["bytes"] for u in data["units"]) == data["total_bytes"]


def test_plan_split_over_repeated_devices_with_a_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "resnet18", "--mode", "split", "--device", "cuda:0=10MiB",
            "--device", "cuda:1=10MiB", "--device", "cpu", "--dtype", "float16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cuda:1" in out and "placed (in each device's dtype):" in out


def test_plan_page_mode_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "resnet18", "--budget", "5MiB"]) == 0
    assert "adaptmem plan (page)" in capsys.readouterr().out
    assert main(["plan", "resnet18"]) == 0  # the whole model as one unit
    assert capsys.readouterr().out.startswith("adaptmem plan (page): 1 unit, ")


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI, expect exit status 2, and return its one-line message."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert err.count("\n") == 0, err
    assert err.startswith("adaptmem plan: error: ")
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "resnet18", "--mode", "chunk", "--budget", "lots"], "--budget='lots'"),
        (["plan", "resnet18", "--mode", "split", "--device", "cuda:0=1MiB"], "does not fit"),
        (["plan", "resnet18", "--mode", "split", "--device", "warp=1MiB"], "not a device"),
        (["plan", "resnet18", "--mode", "chunk", "--device", "cuda:0", "--device", "cpu",
          "--budget", "1MiB"], "one --device"),
        (["plan", "resnet18", "--mode", "chunk", "--budget", "1MiB", "--dtype", "int8"], "--dtype"),
        (["plan", "no_such_model"], "unknown model"),
        # What a new user typed, each once a traceback:
        (["plan", "resnet18", "--image-size", "0"], "--image-size must be a positive"),
        (["plan", "resnet18", "--image-size", "-3"], "--image-size must be a positive"),
        (["plan", "vit_b_16", "--image-size", "100"],
         "vit_b_16 does not run on a 1x3x100x100 example input"),
        (["plan", "torch.nn:Linear"], "must build the model with no arguments"),
        (["plan", "torch:zeros"], "must build the model with no arguments"),
        (["plan", "math:pi"], "gave float, not a torch.nn.Module"),
        (["plan", "no_such_package_xyz.models:build"], "cannot import 'no_such_package_xyz.models'"),
        (["plan", "torch.nn:NoSuchModel"], "has no attribute 'NoSuchModel'"),
        (["plan", "torch.nn:"], "package.module:factory"),
        # Sizes starting with "-" reach the size check instead of argparse's "expected one
        # argument", and are refused there.
        (["plan", "resnet18", "--budget", "-5MiB"], "--budget must be zero or more bytes"),
        # 'auto' is chunk's default; in page mode it once read "'auto' is not a size".
        (["plan", "resnet18", "--budget", "auto"], "--budget 'auto' is for --mode chunk"),
        (["plan", "resnet18", "--mode", "chunk", "--device", "cpu", "--budget", "-1.5GiB"],
         "--budget must be zero or more bytes"),
        *([] if torch.cuda.is_available() else [
            (["plan", "resnet18", "--mode", "chunk"], "--budget 'auto' reads the free memory"),
            (["plan", "resnet18", "--mode", "split", "--device", "cuda:0=auto"],
             "give a size such as 20GiB")]),
        (["plan", "resnet18", "--mode", "chunk", "--device", "cpu@float16", "--dtype",
          "bfloat16", "--budget", "1MiB"], "give the dtype once"),
        # An empty capacity once meant "no limit" silently.
        (["plan", "resnet18", "--mode", "split", "--device", "cuda:0=", "--device", "cpu"],
         "the capacity after '=' is empty"),
        (["plan", "resnet18", "--mode", "split", "--device", "cuda:0=2.5", "--device", "cpu"],
         "write a unit, e.g. '2.5GiB'"),
        # A mistake in --example was reported as one in the model ("model 'models:gated':
        # ... name a function or class that builds the model").
        (["plan", "models:gated", "--example", "models:make_inputs"],
         "error: --example 'models:make_inputs': 'models' has no attribute 'make_inputs'; "
         "name a function that returns the example inputs"),
        (["plan", "models:gated", "--example", "no_such_package_xyz:make"],
         "error: --example 'no_such_package_xyz:make': cannot import"),
        (["plan", "models:gated", "--example", "models"],
         "error: --example 'models': write a function as 'package.module:function'"),
        # --image-size was ignored without a word where it sizes nothing.
        (["plan", "models:gated", "--image-size", "64"],
         "--image-size sizes the example input of a torchvision model, but 'models:gated' is "
         "a factory"),
        (["plan", "resnet18", "--example", "models:vit_small_example", "--image-size", "64"],
         "--image-size sizes the example input of a torchvision model, but --example gives "
         "the inputs"),
    ],
)
def test_plan_errors_are_one_line_with_exit_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _usage_error(argv, capsys)


def test_a_factory_that_downloads_weights_is_refused_not_waited_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # nothing cached: a build must download
    err = _usage_error(["plan", "torchvision.models.detection:fasterrcnn_resnet50_fpn"], capsys)
    assert "tried to download weights" in err and "weights=None" in err


def _builders_with_backbone_weights() -> list[str]:
    from torchvision import models

    return [name for name in models.list_models()
            if "weights_backbone" in inspect.signature(models.get_model_builder(name)).parameters]


@pytest.mark.parametrize(
    "name",
    # Detection and segmentation builders download a backbone by default; RegNet computes
    # with tensors in its constructor; video models take frames, RAFT two images.
    [*_builders_with_backbone_weights(), "regnet_y_400mf", "r3d_18", "raft_small"],
)
def test_plan_builds_any_torchvision_model_without_downloading(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def no_network(url: str, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"tried to download {url}")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    assert main(["plan", name, "--mode", "chunk", "--device", "cpu", "--budget", "10MiB",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total_bytes"] > 0 and data["units"]


def test_plan_chunk_on_the_cpu_works_and_its_json_too(capsys: pytest.CaptureFixture[str]) -> None:
    # Once "devices lists the same device and dtype twice". adaptive.chunk(model, "cpu")
    # without a dtype keeps everything where it is: one CPU target, the capacity moot.
    argv = ["plan", "resnet101", "--mode", "chunk", "--device", "cpu", "--budget", "100MiB"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("totals: cpu ")
    assert "per item" in lines[-1] and "largest batch" not in lines[-1]  # no capacity here
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {u["placement"] for u in data["units"]} == {"cpu"}


@pytest.mark.parametrize(
    ("cli", "api"),
    [
        (["--mode", "chunk", "--device", "cpu", "--budget", "10MiB"],
         lambda m, x: adaptive.chunk(m, "cpu", capacity="10MiB", example_inputs=x)),
        (["--mode", "chunk", "--device", "cpu", "--dtype", "bfloat16", "--budget", "10MiB"],
         lambda m, x: adaptive.chunk(m, "cpu", capacity="10MiB", dtype=torch.bfloat16,
                                     example_inputs=x)),
        (["--mode", "chunk", "--device", "cpu@bfloat16", "--budget", "10MiB"],
         lambda m, x: adaptive.chunk(m, "cpu", capacity="10MiB", dtype=torch.bfloat16,
                                     example_inputs=x)),
        (["--mode", "split", "--device", "cpu@bfloat16=10MiB", "--device", "cpu"],
         lambda m, x: adaptive.split(m, {"cpu@bfloat16": "10MiB", "cpu": None},
                                     example_inputs=x)),
    ],
)
def test_plan_gives_the_placement_the_api_makes(
    cli: list[str], api: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import torchvision

    assert main(["plan", "resnet18", *cli, "--json"]) == 0
    planned = Plan.from_dict(json.loads(capsys.readouterr().out))
    model = torchvision.models.resnet18().eval()
    with api(model, torch.randn(1, 3, 224, 224)) as handle:
        assert handle.plan.device_map == planned.device_map
        assert [(u.name, u.placement) for u in handle.plan.units] == [
            (u.name, u.placement) for u in planned.units]


def test_plan_page_mode_gives_the_units_the_pager_makes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torchvision

    assert main(["plan", "resnet18", "--budget", "5MiB", "--json"]) == 0
    planned = Plan.from_dict(json.loads(capsys.readouterr().out))
    model = torchvision.models.resnet18().eval()
    with adaptive.page(model, "cpu", unit_bytes="5MiB", resident_bytes=0) as pager:
        model(torch.randn(1, 3, 224, 224))  # the pager orders its units at the first call
        assert [(u.name, u.nbytes) for u in pager.plan.units] == [
            (u.name, u.nbytes) for u in planned.units]


def test_plan_piped_into_head_ends_quietly() -> None:
    """``adaptmem plan ... | head -1``: the reader leaving early is no error (150 KB of JSON,
    more than a pipe holds, so the write really meets the closed pipe)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    run = subprocess.run(
        f"{sys.executable} -m adaptmem.cli plan densenet201 --budget 1KiB --json | head -1",
        shell=True, capture_output=True, text=True, env=env, timeout=120)
    assert run.stdout.strip() == "{"
    assert "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr


def test_the_demo_refuses_a_time_it_cannot_run_in(capsys: pytest.CaptureFixture[str]) -> None:
    for seconds in ("0", "-1"):
        with pytest.raises(SystemExit) as info:
            main(["demo", "--seconds", seconds])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "--seconds must be a positive number of seconds" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch", "-1"], "--batch must be 2 or more images"),
        (["--batch", "1"], "--batch must be 2 or more images"),  # batch norm refuses 1
        (["--batch", "0"], "--batch must be 2 or more images"),  # once "done ... loss nan"
        (["--image-size", "0"], "--image-size must be a positive number of pixels"),
        (["--model", "fasterrcnn_mobilenet_v3_large_fpn"], "is not an image classifier"),
        (["--model", "no_such_model"], "--model 'no_such_model' is not a torchvision model"),
        (["--cap", "-1"], "--cap must be a positive"),  # once refused after the header
        (["--cap", "nan"], "--cap must be a positive"),
        (["--cap", "lots"], "--cap 'lots' is not a memory size"),
        # (--device cpu: on a GPU, --cap is refused as for the CPU only)
        (["--cap", "1MiB", "--device", "cpu"], "--cap 1MiB is below the"),  # once after the header
        (["--threshold", "lots"], "threshold='lots' is not a size"),
        (["--device", "warp"], "not a device"),
        *([] if torch.cuda.is_available() else [  # once "use 'cpu' or None": the API's words
            (["--device", "cuda"], "CUDA is not available here; give --device cpu, or leave")]),
        (["--to", "/no/such/dir"], "does not exist"),
        # An image size the model rejects: once a traceback (an AssertionError) or a
        # failed step per attempt and status 1.
        (["--model", "vit_b_16"], "--image-size 32: vit_b_16 does not take 32x32 images "
                                  "(Wrong image height! Expected 224 but got 32!)"),
        (["--model", "alexnet", "--image-size", "16"], "alexnet does not take 16x16 images"),
    ],
)
def test_example_train_refuses_what_its_step_cannot_run(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # a download would fail, not be waited on
    with pytest.raises(SystemExit) as info:
        main(["example", "train", "--model", "resnet18", "--image-size", "32", *argv])
    # As plan's and demo's mistakes: exit status 2 and one line (once status 1, no "error:").
    assert info.value.code == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert err.startswith("adaptmem example train: error: ") and "\n" not in err, err
    assert message in err and "Traceback" not in err
    assert "Downloading" not in err
    assert out.out == ""  # refused before it starts: no header line first


def test_example_train_cap_takes_a_size_with_a_unit_as_other_sizes_do() -> None:
    from adaptmem._example_train import _cap_gib

    assert _cap_gib("1.5") == _cap_gib("1.5GiB") == 1.5
    assert _cap_gib("1536MiB") == 1.5
    assert _cap_gib("2GB") == pytest.approx(2e9 / 2**30)


def test_ctrl_c_ends_a_command_with_one_line_and_status_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    import adaptmem._demo

    def interrupted(**kwargs: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(adaptmem._demo, "run_demo", interrupted)
    assert main(["demo", "--seconds", "1"]) == 130  # once a 40-line traceback
    err = capsys.readouterr().err
    assert err.strip() == "adaptmem demo: interrupted"


def _subcommands(parser: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    import argparse

    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _subcommands(child, (*path, name))
    return found


def test_every_option_of_every_subcommand_says_what_it_is_for() -> None:
    from adaptmem.cli import _parser

    commands = _subcommands(_parser())
    assert {path for path, _ in commands} >= {("demo",), ("plan",), ("example",),
                                              ("example", "train")}
    missing = [f"adaptmem {' '.join(path)} {action.option_strings or action.dest}"
               for path, parser in commands for action in parser._actions
               if action.option_strings and not action.help]
    assert not missing, f"options without help: {missing}"  # once --mode, --batch, ...
    # What the top level lists is every subcommand there is.
    description = _parser().description or ""
    assert all(f"adaptmem {name}" in description for name in ("demo", "plan", "example train"))


@pytest.mark.parametrize(("argv", "said"), [
    (["example", "train", "--batch", "x"],
     "adaptmem example train: error: argument --batch: invalid int value: 'x' "
     "(see adaptmem example train --help)"),
    ([], "adaptmem: error: the following arguments are required: command"),
    (["example"], "adaptmem example: error: the following arguments are required: {train} "
                  "(see adaptmem example --help)"),
    (["plan", "resnet18", "--mode", "sideways"], "adaptmem plan: error: argument --mode"),
])
def test_argparses_own_errors_are_one_line_too(argv: list[str], said: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err and err.startswith(said), err


def test_sizes_below_zero_say_so_with_a_unit_or_without(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["example", "train", "--threshold", "-3MiB"])
    assert "threshold must be a finite number of bytes, zero or more, got '-3MiB'" in (
        capsys.readouterr().err)


def test_version_names_adaptmem_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    import adaptmem

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"adaptmem {adaptmem.__version__} (torch {torch.__version__})")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the words where CUDA is absent")
def test_plan_says_what_to_give_on_the_command_line_not_in_python(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "resnet18", "--mode", "split", "--device", "cuda:0=auto"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "CUDA is not available here)" in err
    assert "or None" not in err and "give a size such as 20GiB" in err


def test_python_dash_m_adaptmem_runs_the_command_line() -> None:
    done = subprocess.run([sys.executable, "-m", "adaptmem", "plan", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: adaptmem plan" in done.stdout


def test_importing_the_main_module_runs_no_command() -> None:
    # tools that import every module of a package (pydoc, test collectors) import __main__
    sys.modules.pop("adaptmem.__main__", None)
    importlib.import_module("adaptmem.__main__")  # used to exit with the usage error


@pytest.mark.parametrize("argv", [["demo", "--seconds", "1"],
                                  ["example", "train", "--model", "resnet18"]])
def test_commands_that_need_torchvision_say_so_without_it(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if not installed
    with pytest.raises(SystemExit) as info:
        main(argv)
    said = f"{info.value.code} {capsys.readouterr().err}"
    assert "torchvision is not installed" in said and "Traceback" not in said


def test_plan_says_why_a_model_that_cannot_run_on_meta_has_no_activation_figures(
        capsys: pytest.CaptureFixture[str]) -> None:
    # As adaptive.plan(..., example_inputs=...) says it; the command line used to print
    # no activations line and leave the key out of its JSON.
    argv = ["plan", "models:gated", "--example", "models:gated_example", "--mode", "chunk",
            "--device", "cpu", "--budget", "1MiB"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[-1] == ("activations: not predicted (RuntimeError: "
                                        "Tensor.item() cannot be called on meta tensors)")
    assert "cannot run on the meta device" in out.err
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["options"]["activations"]["predicted"] is False
    assert "item()" in data["options"]["activations"]["reason"]


def test_split_auto_devices_on_one_device_share_its_budget(
        capsys: pytest.CaptureFixture[str]) -> None:
    # adaptive.split and adaptive.plan share one "auto" budget between the dtype keys of one
    # device; the command read the free memory once per --device, and planned more than
    # the device holds.
    from adaptmem.testing import simulated_cuda

    def on_device(*devices: str) -> int:
        command = ["plan", "resnet50", "--image-size", "32", "--mode", "split", "--json"]
        assert main([*command, *[a for d in devices for a in ("--device", d)]]) == 0
        placed = json.loads(capsys.readouterr().out)["options"]["placed_bytes"]
        return sum(n for label, n in placed.items() if label.startswith("cuda:0"))

    with simulated_cuda(devices=1, total_memory="40MiB"):
        alone = on_device("cuda:0=auto", "cpu")  # one key: the whole budget (two keys: 1.5x)
        assert 0 < on_device("cuda:0@float16=auto", "cuda:0=auto", "cpu") <= alone
    with pytest.raises(SystemExit):
        main(["plan", "resnet18", "--mode", "split", "--device", "cpu", "--device", "cpu"])
    assert "names cpu again" in capsys.readouterr().err
