"""Common user code on the simulated CUDA device answers as it does on a GPU."""

from __future__ import annotations

import torch
from torch import nn

from adaptmem.testing import simulated_cuda


def test_module_to_with_a_device_keyword_moves_the_module() -> None:
    # Module.to parses its arguments with torch._C._nn._parse_to, whose ``device=`` made it
    # look like a factory: the module stayed on the host, in silence.
    with simulated_cuda():
        model = nn.Linear(8, 8).to(device="cuda", dtype=torch.bfloat16)
        assert model.weight.device == torch.device("cuda", 0)
        assert model.weight.dtype == torch.bfloat16
        assert nn.Linear(2, 2).to(device="cuda").bias.is_cuda
        assert torch._C._nn._parse_to(device="cuda")[0] == torch.device("cuda")
        with torch.no_grad():
            assert model(torch.ones(2, 8, device="cuda", dtype=torch.bfloat16)).is_cuda
