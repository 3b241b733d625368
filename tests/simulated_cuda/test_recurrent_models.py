"""Recurrent layers and cells run on the simulated CUDA device as on a CUDA build without
cuDNN: torch's own CUDA path, whose fused LSTM and GRU cells the simulation computes with
the CUDA kernels' math, with their memory counted.

Outputs are compared with the CPU's at float32's default tolerance (rtol 1.3e-6, atol
1e-5): the CUDA cells add the gates as ((x W_ih + h W_hh) + b_ih) + b_hh, where the CPU
adds each bias inside its matrix product, so the two round differently in the last bits
(at most 1.5e-7 apart on these sizes)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from adaptmem import adaptive
from adaptmem.testing import SimulatedCudaError, simulated_cuda

_VARIANTS = [
    (cls, layers, bidirectional, batch_first, proj, bias)
    for cls, layers, bidirectional, batch_first, proj, bias in itertools.product(
        (nn.LSTM, nn.GRU, nn.RNN), (1, 2), (False, True), (False, True), (0, 3), (True, False))
    if not (proj and cls is not nn.LSTM)
]


def _on_host(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        assert out.device == torch.device("cuda", 0)
        return out.cpu()
    return type(out)(_on_host(o) for o in out)


# torch's CPU LSTM says so of its oneDNN path for the CPU reference of a projected LSTM.
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize(("cls", "layers", "bidirectional", "batch_first", "proj", "bias"),
                         _VARIANTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_recurrent_layers_match_the_cpu_in_every_variant(
        cls: Any, layers: int, bidirectional: bool, batch_first: bool, proj: int,
        bias: bool) -> None:
    torch.manual_seed(0)
    options = {"proj_size": proj} if proj else {}
    model = cls(5, 6, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                bias=bias, **options).eval()
    x = torch.randn(4, 7, 5)
    with torch.no_grad():
        expected = model(x)
        with simulated_cuda():
            model.cuda()
            out = _on_host(model(x.cuda()))
            model.cpu()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("cls", [nn.LSTMCell, nn.GRUCell, nn.RNNCell])
@pytest.mark.parametrize("bias", [True, False])
def test_recurrent_cells_match_the_cpu(cls: Any, bias: bool) -> None:
    torch.manual_seed(0)
    cell = cls(5, 6, bias=bias)
    x = torch.randn(3, 5)
    state: Any = torch.randn(3, 6)
    if cls is nn.LSTMCell:
        state = (state, torch.randn(3, 6))
    with torch.no_grad():
        expected = [cell(x), cell(x, state)]
        with simulated_cuda():
            cell.cuda()
            on_device = (tuple(s.cuda() for s in state) if isinstance(state, tuple)
                         else state.cuda())
            out = [_on_host(cell(x.cuda())), _on_host(cell(x.cuda(), on_device))]
            cell.cpu()
    torch.testing.assert_close(out, expected)


def test_a_recurrent_layer_runs_with_grad_enabled_and_records_no_graph() -> None:
    # The simulation has no autograd: the fused cells' backward is never asked for.
    torch.manual_seed(0)
    model = nn.GRU(5, 6)
    x = torch.randn(4, 2, 5)
    expected = [t.detach() for t in model(x)]
    with simulated_cuda():
        model.cuda()
        out = model(x.cuda())
        assert not out[0].requires_grad and out[0].grad_fn is None
        out = _on_host(out)
        model.cpu()
    torch.testing.assert_close(list(out), expected)


def test_a_fused_cells_backward_is_refused_by_name() -> None:
    # Nothing asks for it (no autograd); called directly, it says what it is.
    with simulated_cuda():
        state = torch.zeros(3, 6, device="cuda")
        with pytest.raises(SimulatedCudaError, match="_thnn_fused_lstm_cell_backward_impl has "
                                                     "only a CUDA kernel"):
            torch.ops.aten._thnn_fused_lstm_cell_backward_impl(
                state, state, state, state, torch.zeros(3, 24, device="cuda"), True)


@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_packed_sequences_run_with_their_batch_sizes_on_the_host(enforce_sorted: bool) -> None:
    # As on CUDA: pack_padded_sequence takes the lengths on the host and gives the batch
    # sizes there (it raised "Expected all tensors to be on the same device").
    torch.manual_seed(0)
    model = nn.LSTM(5, 6, num_layers=2, batch_first=True, bidirectional=True).eval()
    x = torch.randn(3, 7, 5)
    lengths = torch.tensor([7, 5, 2] if enforce_sorted else [2, 7, 5])

    def run(x: torch.Tensor) -> Any:
        packed = pack_padded_sequence(x, lengths, batch_first=True,
                                      enforce_sorted=enforce_sorted)
        assert packed.batch_sizes.device.type == "cpu"
        out, (h, c) = model(packed)
        padded, out_lengths = pad_packed_sequence(out, batch_first=True)
        return (padded, h, c), out_lengths

    with torch.no_grad():
        expected, expected_lengths = run(x)
        with simulated_cuda():
            model.cuda()
            out, out_lengths = run(x.cuda())
            out = _on_host(out)
            model.cpu()
    torch.testing.assert_close(out, expected)
    assert torch.equal(out_lengths, expected_lengths)  # on the host, as on CUDA


def _lstm_cell(x: torch.Tensor, h: torch.Tensor, b_ih: torch.Tensor,
               b_hh: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
    """CUDA's fused LSTM cell written out in float64: gates i, f, g, o."""
    i, f, g, o = (x + h + b_ih + b_hh).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * c + i * g
    return [o * cy.tanh(), cy, torch.cat((i, f, g, o), 1)]


def _gru_cell(x: torch.Tensor, h: torch.Tensor, b_ih: torch.Tensor,
              b_hh: torch.Tensor, hx: torch.Tensor) -> list[torch.Tensor]:
    """CUDA's fused GRU cell written out in float64: gates r, z, n, the hidden bias of n
    inside the reset gate's product."""
    (xr, xz, xn), (hr, hz, hn) = x.chunk(3, 1), h.chunk(3, 1)
    (br, bz, bn), (cr, cz, cn) = b_ih.chunk(3), b_hh.chunk(3)
    r, z = (xr + hr + br + cr).sigmoid(), (xz + hz + bz + cz).sigmoid()
    n = (xn + bn + r * (hn + cn)).tanh()
    return [n + z * (hx - n), torch.cat((r, z, n, hx, hn + cn), 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_fused_cells_compute_the_cuda_kernels_math_rounding_once(kind: str,
                                                                  dtype: torch.dtype) -> None:
    # The kernels add and activate in float (CUDA's accumulate type for half and bfloat16)
    # and round each output once: within one rounding of the float64 result. The workspace
    # (kept for backward) holds the activated gates, and for the GRU hx and hn + b_hn.
    torch.manual_seed(0)
    gates = 4 if kind == "lstm" else 3
    args = [torch.randn(3, gates * 6), torch.randn(3, gates * 6), torch.randn(gates * 6),
            torch.randn(gates * 6), torch.randn(3, 6)]
    args = [a.to(dtype) for a in args]
    reference = (_lstm_cell if kind == "lstm" else _gru_cell)(*(a.double() for a in args))
    aten = torch.ops.aten
    fused = aten._thnn_fused_lstm_cell if kind == "lstm" else aten._thnn_fused_gru_cell
    x, h, b_ih, b_hh, state = args
    with simulated_cuda():
        before = torch.cuda.memory_allocated()
        out = fused(*(a.cuda() for a in (x, h, state, b_ih, b_hh)))
        assert all(o.dtype == dtype for o in out)
        counted = torch.cuda.memory_allocated() - before
        assert counted == sum(-(-o.numel() * o.element_size() // 512) * 512 for o in out)
        out = [o.cpu() for o in out]
    eps = torch.finfo(dtype).eps
    for got, want in zip(out, reference, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=eps, atol=1e-6)


def test_fused_cells_check_the_sizes_cudas_kernels_check() -> None:
    with simulated_cuda():
        gates, hidden = torch.zeros(3, 24, device="cuda"), torch.zeros(3, 6, device="cuda")
        with pytest.raises(RuntimeError, match="_thnn_fused_lstm_cell: expected input and "
                                               r"hidden gates .* got gates \[3, 24\] and "
                                               r"\[3, 12\]"):
            torch.ops.aten._thnn_fused_lstm_cell(gates, gates[:, :12], hidden)
        with pytest.raises(RuntimeError, match="_thnn_fused_gru_cell: expected .* biases "
                                               r"\[18\] and None"):
            torch.ops.aten._thnn_fused_gru_cell(gates[:, :18], gates[:, :18], hidden,
                                                torch.zeros(18, device="cuda"))


def test_recurrent_layers_count_their_memory() -> None:
    torch.manual_seed(0)
    model = nn.LSTM(64, 128, num_layers=2).eval()
    x = torch.randn(16, 8, 64)
    with simulated_cuda(), torch.no_grad():
        model.cuda()
        x = x.cuda()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out, (h, c) = model(x)
        kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (out, h, c)}
        assert torch.cuda.memory_allocated() - before == sum(
            -(-n // 512) * 512 for n in kept.values())
        # Each step's gates, workspace and states were on the device too, for a while.
        step_gates = 8 * 4 * 128 * 4
        assert torch.cuda.max_memory_allocated() - before > sum(kept.values()) + step_gates
        del out, h, c
        assert torch.cuda.memory_allocated() == before
        model.cpu()


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.lstm = nn.LSTM(8, 8, num_layers=2, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True, bidirectional=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(self.embed(x))
        y, _ = self.gru(y)
        return self.head(y)


def test_a_bfloat16_lstm_chunked_onto_the_device_runs() -> None:
    # The chunked model's LSTM runs in bfloat16 on the device: torch's fused LSTM cell.
    torch.manual_seed(0)
    model = _Tagger().eval()
    x = torch.randn(2, 5, 6)
    with torch.no_grad():
        expected = model(x)
        with simulated_cuda(), adaptive.chunk(model, "cuda", dtype=torch.bfloat16):
            out = model(x.cuda())
            assert model.lstm.weight_hh_l0.dtype == torch.bfloat16
            assert model.lstm.weight_hh_l0.device.type == "cuda"
            out = out.cpu()
    torch.testing.assert_close(out, expected, rtol=0.02, atol=0.01)  # bfloat16's 8 bits


def test_the_simulated_device_has_no_cudnn_as_a_cuda_build_without_it() -> None:
    # With cuDNN, nn.LSTM's .cuda() reached aten::_cudnn_rnn_flatten_weight and its call
    # aten::_cudnn_rnn, which have only CUDA kernels.
    enabled = torch.backends.cudnn.enabled
    with simulated_cuda():
        x = torch.ones(2, 3, device="cuda")
        assert not torch.backends.cudnn.enabled
        assert not torch.backends.cudnn.is_acceptable(x)
        # Ops that pick cuDNN in C++ take torch's own kernels too.
        grid = nn.functional.affine_grid(torch.eye(2, 3, device="cuda")[None], [1, 1, 4, 4],
                                         align_corners=False)
        image = torch.arange(16.0, device="cuda").reshape(1, 1, 4, 4)
        sampled = nn.functional.grid_sample(image, grid, align_corners=False)
        assert torch.equal(sampled.cpu(), image.cpu())
    assert torch.backends.cudnn.enabled == enabled
    torch.backends.cudnn.enabled = False
    try:
        with simulated_cuda():
            pass
        assert not torch.backends.cudnn.enabled  # put back as it was, off too
    finally:
        torch.backends.cudnn.enabled = enabled


def test_turning_cudnn_on_inside_the_block_is_refused_by_name() -> None:
    with simulated_cuda():
        torch.backends.cudnn.enabled = True
        with pytest.raises(SimulatedCudaError,
                           match=r"_cudnn_rnn_flatten_weight has only a CUDA kernel.*no cuDNN"):
            nn.LSTM(4, 4).cuda()
    assert torch.backends.cudnn.enabled
