"""A pytest plugin: the ``simulated_cuda_device`` fixture.

Enable it in your top-level ``conftest.py``::

    pytest_plugins = ["adaptmem.testing_plugin"]

then ask for the fixture; a test runs inside ``adaptmem.testing.simulated_cuda(...)``, with
the options of its ``simulated_cuda`` marker (the defaults otherwise)::

    @pytest.mark.simulated_cuda(devices=2, total_memory="8GiB", bandwidth=25)
    def test_my_gpu_code(simulated_cuda_device):
        assert torch.cuda.device_count() == 2

The fixture yields the running ``SimulatedCuda``; stream misuse it saw fails the test when
the test ends (``SimulatedCudaError``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .testing import SimulatedCuda, simulated_cuda

__all__ = ["simulated_cuda_device"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "simulated_cuda(devices=1, total_memory='16GiB', bandwidth=None): options "
        "of the simulated CUDA device the simulated_cuda_device fixture runs a test on")


@pytest.fixture
def simulated_cuda_device(request: pytest.FixtureRequest) -> Iterator[SimulatedCuda]:
    """The test runs on a simulated CUDA device (see ``adaptmem.testing.simulated_cuda``)."""
    marker = request.node.get_closest_marker("simulated_cuda")
    args, options = (marker.args, dict(marker.kwargs)) if marker is not None else ((), {})
    with simulated_cuda(*args, **options) as sim:  # simulated_cuda(2) as simulated_cuda(2)
        yield sim
