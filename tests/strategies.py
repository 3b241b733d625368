"""hypothesis strategies shared by the tests (attrs keeps its strategies in one place too)."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

__all__ = ["SPLIT_WIDTH", "module_trees_for_split", "build_tree_for_split", "split_placements"]

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
