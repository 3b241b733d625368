"""Decorators that adapt the batch size and the placement of their models together."""

from .api import Dispatched, batch, chunked, range

__all__ = ["Dispatched", "batch", "chunked", "range"]
