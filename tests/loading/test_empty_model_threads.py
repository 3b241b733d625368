"""``empty_model`` from several threads at once ([Note: one patch for every empty_model]):
each call's parameters go to meta, other threads' modules keep theirs, and
``nn.Module.register_parameter`` is torch's own again once the last call ends."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("started", [0, 1], ids=["no-thread", "one-thread"])
@pytest.mark.parametrize("into", ["factory", "built", "converted"])
def test_a_load_where_no_more_threads_can_start_reads_on_the_calling_thread(
    into: str, started: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A process at its thread limit (RLIMIT_NPROC, a container's pids.max): the reads the
    # loader's threads would do run on the threads there are, or on the calling thread.
    torch.manual_seed(0)
    # 17.2 MiB: more than one staging chunk when converted, more than one piece when read.
    source = nn.Embedding(4096, 1100)
    path = tmp_path / "model.pt"
    torch.save(source.state_dict(), path)
    want = torch.load(path, weights_only=True)
    real_start = threading.Thread.start
    starts = []

    def refusing_start(self: threading.Thread) -> None:
        if len(starts) >= started:
            raise RuntimeError("can't start new thread")
        starts.append(self)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", refusing_start)
    if into == "factory":
        model = adaptive.load(lambda: nn.Embedding(4096, 1100), path)
    elif into == "built":
        model = adaptive.load(nn.Embedding(4096, 1100), path)
    else:
        model = adaptive.load(lambda: nn.Embedding(4096, 1100), path, dtype=torch.float64)
    monkeypatch.undo()
    got = model.weight.detach().cpu()  # (a factory's model goes to CUDA where there is one)
    assert torch.equal(got, want["weight"].to(got.dtype))
    for t in starts:
        t.join(timeout=10)
