"""Chunk and split: units of a model placed on several devices, activations converted at the
boundaries. One job per file: ``api`` (the public ``chunk`` / ``split``), ``splitter`` (the
engine and its handles), ``mover`` (moving tensors and putting them back), ``boundaries``
(the hooks converting activations), ``device_map`` (checking a user's map)."""

from .api import chunk, chunk_targets, split
from .splitter import Chunker, Mode, Splitter

__all__ = ["Chunker", "Mode", "Splitter", "chunk", "chunk_targets", "split"]
