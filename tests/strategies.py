"""hypothesis strategies shared by the test modules."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

DIM = 8


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Scaled(nn.Module):
    """A parent with parameters of its own around its child."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.scale = nn.Parameter(torch.rand(DIM) + 0.5)
        self.register_buffer("shift", torch.randn(DIM) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale + self.shift


class Twice(nn.Module):
    """Calls its child twice in one forward."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.tanh(self.body(x)))


class Peek(nn.Module):
    """Reads its child's weight without calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.proj.weight, self.proj.bias)


class Chain(nn.Sequential):
    pass


class Shared(nn.Module):
    """The same submodule registered under two names and called through both."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.first = body
        self.wrapper = nn.Sequential(nn.Tanh(), body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wrapper(self.first(x))


def _leaf() -> st.SearchStrategy[nn.Module]:
    return st.sampled_from(["linear", "norm", "peek", "act"]).map(_make_leaf)


def _make_leaf(kind: str) -> nn.Module:
    if kind == "linear":
        return nn.Linear(DIM, DIM)
    if kind == "norm":
        return nn.LayerNorm(DIM)
    if kind == "peek":
        return Peek()
    return nn.GELU()


def _extend(children: st.SearchStrategy[nn.Module]) -> st.SearchStrategy[nn.Module]:
    return st.one_of(
        st.lists(children, min_size=1, max_size=4).map(lambda kids: Chain(*kids)),
        children.map(Residual),
        children.map(Scaled),
        children.map(Twice),
        children.map(Shared),
    )


def module_trees() -> st.SearchStrategy[nn.Module]:
    """Random eval-mode module trees mapping (batch, DIM) to (batch, DIM): nesting, residual
    adds, parents with own parameters and buffers, modules called twice, a module under two
    names, and parents reading a child's weight without calling it."""
    return st.recursive(_leaf(), _extend, max_leaves=8).map(lambda m: m.eval())


# Trees for chunk/split: plain specs built into modules, so placements can be drawn too.
SPLIT_WIDTH = 8


class _Residual(nn.Module):
    """x + body(x), scaled by a keyword argument: parents that add children's outputs."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.body(x)


class _Concat(nn.Module):
    """cat(a(x), b(x)) @ own weight: concatenation plus a parameter owned by a non-leaf."""

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b = a, b
        self.mix = nn.Parameter(torch.randn(2 * SPLIT_WIDTH, SPLIT_WIDTH) / SPLIT_WIDTH**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], dim=-1) @ self.mix


class _ReadsChild(nn.Module):
    """Uses its child's weight without calling the child (as MultiheadAttention does)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(SPLIT_WIDTH, SPLIT_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.proj.weight, self.proj.bias).tanh()


def module_trees_for_split(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Specs of random module trees: leaves, Sequentials, residual adds, concatenations."""
    leaf = st.sampled_from(["linear", "norm", "tanh", "reads_child"])
    return st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.lists(kids, min_size=1, max_size=3).map(lambda k: ("seq", *k)),
            kids.map(lambda k: ("res", k)),
            st.tuples(kids, kids).map(lambda k: ("cat", *k)),
        ),
        max_leaves=max_leaves,
    )


def build_tree_for_split(spec: Any) -> nn.Module:
    """The module a ``module_trees_for_split`` spec describes (width ``SPLIT_WIDTH``)."""
    if spec == "linear":
        return nn.Linear(SPLIT_WIDTH, SPLIT_WIDTH)
    if spec == "norm":
        return nn.LayerNorm(SPLIT_WIDTH)
    if spec == "tanh":
        return nn.Tanh()
    if spec == "reads_child":
        return _ReadsChild()
    kind, *kids = spec
    built = [build_tree_for_split(k) for k in kids]
    if kind == "seq":
        return nn.Sequential(*built)
    if kind == "res":
        return _Residual(built[0])
    return _Concat(*built)


def split_placements() -> st.SearchStrategy[list[tuple[torch.dtype, float]]]:
    """One to three (dtype, share of the model's bytes) placements on the CPU, distinct
    dtypes, to be followed by an unlimited fp32 CPU placement: dtype boundaries stand in
    for device boundaries."""
    dtypes = st.lists(st.sampled_from([torch.bfloat16, torch.float16, torch.float64]),
                      min_size=1, max_size=3, unique=True)
    return dtypes.flatmap(lambda ds: st.lists(
        st.floats(0.0, 0.8), min_size=len(ds), max_size=len(ds)).map(
            lambda shares: list(zip(ds, shares, strict=True))))


@st.composite
def memory_schedules(draw: Any) -> tuple[dict[int, int], list[int]]:
    """A call site's world where free memory predicts what fits: a capacity (items) per
    free-memory bucket that never falls as the bucket rises, and the buckets of 30 calls."""
    buckets = draw(st.lists(st.integers(100, 112), min_size=1, max_size=6, unique=True))
    buckets.sort()
    steps = draw(st.lists(st.integers(0, 400), min_size=len(buckets), max_size=len(buckets)))
    capacity, total = {}, draw(st.integers(1, 300))
    for bucket, step in zip(buckets, steps, strict=True):
        total += step
        capacity[bucket] = total
    calls = draw(st.lists(st.sampled_from(buckets), min_size=30, max_size=30))
    return capacity, calls
