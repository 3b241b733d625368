"""What a type checker sees of the adaptive decorators: a decorated function keeps its
parameters minus the size the decorator passes (``batchsize``; ``start, end`` of a range
step come back as the caller's range; a chunked step's ``chunk, start, end`` become the
whole tensor). Nothing here runs: the decorators return their own objects, which these
protocols describe (see [Note: typed decorators])."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Literal,
    ParamSpec,
    Protocol,
    TypedDict,
    TypeVar,
    overload,
)

import torch

if TYPE_CHECKING:
    from .cache import BatchsizeCache
    from .stats import Adaptation, CallStats

__all__ = [
    "BatchDecorator",
    "BatchOptions",
    "ChunkedDecorator",
    "ChunkedOptions",
    "Decorated",
    "DecoratedMethod",
    "RangeDecorator",
    "RangeOptions",
    "SizeOptions",
]

# [Note: typed decorators] ``@adaptive.batch(...)`` on ``def f(batchsize: int, x: T) -> R``
# is typed ``Decorated[[x: T], R]``: called as ``f(x)`` (``f(8, x)``, the size passed by
# hand, is a type error as it is a TypeError at run time). A method's size comes after
# ``self``: ``DecoratedMethod`` binds like a function, to ``Decorated`` without the size; a
# staticmethod's or classmethod's decorated function is ``Decorated`` itself. The function
# forms are tried first: a method's ``self`` is never an ``int`` (nor a tensor). A range's
# bounds and a chunked function's tensor are typed positional (at run time the names the
# function gives them work as keywords too). The options are TypedDicts so that a
# misspelled keyword is an error, not swallowed by ``**options``.

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)


class _Figures(Protocol):
    """What every decorated function has, bound or not."""

    __name__: str
    __qualname__: str

    @property
    def stats(self) -> CallStats:
        """Calls, attempts, failed attempts and sizes (``adaptive.CallStats``)."""

    @property
    def prediction(self) -> Any:
        """The first call's ``"auto"`` prediction, or None."""

    @property
    def initial(self) -> int:
        """The initial (largest) size tried."""


class Decorated(_Figures, Protocol[P, R_co]):
    """A function decorated by ``adaptive.batch``, ``range`` or ``chunked``."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...


class DecoratedMethod(_Figures, Protocol[S_contra, P, R_co]):
    """A method decorated by ``adaptive.batch``, ``range`` or ``chunked``: bound to an
    instance, a ``Decorated`` without the size."""

    def __call__(self, instance: S_contra, /, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    @overload
    def __get__(self, obj: None, objtype: type | None = None
                ) -> DecoratedMethod[S_contra, P, R_co]: ...
    @overload
    def __get__(self, obj: S_contra, objtype: type | None = None) -> Decorated[P, R_co]: ...


class BatchDecorator(Protocol):
    """``adaptive.batch(...)``: takes ``f(batchsize, ...)``, gives ``f(...)``."""

    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[int, P], R], /) -> Decorated[P, R]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: staticmethod[Concatenate[int, P], R], /) -> Decorated[P, R]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[type[S], int, P], R], /) -> Decorated[P, R]: ...
    @overload
    def __call__(self, func: Callable[Concatenate[S, int, P], R], /
                 ) -> DecoratedMethod[S, P, R]: ...


class RangeDecorator(Protocol):
    """``adaptive.range(...)``: takes ``f(start, end, ...) -> R``, gives
    ``f(start, end, ...) -> list[R]``."""

    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[int, int, P], R], /
    ) -> Decorated[Concatenate[int, int, P], list[R]]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: staticmethod[Concatenate[int, int, P], R], /
    ) -> Decorated[Concatenate[int, int, P], list[R]]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[type[S], int, int, P], R], /
    ) -> Decorated[Concatenate[int, int, P], list[R]]: ...
    @overload
    def __call__(self, func: Callable[Concatenate[S, int, int, P], R], /
                 ) -> DecoratedMethod[S, Concatenate[int, int, P], list[R]]: ...


class ChunkedDecorator(Protocol):
    """``adaptive.chunked(...)``: takes ``f(chunk, start, end, ...)``, gives
    ``f(tensor, ...) -> Tensor`` (the tensor, or with ``output="new"`` a new one)."""

    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[torch.Tensor, int, int, P], object], /
    ) -> Decorated[Concatenate[torch.Tensor, P], torch.Tensor]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: staticmethod[Concatenate[torch.Tensor, int, int, P], object], /
    ) -> Decorated[Concatenate[torch.Tensor, P], torch.Tensor]: ...
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, func: Callable[Concatenate[type[S], torch.Tensor, int, int, P], object], /
    ) -> Decorated[Concatenate[torch.Tensor, P], torch.Tensor]: ...
    @overload
    def __call__(self, func: Callable[Concatenate[S, torch.Tensor, int, int, P], object], /
                 ) -> DecoratedMethod[S, Concatenate[torch.Tensor, P], torch.Tensor]: ...


class SizeOptions(TypedDict, total=False):
    """The options every adaptive decorator takes besides its sizes."""

    cache: BatchsizeCache | type[BatchsizeCache] | None
    context: Hashable
    device: torch.device | str | int | None
    group: object
    group_timeout: float
    on_adapt: Callable[[Adaptation], object] | None


class BatchOptions(SizeOptions, total=False):
    """``adaptive.batch``'s options besides ``initial_batchsize``."""

    min_batchsize: int
    max_batchsize: int | None
    accumulate: torch.nn.Module | torch.Tensor | Iterable[torch.Tensor] | None


class RangeOptions(SizeOptions, total=False):
    """``adaptive.range``'s options besides ``initial_step``."""

    min_step: int
    max_step: int | None
    progress: bool


class ChunkedOptions(RangeOptions, total=False):
    """``adaptive.chunked``'s options besides ``initial_step``."""

    dimension: int
    output: Literal["input", "new"] | None
