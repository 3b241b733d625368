"""hypothesis strategies shared by the test modules."""

from __future__ import annotations

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
