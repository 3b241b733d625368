"""``empty_model`` from several threads at once ([Note: one patch for every empty_model]):
each call's parameters go to meta, other threads' modules keep theirs, and
``nn.Module.register_parameter`` is torch's own again once the last call ends."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from adaptmem import adaptive

ORIGINAL = nn.Module.register_parameter


def _in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(target()))
    thread.start()
    return thread, out


def test_calls_that_overlap_leave_register_parameter_as_it_was() -> None:
    # The first call to start ends first: with a patch per call, the second then put the
    # first's patch back for good.
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> nn.Module:
        first_in.set()
        second_in.wait(10)
        return nn.Linear(4, 4)

    def second() -> nn.Module:
        second_in.set()
        first_out.wait(10)
        return nn.Linear(4, 4)

    a, made_a = _in_thread(lambda: adaptive.empty_model(first))
    first_in.wait(10)
    b, made_b = _in_thread(lambda: adaptive.empty_model(second))
    a.join(10)
    first_out.set()
    b.join(10)
    assert [m.weight.device.type for m in (*made_a, *made_b)] == ["meta", "meta"]  # type: ignore[union-attr]
    assert nn.Module.register_parameter is ORIGINAL
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_modules_other_threads_build_meanwhile_keep_real_parameters() -> None:
    inside, built = threading.Event(), threading.Event()

    def factory() -> nn.Module:
        inside.set()
        built.wait(10)
        return nn.Linear(4, 4)

    thread, made = _in_thread(lambda: adaptive.empty_model(factory))
    inside.wait(10)
    elsewhere = nn.Linear(4, 4)  # this thread, while the factory runs
    with torch.no_grad():
        elsewhere.weight.fill_(1.0)  # initialisation runs here too
    built.set()
    thread.join(10)
    assert made[0].weight.device.type == "meta"  # type: ignore[attr-defined]
    assert elsewhere.weight.device.type == "cpu"
    assert bool((elsewhere.weight == 1).all())


def test_concurrent_factory_loads_leave_later_modules_real(tmp_path: Path) -> None:
    def build() -> nn.Module:
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(20)])

    torch.save(build().state_dict(), tmp_path / "two.pt")
    for _ in range(5):
        threads = [threading.Thread(target=adaptive.load, args=(build, tmp_path / "two.pt"),
                                    kwargs={"device": "cpu"}) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert nn.Module.register_parameter is ORIGINAL
    assert nn.Linear(2, 2).weight.device.type == "cpu"
