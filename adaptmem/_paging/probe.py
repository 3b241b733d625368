"""The probe that watches a forward: every weight an op receives is loaded first.

The planner cannot see a module that reads a child's weight without calling the child
(``MultiheadAttention`` and ``out_proj``, swin's ``ShiftedWindowAttention`` and ``qkv``).
This ``TorchFunctionMode`` sees every op; the pager uses it in the first forward to learn
such reads, and whenever a forward takes a path the first one did not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from .pager import Pager

__all__ = ["Probe", "is_metadata"]

# Reading these from a weight does not need its values, so the probe leaves it on the host.
_METADATA = frozenset({
    "shape", "dtype", "device", "is_cuda", "is_cpu", "is_mps", "is_xpu", "is_meta",
    "requires_grad", "ndim", "layout", "is_sparse", "is_quantized", "names", "size", "dim",
    "numel", "nelement", "stride", "element_size", "itemsize", "nbytes", "is_floating_point",
    "is_complex", "is_contiguous", "data_ptr", "get_device", "storage_offset", "grad_fn",
    "is_leaf", "_version", "__len__",
})


def is_metadata(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name in _METADATA


class Probe(TorchFunctionMode):
    """Watches a forward: every weight an op receives is loaded (and, in the first
    forward, recorded) before the op runs."""

    def __init__(self, pager: Pager) -> None:
        super().__init__()
        self.pager = pager

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.pager._busy and not is_metadata(func):
            self.pager._touch(args, kwargs)
        return func(*args, **kwargs)
