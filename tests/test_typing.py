"""The package is typed for its users: a program using the documented forms passes
``mypy --strict``, a decorated function is typed with its parameters minus the size, and
the mistakes that fail at run time (the size passed by hand, a misspelled option) are type
errors. One mypy run (about 30 s: it reads torch's stubs) checks the whole program."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import adaptmem

api = pytest.importorskip("mypy.api")

# Each line marked ``# E: code`` must give that error and nothing else errs; each
# ``reveal_type`` line must reveal the type after ``# R:``.
PROGRAM = '''
import asyncio

import torch
from adaptmem import adaptive
from adaptmem.testing import raise_oom


@adaptive.batch(initial_batchsize=8)
def classify(batchsize: int, images: torch.Tensor) -> torch.Tensor:
    return images[:batchsize]


@adaptive.batch(initial_batchsize="auto", max_batchsize=512, on_adapt=print)
async def score(batchsize: int, images: torch.Tensor) -> float:
    return float(images[:batchsize].sum())


@adaptive.range(initial_step=4, progress=True)
def fill(start: int, end: int, out: torch.Tensor) -> int:
    out[start:end] = 1
    return end - start


@adaptive.chunked(initial_step=3, output="new")
def double(chunk: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return chunk * 2


model = torch.nn.Linear(4, 4)


@adaptive.batch(initial_batchsize=64, model=model)
def forward(batchsize: int, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x[:batchsize])
    return out


class Runner:
    @adaptive.batch(initial_batchsize=8)
    def run(self, batchsize: int, x: torch.Tensor) -> torch.Tensor:
        return x[:batchsize]

    @adaptive.batch(initial_batchsize=8)
    @staticmethod
    def plain(batchsize: int, x: torch.Tensor) -> int:
        return batchsize

    @adaptive.batch(initial_batchsize=8)
    @classmethod
    def build(cls, batchsize: int, x: torch.Tensor) -> int:
        return batchsize


def predict(x: torch.Tensor) -> torch.Tensor:
    return classify(x)


def step(batchsize: int, x: torch.Tensor) -> float:
    return float(x[:batchsize].sum())


def span(start: int, end: int, x: torch.Tensor) -> int:
    return end - start


x = torch.ones(10)
reveal_type(classify)  # R: Decorated[[images: torch._tensor.Tensor], torch._tensor.Tensor]
reveal_type(classify.stats)  # R: adaptmem._execution.stats.CallStats
asyncio.run(score(x))
reveal_type(score)  # R: Decorated[[images: torch._tensor.Tensor], typing.Coroutine[Any, Any, float]]
reveal_type(fill(0, 10, x))  # R: list[int]
reveal_type(double(x))  # R: torch._tensor.Tensor
reveal_type(forward.placement)  # R: dict[str, Any]
reveal_type(Runner().run(x))  # R: torch._tensor.Tensor
reveal_type(Runner.plain(x))  # R: int
reveal_type(Runner().build(x))  # R: int
reveal_type(adaptive.explicit.batch(step, "auto", x))  # R: float
reveal_type(adaptive.explicit.range(span, 0, 10, 4, x))  # R: list[int]
reveal_type(adaptive.execute.batch(initial_batchsize=8)(lambda n: n))  # R: int
reveal_type(adaptive.empty_model(lambda: torch.nn.Linear(2, 2)))  # R: torch.nn.modules.linear.Linear
reveal_type(adaptive.load(model, "m.safetensors"))  # R: torch.nn.modules.linear.Linear
reveal_type(adaptive.load(model, "m.safetensors", return_stats=True))  # R: tuple[torch.nn.modules.linear.Linear, adaptmem._engines.stats.LoadStats]
stats: adaptive.LoadStats | adaptive.SpillStats | adaptive.MemoryStats | adaptive.PagingStats
record: adaptive.SizeRecord
spill: adaptive.Spill


def fails() -> int:
    raise_oom()


classify(8, x)  # E: call-arg
adaptive.batch(initial_batchsze=8)  # E: call-overload
adaptive.batch(min_batchsize=2)  # E: call-overload
adaptive.explicit.btach  # E: attr-defined
adaptive.execute.batch(64)  # E: arg-type
name: str = classify(x)  # E: assignment
'''


@pytest.fixture(scope="module")
def mypy_output(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("typing")
    program = folder / "program.py"
    program.write_text(PROGRAM.lstrip("\n"))
    root = str(Path(adaptmem.__file__).resolve().parents[1])
    added = root not in sys.path
    if added:  # mypy finds adaptmem where Python does, as an installed, typed package
        sys.path.insert(0, root)
    try:
        out, err, _ = api.run([
            "--strict", "--python-executable", sys.executable, "--cache-dir",
            str(folder / "cache"), "--hide-error-context", "--no-pretty", str(program)])
    finally:
        if added:
            sys.path.remove(root)
    assert not err, err
    lines = PROGRAM.lstrip("\n").splitlines()
    return [f"{line}\t{lines[int(n) - 1] if n else ''}" for line in out.splitlines()
            for n in [(re.match(r".*?:(\d+):", line) or [None, ""])[1]]]


def test_documented_forms_pass_mypy_strict_and_marked_mistakes_are_errors(
        mypy_output: list[str]) -> None:
    errors = [line for line in mypy_output if ": error:" in line]
    unexpected = [line for line in errors if "# E:" not in line.split("\t")[1]]
    assert not unexpected, "\n".join(unexpected)
    marked = [line for line in PROGRAM.splitlines() if "# E:" in line]
    for source in marked:
        code = source.split("# E: ")[1]
        assert any(line.endswith("\t" + source) and f"[{code}]" in line for line in errors), (
            f"no [{code}] error for {source!r}:\n" + "\n".join(mypy_output))


def test_decorated_functions_keep_their_parameters_minus_the_size(
        mypy_output: list[str]) -> None:
    revealed = {line.split("\t")[1]: line for line in mypy_output
                if "Revealed type is" in line}
    for source in (line for line in PROGRAM.splitlines() if "reveal_type(" in line):
        expected = source.split("# R: ")[1]
        assert source in revealed, f"{source!r} revealed nothing:\n" + "\n".join(mypy_output)
        assert expected in revealed[source].split("\t")[0], revealed[source]
