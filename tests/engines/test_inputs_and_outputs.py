"""What page, chunk and split do with a forward's inputs and outputs, for every engine: what
the forward writes into its inputs reaches the caller's objects, dataclass outputs come
back where the inputs came from, and one tensor passed twice stays one tensor. Models run
on the GPU (the simulated one without a GPU) with their inputs on the CPU, so every engine
moves them."""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from conftest import REAL_CUDA, run_if
from torch import nn

from adaptmem import PlacementError, adaptive

ENGINES: dict[str, Callable[[nn.Module], Any]] = {
    "page": lambda m: adaptive.page(m, "cuda", unit_bytes=0, resident_bytes=0),
    "page, resident": lambda m: adaptive.page(m, "cuda"),
    "chunk": lambda m: adaptive.chunk(m, "cuda", capacity="1MiB"),
    "split": lambda m: adaptive.split(m, {"cuda:0": 600, "cuda:1": "1MiB"}),
}
# split places on two devices: a one-GPU machine skips it
ENGINE_NAMES = [*(e for e in ENGINES if e != "split"),
                pytest.param("split", marks=run_if(cuda=True, min_gpus=2))]


def _matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    """``got``, computed where the engine placed the model, against ``want``, computed on the
    CPU: bitwise on the simulated device (the CPU's kernels); close on a real GPU, whose
    kernels round differently (a lost write would leave zeros or the old values)."""
    if REAL_CUDA:
        return got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    return torch.equal(got, want)


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make().eval()


# -- writes into the inputs ---------------------------------------------------------------


class _Streaming(nn.Module):
    """Carries its state in a list the caller owns, updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(16, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, state: list[torch.Tensor]) -> torch.Tensor:
        state[0] = torch.tanh(self.cell(torch.cat([x, state[0]], -1)))
        return self.out(state[0])


def _stream(model: nn.Module, steps: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    state = [torch.zeros(3, 8)]
    kept = state
    outputs = torch.stack([model(x, state) for x in steps])
    assert state is kept
    return outputs, state


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_a_state_list_the_forward_updates_is_the_callers_after_every_step(engine: str) -> None:
    steps = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))
    model = _seeded(_Streaming)
    with torch.no_grad():
        expected, expected_state = _stream(copy.deepcopy(model), steps)
        with ENGINES[engine](model):
            outputs, state = _stream(model, steps)
    assert _matches(outputs, expected)
    assert state[0].device.type == "cpu"
    assert _matches(state[0], expected_state[0])


class _Fails(_Streaming):
    """Updates the state, then raises (once ``failing`` is set)."""

    failing = False

    def forward(self, x: torch.Tensor, state: list[torch.Tensor]) -> torch.Tensor:
        out = super().forward(x, state)
        state.append(x.new_ones(1))
        if self.failing:
            raise ValueError("after the update")
        return out


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_what_a_forward_wrote_before_it_raised_reaches_the_caller(engine: str) -> None:
    x = torch.randn(3, 8)
    model = _seeded(_Fails)
    with torch.no_grad():
        expected = [torch.zeros(3, 8)]
        model(x, expected)
        with ENGINES[engine](model):
            model(x, [torch.zeros(3, 8)])  # chunk and split place the model here
            model.failing = True
            state = [torch.zeros(3, 8)]
            with pytest.raises(ValueError, match="after the update"):
                model(x, state)
    assert [t.device.type for t in state] == ["cpu", "cpu"]
    assert _matches(state[0], expected[0]) and _matches(state[1], expected[1])


class _Reads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, state: list[torch.Tensor], cache: _Cache) -> Any:
        return self.lin(x + state[0] + cache.keys[0])


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_inputs_the_forward_only_reads_are_left_as_they_were(engine: str) -> None:
    x, item = torch.randn(3, 8), torch.ones(3, 8)
    state, cache = [item], _Cache([item], {})
    versions = (x._version, item._version)
    model = _seeded(_Reads)
    with torch.no_grad(), ENGINES[engine](model):
        model(x, state, cache)
        model(x, state, cache)
    assert len(state) == 1 and state[0] is item and cache.keys[0] is item
    assert (x._version, item._version) == versions  # nothing was copied back into them


class _FillsOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out.copy_(self.lin(x))
        return out


@run_if(cuda=True)
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_an_out_tensor_the_forward_fills_is_the_callers_and_comes_back_itself(
        engine: str, mode: Callable[[], Any]) -> None:
    # Under inference_mode a copy made there would be an inference tensor, which keeps no
    # version counter to tell that the forward wrote it.
    x = torch.randn(3, 8)
    model = _seeded(_FillsOut)
    with mode():
        expected = model(x, torch.zeros(3, 8))
        buffer = torch.zeros(3, 8)
        with ENGINES[engine](model):
            returned = model(x, buffer)
    assert returned is buffer
    assert _matches(buffer, expected)


@dataclasses.dataclass(frozen=True)
class _Cache:
    keys: list[torch.Tensor]
    extra: dict[str, torch.Tensor]


class _Appends(nn.Module):
    """Appends to a list, assigns and deletes dict items: all in containers it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: _Cache, log: list[Any]) -> torch.Tensor:
        h = self.lin(x)
        cache.keys.append(h)
        cache.extra["last"] = h * 2
        del cache.extra["old"]
        log.append(x)  # an input: the caller's own tensor comes back, not a copy
        log.append("called")
        log.append(h)  # in two places: one tensor comes back
        return h


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_items_the_forward_puts_into_its_containers_come_back_to_the_callers_device(
        engine: str) -> None:
    x = torch.randn(3, 8)
    first = torch.ones(3, 8)
    model = _seeded(_Appends)
    with torch.no_grad():
        plain = _Cache([first], {"old": first})
        expected = model(x, plain, [])
        cache, log = _Cache([first], {"old": first}), []
        keys, extra = cache.keys, cache.extra
        with ENGINES[engine](model):
            model(x, cache, log)
    assert cache.keys is keys and cache.extra is extra
    assert cache.keys[0] is first
    assert cache.keys[1].device.type == "cpu" and _matches(cache.keys[1], expected)
    assert list(cache.extra) == ["last"]
    assert cache.extra["last"].device.type == "cpu"
    assert _matches(cache.extra["last"], plain.extra["last"])
    assert log[0] is x and log[1] == "called" and log[2] is cache.keys[1]


class _Unsqueezes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.unsqueeze_(0)
        return self.lin(x)


def test_a_shape_change_the_forward_makes_to_an_argument_reaches_the_callers_tensor() -> None:
    # A float64 part on the CPU: its inputs are converted, so it gets copies.
    model = _seeded(_Unsqueezes)
    x, plain_x = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        model(plain_x)
        with adaptive.chunk(model, "cpu", capacity="1MiB", dtype=torch.float64):
            model(x)
    assert x.shape == plain_x.shape == (1, 3, 8)
    assert x.stride() == plain_x.stride()


def test_a_shape_change_the_callers_tensor_cannot_follow_is_an_error_naming_it() -> None:
    model = _seeded(_Unsqueezes)
    x = torch.randn(3, 16)[:, ::2]  # not dense: its copy is laid out otherwise
    with torch.no_grad(), adaptive.chunk(model, "cpu", capacity="1MiB", dtype=torch.float64):
        with pytest.raises(PlacementError, match=r"args\[0\].*\(3, 8\) to \(1, 3, 8\)"):
            model(x)


# -- dataclass outputs --------------------------------------------------------------------


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    built: ClassVar[int] = 0  # instances made, counted by __post_init__

    def __post_init__(self) -> None:
        type(self).built += 1


@dataclasses.dataclass(frozen=True)
class _Frozen:
    h: torch.Tensor


_Pair = collections.namedtuple("_Pair", "a b")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> _Frozen:
        return _Frozen(self.lin(x))


class _DataclassNet(nn.Module):
    """Children return a frozen dataclass, combined in a residual; the model returns a
    dataclass and a namedtuple."""

    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2 = _Block(), _Block()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[_Output, Any]:
        h = self.b1(x).h
        h = h + self.b2(h).h
        return _Output(self.head(h), h), _Pair(h, h.sum())


@run_if(cuda=True)
@pytest.mark.parametrize("engine", [*ENGINE_NAMES, "chunk, the first block alone"])
def test_dataclass_outputs_come_back_where_the_inputs_came_from(engine: str) -> None:
    x = torch.randn(3, 8)
    model = _seeded(_DataclassNet)
    place = ENGINES.get(engine) or (lambda m: adaptive.chunk(m, "cuda", capacity=300))
    with torch.no_grad():
        (expected, pair) = model(x)
        with place(model):
            model(x)  # chunk and split record their first forward on a copy
            _Output.built = 0
            out, placed_pair = model(x)
            built = _Output.built
    assert type(out) is _Output and built == 1  # copied, not built again
    for got, want in ((out.logits, expected.logits), (out.hidden, expected.hidden),
                      (placed_pair.a, pair.a), (placed_pair.b, pair.b)):
        assert got.device.type == "cpu"
        assert _matches(got, want)
    assert type(placed_pair) is _Pair


def test_dataclass_outputs_come_back_in_the_dtype_the_inputs_had() -> None:
    x = torch.randn(3, 8)
    model = _seeded(_DataclassNet)
    with torch.no_grad(), adaptive.chunk(model, "cpu", capacity="1MiB", dtype=torch.float64):
        out, pair = model(x)
    assert out.logits.dtype == out.hidden.dtype == pair.a.dtype == torch.float32


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ["page", "chunk"])
def test_a_model_output_of_transformers_still_comes_back(engine: str) -> None:
    modeling = pytest.importorskip("transformers.modeling_outputs")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Any:
            return modeling.BaseModelOutput(last_hidden_state=self.lin(x))

    model = _seeded(Net)
    x = torch.randn(3, 8)
    with torch.no_grad(), ENGINES[engine](model):
        out = model(x)
    assert isinstance(out, modeling.BaseModelOutput)
    assert out.last_hidden_state.device.type == "cpu"
    assert out["last_hidden_state"] is out.last_hidden_state


# -- aliased inputs -----------------------------------------------------------------------


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(32, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return self.attn(h, h, h, need_weights=False)[0]


@run_if(cuda=True, min_gpus=2)
def test_one_tensor_passed_three_times_across_a_boundary_stays_one_tensor() -> None:
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    model = _seeded(_SelfAttention)
    seen: list[bool] = []
    model.attn.register_forward_pre_hook(lambda m, a: seen.append(a[0] is a[1] is a[2]))
    with torch.no_grad():
        # Computed on the device itself: a GPU's kernels round differently from the CPU's.
        expected = copy.deepcopy(model).to("cuda:1")(x.to("cuda:1")).cpu()
        seen.clear()
        with adaptive.split(model, device_map={"pre": "cuda:0", "attn": "cuda:1"}):
            out = model(x)
    assert seen and all(seen)  # the packed self-attention path, as unplaced
    assert torch.equal(out, expected)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor, *, c: list[torch.Tensor]) -> Any:
        return self.lin(a), a is b is c[0]


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_one_tensor_passed_twice_to_the_model_reaches_its_forward_once(engine: str) -> None:
    x = torch.randn(3, 8)
    model = _seeded(_Two)
    with torch.no_grad(), ENGINES[engine](model):
        out, same = model(x, x, c=[x])
    assert same
    assert out.device.type == "cpu"


# -- the model's own hooks, and the grad mode of its first call --------------------------


def _three() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_a_forward_hook_the_model_had_sees_the_outputs_handed_back(engine: str) -> None:
    """A post-processing hook registered before placement (one that adds a host tensor, or
    logs ``out.numpy()``) sees what the caller gets, as without an engine."""
    offset = torch.randn(4, generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 8)
    model = _seeded(_three)
    seen: list[torch.device] = []

    def post(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        seen.append(out.device)
        return out + offset

    model.register_forward_hook(post)
    with torch.no_grad():
        expected = copy.deepcopy(model)(x)
        seen.clear()
        with ENGINES[engine](model):
            out = model(x)
    # The last call is the model's own (chunk and split record their first forward first,
    # hooks included: see docs/limitations.md).
    assert seen[-1] == torch.device("cpu")
    assert out.device.type == "cpu" and torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


@run_if(cuda=True)
@pytest.mark.parametrize("engine", [*ENGINE_NAMES, "chunk, bfloat16 on the host"])
def test_a_first_call_under_inference_mode_leaves_a_model_that_runs_with_autograd(
        engine: str) -> None:
    """The engine places (or fetches) at the first call; made under ``inference_mode``,
    the placed weights must not be inference tensors, which a later call with autograd on
    cannot save for backward."""
    x = torch.randn(2, 8)
    model = _seeded(_three)
    place = (ENGINES[engine] if engine in ENGINES else
             lambda m: adaptive.chunk(m, "cpu", capacity=600, dtype=torch.bfloat16))
    with place(model):
        with torch.inference_mode():
            model(x)
        assert not any(p.is_inference() for p in model.parameters())
        out = model(x)  # autograd on: the weights are saved for backward
    assert out.device.type == "cpu"
    if engine not in ENGINES or REAL_CUDA:  # the simulated device runs no autograd
        assert out.requires_grad


class _Sampler(nn.Module):
    """Takes a count, not a tensor: makes its own input where its weights are."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, n: int) -> torch.Tensor:
        return self.proj(torch.ones(n, 4, device=self.proj.weight.device))


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_outputs_of_a_call_without_tensor_inputs_come_back_where_the_model_was(
        engine: str) -> None:
    model = _seeded(_Sampler)
    with torch.no_grad():
        expected = copy.deepcopy(model)(3)
        with ENGINES[engine](model):
            out = model(3)
    assert out.device.type == "cpu" and _matches(out, expected)
