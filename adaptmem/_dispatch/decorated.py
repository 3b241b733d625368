"""What a type checker sees of a decorator given ``model=``: the decorated function of
``_execution/decorated.py`` plus ``.placement``, ``.pagers`` and ``.remove()`` (see
[Note: typed decorators] there). Nothing here runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, overload

import torch

from .._execution.decorated import Decorated, DecoratedMethod

if TYPE_CHECKING:
    from .._paging.api import Pager

__all__ = [
    "PlacingBatchDecorator",
    "PlacingChunkedDecorator",
    "PlacingDecorated",
    "PlacingDecoratedMethod",
    "PlacingRangeDecorator",
]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)


class _Placing(Protocol):
    @property
    def placement(self) -> dict[str, Any]:
        """Where the models are, the engine in force and how often it changed."""

    @property
    def pagers(self) -> list[Pager]:
        """The ``Pager`` of each paged model."""

    def remove(self) -> None:
        """Give the models back as they were before the first call."""


class PlacingDecorated(Decorated[P, R_co], _Placing, Protocol[P, R_co]):
    """A function decorated with ``model=``."""


class PlacingDecoratedMethod(DecoratedMethod[S_contra, P, R_co], _Placing,
                             Protocol[S_contra, P, R_co]):
    """A method decorated with ``model=``: bound, a ``PlacingDecorated`` without the size."""

    @overload
    def __get__(self, obj: None, objtype: type | None = None
                ) -> PlacingDecoratedMethod[S_contra, P, R_co]: ...
    @overload
    def __get__(self, obj: S_contra, objtype: type | None = None
                ) -> PlacingDecorated[P, R_co]: ...


class PlacingBatchDecorator(Protocol):
    """``adaptive.batch(..., model=...)``."""

    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[int, P], R], /) -> PlacingDecorated[P, R]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: staticmethod[Concatenate[int, P], R], /
    ) -> PlacingDecorated[P, R]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[type[S], int, P], R], /) -> PlacingDecorated[P, R]: ...
    @overload
    def __call__(self, func: Callable[Concatenate[S, int, P], R], /
                 ) -> PlacingDecoratedMethod[S, P, R]: ...


class PlacingRangeDecorator(Protocol):
    """``adaptive.range(..., model=...)``."""

    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[int, int, P], R], /
    ) -> PlacingDecorated[Concatenate[int, int, P], list[R]]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: staticmethod[Concatenate[int, int, P], R], /
    ) -> PlacingDecorated[Concatenate[int, int, P], list[R]]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[type[S], int, int, P], R], /
    ) -> PlacingDecorated[Concatenate[int, int, P], list[R]]: ...
    @overload
    def __call__(self, func: Callable[Concatenate[S, int, int, P], R], /
                 ) -> PlacingDecoratedMethod[S, Concatenate[int, int, P], list[R]]: ...


class PlacingChunkedDecorator(Protocol):
    """``adaptive.chunked(..., model=...)``."""

    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[torch.Tensor, int, int, P], object], /
    ) -> PlacingDecorated[Concatenate[torch.Tensor, P], torch.Tensor]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: staticmethod[Concatenate[torch.Tensor, int, int, P], object], /
    ) -> PlacingDecorated[Concatenate[torch.Tensor, P], torch.Tensor]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[type[S], torch.Tensor, int, int, P], object], /
    ) -> PlacingDecorated[Concatenate[torch.Tensor, P], torch.Tensor]: ...
    @overload
    def __call__(self, func: Callable[Concatenate[S, torch.Tensor, int, int, P], object], /
                 ) -> PlacingDecoratedMethod[S, Concatenate[torch.Tensor, P], torch.Tensor]: ...
