"""Predicting the memory a call needs per item, before running it for real.

[Note: predicting peak memory on meta]
A forward on meta tensors allocates nothing but still computes every shape, so counting the
bytes of the tensors it creates, and freeing them as Python drops them, gives the peak the
real call would reach above what already existed (weights, inputs). Run at two batch sizes,
the peaks fit ``peak(b) = fixed + per_item * b``: activations grow with the batch, workspace
and outputs of fixed shape do not. The real peak is higher by what meta cannot see (the
allocator's rounding and cached blocks, library workspaces, kernels that allocate outside
torch), so users of the prediction keep a margin and still treat an out-of-memory error as
the last word. A call that cannot run on meta (``.item()``, data-dependent shapes, custom
kernels) has no prediction: ``predict_per_item`` raises ``NotPredictable``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .._common.peak import NotPredictable, PeakPrediction, PeakTracker, fit
from .recording import meta_copy

__all__ = ["predict_per_item", "predict_model", "activation_report"]


def predict_per_item(call: Callable[..., Any], *args: Any, sizes: tuple[int, int] = (2, 4),
                     **kwargs: Any) -> PeakPrediction:
    """Trace ``call(batch, *args, **kwargs)`` on meta copies of ``args``/``kwargs`` (models and
    tensors inside them included; nothing the caller passed changes) at two batch sizes and
    fit the bytes allocated per item. See [Note: predicting peak memory on meta].

    Raises:
        NotPredictable: the call failed on meta (the message names the error).
    """
    small, large = sizes
    if not 0 < small < large:
        raise ValueError(f"sizes must be two increasing positive batch sizes, got {sizes}")
    peaks = []
    for batch in sizes:
        meta_args, meta_kwargs = meta_copy((args, kwargs))
        tracker = PeakTracker()
        try:
            with torch.no_grad(), tracker:
                result = call(batch, *meta_args, **meta_kwargs)
                del result
        except Exception as exc:  # noqa: BLE001 - any failure on meta means "no prediction"
            raise NotPredictable(f"{type(exc).__name__}: {exc}") from exc
        peaks.append(tracker.peak)
    return fit(sizes, (peaks[0], peaks[1]))


def predict_model(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  sizes: tuple[int, int] = (2, 4),
                  dtype: torch.dtype | None = None) -> PeakPrediction:
    """``predict_per_item`` for ``model(*args, **kwargs)``: every input tensor whose first
    dimension is the batch (the first input tensor's first dimension) is traced at each size.
    With ``dtype``, floating weights and inputs are in it, as a placement in that dtype runs.

    Raises:
        NotPredictable: no input tensor has a batch dimension, or the forward fails on meta.
    """
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise NotPredictable("the example inputs have no tensor with a batch dimension")
    batch = tensors[0].shape[0]

    def at(size: int, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        want = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if t.dim() > 0 and t.shape[0] == batch:
            return torch.empty((size, *t.shape[1:]), dtype=want, device=t.device)
        return t.to(want)

    if dtype is not None:  # converted before the trace, whose peak counts activations only
        model = meta_copy(model).to(dtype)

    def forward(size: int, m: torch.nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        return m(*[_map(at, size, x) for x in a], **{n: _map(at, size, x) for n, x in k.items()})

    return predict_per_item(forward, model, args, kwargs, sizes=sizes)


def _map(fn: Callable[[int, Any], Any], size: int, obj: Any) -> Any:
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_map(fn, size, x) for x in obj)
    if isinstance(obj, dict):
        return {k: _map(fn, size, v) for k, v in obj.items()}
    return fn(size, obj)


def activation_report(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      room: int | None, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """What a plan reports about activations: bytes per item and fixed (see
    ``predict_model``; in ``dtype``, the first device's, when the plan converts there), and
    the largest batch whose predicted peak fits 80% of ``room`` (the first device's capacity
    left after its weights; omitted when unknown), or why there is no prediction."""
    try:
        p = predict_model(model, args, kwargs, dtype=dtype)
    except NotPredictable as exc:
        return {"predicted": False, "reason": str(exc)}
    report: dict[str, Any] = {"predicted": True, "per_item_bytes": int(p.per_item_bytes),
                              "fixed_bytes": p.fixed_bytes}
    if room is not None:
        report["room_bytes"] = room
        report["largest_batch"] = p.largest(room)
    return report
