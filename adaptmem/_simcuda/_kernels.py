"""CPU equivalents of the kernels torch picks for CUDA tensors by device type, and of an op
CUDA runs with host arguments (``_pack_padded_sequence``).

[Note: kernels CUDA picks by device type]
Some ops decide in C++ from the device alone that a CUDA kernel will run: a recurrent cell
(``nn.LSTM``'s, ``nn.GRU``'s, and ``nn.LSTMCell``/``nn.GRUCell``) asks for
``_thnn_fused_lstm_cell``/``_thnn_fused_gru_cell`` (aten/src/ATen/native/RNN.cpp:
``input.is_cuda()``), and batch norm with cuDNN on for ``cudnn_batch_norm``. Those reach
the dispatch mode with simulated tensors and have no CPU kernel, so the simulation runs
the equivalents below on the backings. The fused cells follow the CUDA kernels' math
(aten/src/ATen/native/cuda/RNN.cu): the gates are summed as ((input + hidden) + input
bias) + hidden bias and activated in the accumulate type (float for half and bfloat16,
CUDA's ``acc_type``), each output is rounded once, and the outputs have the kernels'
shapes (the workspace kept for backward included), so the memory counted is CUDA's.
Checked against the CUDA kernels on an H100 (torch 2.11): float32 and float64 outputs
within 4 units in the last place (the two sides' exp and tanh differ), float16 and
bfloat16 ones equal but for one rounding step in at most 0.03% of the elements.

The simulated device has no cuDNN: ``torch.backends.cudnn.enabled`` is False inside the
block (_simulation.py), so recurrent layers take torch's own CUDA path (the fused cells),
as a CUDA build without cuDNN does, rather than ``_cudnn_rnn_flatten_weight`` and
``_cudnn_rnn``, whose weight layout and workspace are cuDNN's own; ``grid_sample`` and
``affine_grid`` take theirs too. Backward kernels are not needed: ops on simulated tensors
run without grad (the simulation has no autograd); one called directly is refused by name
(_errors.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CPU_EQUIVALENT", "pack_padded_sequence"]

aten = torch.ops.aten


def _cudnn_batch_norm(*args: Any) -> Any:
    out, mean, invstd = aten.native_batch_norm.default(*args)
    return out, mean, invstd, torch.empty(0, dtype=torch.uint8)


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    """CUDA's ``acc_type`` for a floating dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))  # the kernel's own formula


def _check_cell(name: str, factor: int, input_gates: torch.Tensor,
                hidden_gates: torch.Tensor, hx: torch.Tensor, input_bias: Any,
                hidden_bias: Any) -> None:
    """The sizes CUDA's kernel checks (``checkSizes`` in RNN.cu)."""
    gates = input_gates.shape[-1] if input_gates.dim() else 0
    if (input_gates.dim() != 2 or hidden_gates.shape != input_gates.shape or hx.dim() != 2
            or hx.numel() * factor != input_gates.numel() or (input_bias is None) != (
                hidden_bias is None) or (input_bias is not None and (
                    input_bias.shape != (gates,) or hidden_bias.shape != (gates,)))):
        raise RuntimeError(
            f"{name}: expected input and hidden gates of one 2-d shape (batch, {factor} * "
            f"hidden), biases of ({factor} * hidden,) or none, and a 2-d (batch, hidden) "
            f"state; got gates {list(input_gates.shape)} and {list(hidden_gates.shape)}, "
            f"biases {None if input_bias is None else list(input_bias.shape)} and "
            f"{None if hidden_bias is None else list(hidden_bias.shape)}, state "
            f"{list(hx.shape)} (simulated CUDA)")


def _summed_gates(factor: int, input_gates: torch.Tensor, hidden_gates: torch.Tensor,
                  input_bias: Any, hidden_bias: Any, acc: torch.dtype) -> tuple[Any, ...]:
    """(input gates, hidden gates, input bias, hidden bias), each split into its ``factor``
    gates, in the accumulate type (a missing bias is 0.0)."""
    parts: list[tuple[Any, ...]] = [input_gates.to(acc).chunk(factor, 1),
                                    hidden_gates.to(acc).chunk(factor, 1)]
    for bias in (input_bias, hidden_bias):
        parts.append((0.0,) * factor if bias is None else bias.to(acc).chunk(factor))
    return tuple(parts)


def _fused_lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor,
                     cx: torch.Tensor, input_bias: Any = None,
                     hidden_bias: Any = None) -> tuple[torch.Tensor, ...]:
    """CUDA's ``_thnn_fused_lstm_cell``: gates i, f, g, o; (hy, cy, workspace), the
    workspace holding the activated gates."""
    _check_cell("_thnn_fused_lstm_cell", 4, input_gates, hidden_gates, cx, input_bias,
                hidden_bias)
    dtype, acc = input_gates.dtype, _accumulate(input_gates.dtype)
    x, h, b1, b2 = _summed_gates(4, input_gates, hidden_gates, input_bias, hidden_bias, acc)
    i = _sigmoid(x[0] + h[0] + b1[0] + b2[0])
    f = _sigmoid(x[1] + h[1] + b1[1] + b2[1])
    g = torch.tanh(x[2] + h[2] + b1[2] + b2[2])
    o = _sigmoid(x[3] + h[3] + b1[3] + b2[3])
    cy = f * cx.to(acc) + i * g
    hy = o * torch.tanh(cy)
    workspace = torch.cat((i, f, g, o), 1).to(dtype)
    return hy.to(dtype), cy.to(dtype), workspace


def _fused_gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
                    input_bias: Any = None,
                    hidden_bias: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's ``_thnn_fused_gru_cell``: gates r, z, n, the hidden bias of n inside the reset
    gate's product; (hy, workspace), the workspace holding r, z, n, hx and the hidden n."""
    _check_cell("_thnn_fused_gru_cell", 3, input_gates, hidden_gates, hx, input_bias,
                hidden_bias)
    dtype, acc = input_gates.dtype, _accumulate(input_gates.dtype)
    x, h, b1, b2 = _summed_gates(3, input_gates, hidden_gates, input_bias, hidden_bias, acc)
    r = _sigmoid(x[0] + h[0] + b1[0] + b2[0])
    z = _sigmoid(x[1] + h[1] + b1[1] + b2[1])
    hidden_n = h[2] + b2[2]
    n = torch.tanh(x[2] + b1[2] + r * hidden_n)
    hy = n + z * (hx.to(acc) - n)
    workspace = torch.cat((r, z, n, hx.to(acc), hidden_n), 1).to(dtype)
    return hy.to(dtype), workspace


# See [Note: kernels CUDA picks by device type].
CPU_EQUIVALENT: dict[Any, Callable[..., Any]] = {
    aten.cudnn_batch_norm.default: _cudnn_batch_norm,
    aten.miopen_batch_norm.default: lambda *a: aten.native_batch_norm.default(*a),
    aten._thnn_fused_lstm_cell.default: _fused_lstm_cell,
    aten._thnn_fused_gru_cell.default: _fused_gru_cell,
}


def pack_padded_sequence(sim: Any, padded: torch.Tensor, lengths: torch.Tensor,
                         batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten::_pack_padded_sequence`` of simulated tensor ``padded`` in simulation ``sim``
    (its ``Tensors``): as on CUDA, the lengths are a host tensor and so are the batch sizes
    it gives (aten/src/ATen/native/PackedSequence.cpp); the packed data is on the device."""
    if lengths.device.type != "cpu":
        raise RuntimeError(f"'lengths' argument should be a 1D CPU int64 tensor, but got a "
                           f"tensor on {lengths.device} (simulated CUDA)")
    backing, record = sim.lookup(padded)
    sim.use(record, sim.state.current_streams[record.index], padded, "pack_padded_sequence")
    data, batch_sizes = aten._pack_padded_sequence.default(backing, lengths, batch_first)
    return sim.adopt(data, record.index), batch_sizes
