"""A simulated CUDA device, so code written for CUDA runs unchanged on the CPU.

See ``adaptmem.testing.simulated_cuda`` for what is simulated. One job per file:
``_memory`` (the caching allocator model), ``_streams`` (streams, events, the race
detector), ``_tensors`` (simulated tensors and the modes computing with them),
``_mixing`` (where CPU and CUDA tensors may meet in one op), ``_kernels`` (CPU
equivalents of the kernels CUDA picks by device type), ``_errors`` (what the simulation
refuses), ``_storages`` (their storages: ``torch.load`` onto the device), ``_torch_cuda``
(the ``torch.cuda`` functions the simulation answers), ``_state``.
"""

from ._simulation import SimulatedCuda, SimulatedCudaError, simulated_cuda
from ._streams import StreamRaceError

__all__ = ["SimulatedCuda", "SimulatedCudaError", "StreamRaceError", "simulated_cuda"]
