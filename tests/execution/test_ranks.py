"""``group=``: ranks with different memory agree on every size and stop together.

Each test group starts real processes (ranks_worker.py) over a gloo group on the CPU, runs
every scenario of the worker once, and checks what each rank saw. Bounded: the whole group
is killed after LIMIT seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from adaptmem import adaptive

WORKER = Path(__file__).with_name("ranks_worker.py")
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 120  # seconds for a whole group: imports of torch on a loaded 2-core machine


def _launch(world: int, scenarios: str, tmp: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world),
                          str(tmp / "init"), str(tmp / "out"), scenarios],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=LIMIT)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"the {world} ranks did not finish within {LIMIT} s: a hang")
    seen = []
    for rank, log in enumerate(logs):
        out = tmp / f"out.{rank}.json"
        assert out.exists(), f"rank {rank} wrote nothing; its output:\n{log}"
        seen.append(json.loads(out.read_text()))
    return seen


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(2, "ceilings,ranges,chunks,late,raises,placed,dies",
                   tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(4, "ceilings,subgroup,raises", tmp_path_factory.mktemp("four"))


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_ranks_with_different_memory_try_the_same_sizes_and_end_alike(
        ranks: str, request: pytest.FixtureRequest) -> None:
    seen = [s["ceilings"] for s in request.getfixturevalue(ranks)]
    tightest = min([64, 16, 40, 24][:len(seen)])
    for rank in seen:
        assert rank["attempts"] == seen[0]["attempts"]  # the same size on every attempt
        assert rank["results"] == seen[0]["results"]
        assert rank["stats"]["failed_attempts"] == seen[0]["stats"]["failed_attempts"]
        assert rank["stats"]["last_batchsize"] == tightest
    assert seen[0]["results"][-1] == tightest
    assert seen[0]["attempts"][:3] == [64, 32, 16]  # 64 fails on the tightest rank only
    assert seen[0]["failures"] == []  # rank 0 never ran out; it retried with the others
    assert seen[1]["failures"] == [s for s in seen[1]["attempts"] if s > 16]


def test_every_rank_learns_which_rank_ran_out(two_ranks: list[dict[str, Any]]) -> None:
    events = [e for e in two_ranks[0]["ceilings"]["events"] if e[0] == "shrink"]
    assert events[0] == ["shrink", 64, 32, 0, 1]  # kind, old, new, this rank, failed rank
    assert all(e[4] == 1 for e in events)
    own = [e for e in two_ranks[1]["ceilings"]["events"] if e[0] == "shrink"]
    assert [e[1:3] for e in own] == [e[1:3] for e in events]


def test_ranges_of_different_lengths_agree_on_every_step(
        two_ranks: list[dict[str, Any]]) -> None:
    shorter, longer = (s["ranges"] for s in two_ranks)
    for rank in (shorter, longer):
        assert sum(rank["results"]) == rank["end"]  # covered once
        # Every body that ran is kept: a step that worked here while the other rank ran out
        # is not run again (the spans the body saw tile [0, end) without overlap).
        spans = sorted(rank["spans"])
        assert spans[0][0] == 0 and spans[-1][1] == rank["end"]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
        assert len(spans) == len(rank["results"])
    assert max(e - s for s, e in longer["spans"]) <= 16  # rank 1's ceiling
    # While both have work, both attempt the same sizes.
    both = len(shorter["attempts"]) - 1
    assert shorter["attempts"][:both] == longer["attempts"][:both]


def test_chunked_with_a_group_writes_every_result_and_shows_progress_on_rank_0(
        two_ranks: list[dict[str, Any]]) -> None:
    first, second = (s["chunks"] for s in two_ranks)
    assert first["right"] and second["right"]
    # Agreed steps 64, 32, 16: rank 0 has only 50 items, so its first span is 50, which
    # fits there and is kept while rank 1 runs out and retries smaller.
    assert first["attempts"] == [50] and second["attempts"][:3] == [64, 32, 16]
    assert first["progress"][-1].endswith(": 50/50 items (100%), step=64, 0 retries")
    assert second["progress"] == []  # one bar per group: rank 0's


def test_an_error_after_the_outcome_exchange_reaches_every_rank(
        two_ranks: list[dict[str, Any]]) -> None:
    first, second = (s["late"] for s in two_ranks)
    assert second["type"] == "ValueError" and "shape" in second["message"]
    assert first == {"type": "RankError", "rank": 1, "error_type": "ValueError"}


def test_a_subgroup_agrees_among_its_own_ranks(four_ranks: list[dict[str, Any]]) -> None:
    seen = [s["subgroup"] for s in four_ranks]
    assert seen[0] is None and seen[3] is None
    assert seen[1] == seen[2] == {"result": 16, "attempts": [64, 32, 16]}  # 16 fits rank 1


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_an_error_on_one_rank_reaches_every_rank_naming_it(
        ranks: str, request: pytest.FixtureRequest) -> None:
    seen = [s["raises"] for s in request.getfixturevalue(ranks)]
    last = len(seen) - 1
    assert seen[last]["type"] == "ValueError"  # its own error, as raised
    for rank in seen[:last]:
        assert rank["type"] == "RankError"
        assert rank["rank"] == last and rank["error_type"] == "ValueError"
        assert f"rank {last} raised ValueError: shard 7 is corrupt" in rank["message"]
        assert rank["seconds"] < 30  # at the outcome exchange, not a timeout
    assert all(rank["after"] == 8 for rank in seen)  # the group still works


def test_a_rank_that_left_is_a_clear_error_not_a_hang(two_ranks: list[dict[str, Any]]) -> None:
    left, waiting = two_ranks[1]["dies"], two_ranks[0]["dies"]
    assert left == {"left": True}
    assert waiting["type"] == "RankError"
    assert "did not all answer" in waiting["message"] and "rank 0" in waiting["message"]
    assert waiting["seconds"] < 60  # group_timeout=5, or sooner when the connection closes
    # The first call of a function that needs a group of its own: RankError too.
    assert waiting["first"]["type"] == "RankError", waiting["first"]
    assert "did not all make their first grouped call" in waiting["first"]["message"]


def test_group_must_be_world_or_a_process_group() -> None:
    with pytest.raises(TypeError, match="process group"):
        adaptive.batch(initial_batchsize=8, group=3)
    with pytest.raises(ValueError, match='"world"'):
        adaptive.range(initial_step=8, group="everyone")
    with pytest.raises(ValueError, match="group_timeout"):
        adaptive.batch(initial_batchsize=8, group="world", group_timeout=0)


def test_group_without_torch_distributed_initialised_fails_at_the_first_call() -> None:
    assert not dist.is_initialized()

    @adaptive.batch(initial_batchsize=8, group="world")
    def infer(batchsize: int) -> int:
        return batchsize

    with pytest.raises(RuntimeError, match="init_process_group"):
        infer()


def test_group_refuses_generators() -> None:
    def stream(batchsize: int) -> Any:
        yield batchsize

    with pytest.raises(TypeError, match="group"):
        adaptive.batch(initial_batchsize=8, group="world")(stream)


def test_model_and_group_together_run_and_stop_together(
        two_ranks: list[dict[str, Any]]) -> None:
    """``batch(model=, group=)`` runs (it failed on every call with a TypeError); when one
    rank runs out at the smallest step, every rank raises, and none runs the call again on
    its own after giving residency back (the other ranks would not follow)."""
    for rank in two_ranks:
        assert rank["placed"]["ran"]
        assert rank["placed"]["raised"] == "OutOfMemoryError"
    attempts = two_ranks[0]["placed"]["attempts"]
    assert attempts[-1] == 1 and attempts.count(1) == 1  # down to 1 once: no second run
