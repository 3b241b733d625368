from __future__ import annotations

import json

import pytest

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
    totals = lines[-1]
    assert totals.startswith("totals: cuda:0 ") and ", cpu " in totals
    resident = float(totals.split("cuda:0 ")[1].split(" MiB")[0])
    assert 90 < resident <= 100


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
    ],
)
def test_plan_errors_say_what_to_fix(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert message in str(info.value)
