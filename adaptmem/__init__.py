"""adaptmem: run PyTorch inference on whatever memory a machine has."""

from . import adaptive
from ._common.errors import AdaptmemError, LoadError, OutOfMemoryError, PlacementError

__version__ = "0.1.0"

__all__ = [
    "AdaptmemError",
    "LoadError",
    "OutOfMemoryError",
    "PlacementError",
    "__version__",
    "adaptive",
]
