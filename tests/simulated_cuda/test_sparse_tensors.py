"""Sparse tensors are not simulated: every call that would make one on the simulated device
raises ``SimulatedCudaError`` saying so, and allocates nothing. They used to be densified
in silence (``sparse.cuda()`` gave a strided tensor) or to fail deep inside the simulation
("Cannot access storage of SparseTensorImpl")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from adaptmem import adaptive
from adaptmem.testing import SimulatedCudaError, simulated_cuda


def _sparse() -> torch.Tensor:
    return torch.sparse_coo_tensor([[0, 1], [1, 0]], torch.ones(2), (4, 4),
                                   check_invariants=True)


def _moved_with(module: nn.Module) -> Any:
    module.register_buffer("mask", _sparse())
    return module.to("cuda")


_MAKERS: dict[str, Callable[[], Any]] = {
    "cuda": lambda: _sparse().cuda(),
    "to": lambda: _sparse().to("cuda"),
    "to-non-blocking": lambda: _sparse().to("cuda", non_blocking=True),
    "to-csr": lambda: _sparse().to_sparse_csr().to("cuda"),
    "module-to": lambda: _moved_with(nn.Linear(4, 4)),
    "factory": lambda: torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), device="cuda"),
    "from-device-parts": lambda: torch.sparse_coo_tensor(
        torch.tensor([[0, 1]], device="cuda"), torch.ones(2, device="cuda"), (3,)),
    "empty-with-layout": lambda: torch.empty(3, 3, layout=torch.sparse_coo, device="cuda"),
    "zeros-like": lambda: torch.zeros_like(_sparse(), device="cuda"),
    "empty-like": lambda: torch.empty_like(_sparse(), device="cuda"),
    "to-sparse": lambda: torch.eye(3, device="cuda").to_sparse(),
    "to-sparse-csr": lambda: torch.eye(3, device="cuda").to_sparse_csr(),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # torch's, once
@pytest.mark.parametrize("make", list(_MAKERS.values()), ids=list(_MAKERS))
def test_a_sparse_tensor_on_the_device_is_refused_never_densified(
        make: Callable[[], Any]) -> None:
    with simulated_cuda(), torch.no_grad():
        before = torch.cuda.memory_allocated()
        with pytest.raises(SimulatedCudaError, match="sparse tensors are not simulated"):
            make()
        assert torch.cuda.memory_allocated() == before


def test_sparse_host_tensors_still_work_inside_the_block() -> None:
    with simulated_cuda():
        sparse = _sparse()
        dense = torch.sparse.mm(sparse, torch.ones(4, 2))
        assert sparse.layout is torch.sparse_coo
        assert dense.tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
        on_device = sparse.to_dense().cuda()  # the dense form is simulated
        assert on_device.layout is torch.strided and on_device.sum().item() == 2.0


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("mask", _sparse())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.sparse.mm(self.mask, x.T).T


_PLACEMENTS: dict[str, Callable[[nn.Module], Any]] = {
    # What goes to the device at placement does, so placement fails.
    "page-resident": lambda m: adaptive.page(m, "cuda", pin_memory=False),
    # Paged, chunked and split weights go at the first call, so that call fails.
    "page-all-paged": lambda m: adaptive.page(m, "cuda", unit_bytes=0, resident_bytes=0),
    "chunk": lambda m: adaptive.chunk(m, "cuda"),
    "split": lambda m: adaptive.split(m, {"cuda:0": "1GiB", "cpu": None}),
}


@pytest.mark.parametrize("place", list(_PLACEMENTS.values()), ids=list(_PLACEMENTS))
def test_placing_a_model_with_a_sparse_buffer_is_refused_and_leaves_it_as_it_was(
        place: Callable[[nn.Module], Any]) -> None:
    torch.manual_seed(0)
    model = _Masked().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
        with simulated_cuda():
            engine = None
            with pytest.raises(SimulatedCudaError, match="sparse tensors are not simulated"):
                engine = place(model)
                model(x.cuda())
            if engine is not None:
                engine.remove()
            assert torch.cuda.memory_allocated() == 0
        assert model.mask.layout is torch.sparse_coo and model.mask.device.type == "cpu"
        assert model.linear.weight.device.type == "cpu"
        assert torch.equal(model(x), expected)
