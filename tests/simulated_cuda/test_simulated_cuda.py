"""The simulated CUDA device (adaptmem.testing.simulated_cuda) behaves as CUDA does."""

from __future__ import annotations

import copy
import ctypes
import mmap
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from adaptmem.testing import SimulatedCudaError, StreamRaceError, simulated_cuda

MiB = 1024**2


# -- devices ---------------------------------------------------------------------------------

def test_devices_are_reported_as_asked() -> None:
    with simulated_cuda(devices=2, total_memory="8GiB"):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
        assert torch.cuda.get_device_properties(1).total_memory == 8 * 1024**3
        assert torch.cuda.current_device() == 0
        with torch.cuda.device(1):
            assert torch.cuda.current_device() == 1
            assert torch.empty(2, device="cuda").device == torch.device("cuda", 1)
        torch.cuda.set_device(1)
        assert torch.ones(1, device="cuda").device == torch.device("cuda", 1)
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.ones(1, device="cuda:2")


def test_a_simulation_shows_its_devices_memory_and_link() -> None:
    assert repr(simulated_cuda()) == (
        "<SimulatedCuda devices=1 total_memory=16.0 GiB each, bandwidth=unlimited>")
    with simulated_cuda(devices=2, total_memory="1536MiB", bandwidth=12) as sim:
        assert repr(sim) == "<SimulatedCuda devices=2 total_memory=1.5 GiB each, bandwidth=12 GB/s>"


def test_nothing_of_torch_is_changed_after_the_block_even_when_it_raised() -> None:
    before = (torch.cuda.is_available, torch.cuda.Stream, torch.cuda.memory_allocated)
    real_cuda = torch.cuda.is_available()  # a real GPU beside the simulation stays usable
    with pytest.raises(ValueError, match="boom"), simulated_cuda():
        torch.ones(3, device="cuda")
        raise ValueError("boom")
    assert torch.cuda.is_available() == real_cuda
    assert (torch.cuda.is_available, torch.cuda.Stream, torch.cuda.memory_allocated) == before
    assert torch.overrides._get_current_function_mode() is None
    assert not torch._C._is_torch_function_mode_enabled()
    assert torch._C._len_torch_dispatch_stack() == 0
    if real_cuda:
        assert type(torch.ones(1, device="cuda")) is torch.Tensor
    else:
        with pytest.raises((RuntimeError, AssertionError)):
            torch.ones(1, device="cuda")


def test_cuda_autocast_is_refused_with_an_error_instead_of_ending_the_process() -> None:
    # Without a driver, autocast's C++ side ends the process (std::terminate).
    with simulated_cuda():
        with pytest.raises(SimulatedCudaError, match="autocast"):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pass
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU's is untouched
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert torch.amp.autocast_mode.autocast.__init__.__qualname__ == "autocast.__init__"


def test_bad_arguments_are_refused_at_the_call() -> None:
    with pytest.raises(ValueError, match="devices"):
        simulated_cuda(devices=0)
    with pytest.raises(ValueError, match="total_memory"):
        simulated_cuda(total_memory="lots")
    with pytest.raises(ValueError, match="bandwidth"):
        simulated_cuda(bandwidth=-1)


# -- tensors ---------------------------------------------------------------------------------

def test_tensors_moved_or_made_on_cuda_hold_real_values() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    layer = nn.Linear(8, 3)
    expected = layer(x).detach()
    with simulated_cuda(), torch.no_grad():
        xs = [x.to("cuda"), x.cuda(), x.to(torch.device("cuda", 0)),
              torch.empty(4, 8, device="cuda").copy_(x), torch.empty_like(x, device="cuda")]
        xs[-1].copy_(x)
        layer.to("cuda")
        assert isinstance(layer.weight, nn.Parameter) and layer.weight.device.type == "cuda"
        for xc in xs:
            assert xc.device == torch.device("cuda", 0)
            out = layer(xc)
            assert out.device == torch.device("cuda", 0)
            back = out.cpu()
            assert type(back) is torch.Tensor and back.device.type == "cpu"
            torch.testing.assert_close(back, expected)
        assert torch.equal(torch.arange(5, device="cuda").cpu(), torch.arange(5))
        assert xs[0][1:3].sum().item() == pytest.approx(x[1:3].sum().item(), rel=1e-5)


def test_tensors_print_and_convert_to_python_as_cuda_tensors_do() -> None:
    torch.manual_seed(0)
    small, half, big = torch.arange(4.0), torch.randn(2, 3).half(), torch.zeros(2000)
    layer = nn.Linear(2, 2)
    with simulated_cuda():
        assert repr(small.cuda()) == "tensor([0., 1., 2., 3.], device='cuda:0')"
        assert str(half.cuda()) == repr(half)[:-len(", dtype=torch.float16)")] + (
            ", device='cuda:0', dtype=torch.float16)")
        assert repr(big.cuda()) == "tensor([0., 0., 0.,  ..., 0., 0., 0.], device='cuda:0')"
        assert repr(layer.cuda().weight).endswith("device='cuda:0', requires_grad=True)")
        assert repr(torch.tensor(3, device="cuda")) == "tensor(3, device='cuda:0')"
        assert repr(torch.zeros(0, 3, dtype=torch.int64, device="cuda")) == (
            "tensor([], device='cuda:0', size=(0, 3), dtype=torch.int64)")  # device first
        with pytest.raises(TypeError, match="unsupported format string"):
            f"{small.cuda():.2f}"  # as torch: only a 0-dim tensor formats by value
        assert f"{small.cuda()[1]:.2f}" == "1.00"
        assert small.cuda().tolist() == [0.0, 1.0, 2.0, 3.0] and small.cuda()[2].tolist() == 2.0
        on_device = small.cuda()
        with torch.utils._python_dispatch._disable_current_modes():  # as printing runs
            assert (on_device + 1).device.type == "cuda"
        assert torch.equal((on_device + 1).cpu(), small + 1)
    with pytest.raises(RuntimeError, match="after its `with adaptmem.testing.simulated_cuda"):
        repr(on_device)  # after the block: a clear error, not CUDA's "no driver"


def test_a_tensor_requiring_grad_used_after_the_block_raises_and_the_process_lives() -> None:
    # With grad, autograd asks the real CUDA runtime for a stream before the op, and that
    # failure is a C++ std::terminate: it ran in a child, so that a regression ends only
    # the child.
    script = textwrap.dedent("""
        import torch
        from adaptmem.testing import simulated_cuda
        model = torch.nn.Linear(2, 2)
        with simulated_cuda():
            model.cuda()  # keeps the Parameter objects, giving them simulated data
            leaf = torch.ones(2, device="cuda").requires_grad_()
        for what, use in (("leaf", lambda: leaf * 2), ("parameter", lambda: model.weight.cpu()),
                          ("model", lambda: model(torch.ones(1, 2)))):
            try:
                use()
            except RuntimeError as exc:
                print(what, "raised", "after its `with adaptmem.testing" in str(exc))
        print("alive", model.weight.requires_grad)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split("\n")
    assert "leaf raised True" in lines  # the simulation's own message
    # A Parameter of torch's class meets torch without a hook of the simulation's: CUDA's
    # own error, but an error (it stopped requiring grad when the block ended).
    assert "parameter raised False" in lines and "model raised False" in lines
    assert "alive False" in lines


def test_mixing_devices_raises_cudas_error_but_cpu_scalars_are_allowed() -> None:
    with simulated_cuda(devices=2):
        a = torch.ones(3, device="cuda:0")
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            a + torch.ones(3)
        with pytest.raises(RuntimeError, match="cuda:0 and cuda:1"):
            a + torch.ones(3, device="cuda:1")
        with pytest.raises(RuntimeError, match="same device"):
            nn.Linear(3, 3)(a)
        assert (a * torch.tensor(2.0)).sum().item() == 6.0
        assert torch.equal(a[torch.tensor([0, 2])].cpu(), torch.ones(2))


def test_indexing_mixes_devices_only_where_cuda_does() -> None:
    with simulated_cuda():
        host = torch.zeros(4)
        dev = torch.zeros(4, device="cuda")
        dev_index = torch.tensor([0, 1], device="cuda")
        # Reads: a device tensor takes host or device indices; a host tensor host ones only.
        assert dev[torch.tensor([0, 1])].device.type == "cuda"
        assert dev[host == 0].shape == (4,)
        for index in (dev_index, dev == 0):
            with pytest.raises(RuntimeError, match=r"indices should be either on cpu or on the "
                               r"same device as the indexed tensor \(cpu\)"):
                host[index]
        assert host[dev_index[0]].device.type == "cpu"  # a 0-dim index selects
        # Writes through advanced indexing take a value on the written tensor's device, or
        # a 0-dim one, or one element through a mask on the device.
        with pytest.raises(RuntimeError, match="same device.*move the value"):
            dev[dev_index] = torch.tensor([5.0, 6.0])
        with pytest.raises(RuntimeError, match="same device"):
            host[torch.tensor([0, 1])] = dev[:2]
        with pytest.raises(RuntimeError, match="same device"):
            torch.ops.aten.index_put_(dev, [dev_index], torch.tensor([5.0, 6.0]))
        dev[dev_index] = torch.tensor(5.0)
        dev[dev == 0] = torch.tensor([7.0])
        host[dev_index] = torch.tensor([1.0, 2.0])  # indices move to the written tensor
        dev[2:] = torch.tensor([3.0, 4.0])  # basic indexing copies across devices
        host[2:] = dev[2:]
        assert dev.tolist() == [5.0, 5.0, 3.0, 4.0] and host.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_an_accumulating_index_put_through_a_mask_wants_the_value_on_the_device() -> None:
    # aten writes a one-element host value through a device mask as masked_fill_, but not
    # with accumulate=True: that index_put_ mixes the devices and CUDA refuses it.
    with simulated_cuda():
        dev = torch.zeros(4, device="cuda")
        with pytest.raises(RuntimeError, match="same device"):
            dev.index_put_((dev == 0,), torch.tensor([1.0]), accumulate=True)
        dev.index_put_((dev == 0,), torch.tensor([1.0]))
        dev.index_put_((dev == 1,), torch.tensor([1.0], device="cuda"), accumulate=True)
        assert dev.tolist() == [2.0] * 4


def test_masked_fill_wants_its_mask_on_the_tensors_device_even_a_0_dim_one() -> None:
    with simulated_cuda():
        scores = torch.randn(3, 4, device="cuda")
        message = ("expected self and mask to be on the same device, but got mask on cpu and "
                   "self on cuda:0")
        with pytest.raises(RuntimeError, match=message):
            scores.masked_fill(torch.tensor(True), 0.0)
        with pytest.raises(RuntimeError, match=message):
            scores.masked_fill_(torch.ones(3, 4, dtype=torch.bool), torch.tensor(1.0))
        mask = torch.ones(3, 4, dtype=torch.bool, device="cuda")
        assert scores.masked_fill(mask, torch.tensor(2.0)).sum().item() == 24.0  # a host value


@pytest.mark.parametrize("map_location", [
    None, "cuda", "cuda:0", torch.device("cuda", 0), {"cuda:0": "cuda:0"},
    lambda storage, location: storage.cuda()], ids=["none", "str", "index", "device", "dict",
                                                    "callable"])
def test_a_saved_state_dict_loads_back_onto_the_device(tmp_path: Any, map_location: Any) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "model.pt"
    with simulated_cuda():
        model.cuda()
        torch.save(model.state_dict(), path)
        before = torch.cuda.memory_allocated()
        loaded = torch.load(path, map_location=map_location)  # weights_only, torch's default
        assert all(v.device == torch.device("cuda", 0) for v in loaded.values())
        assert torch.cuda.memory_allocated() - before == 1024  # two 512-byte blocks
        model.load_state_dict(loaded)
        on_host = torch.load(path, map_location="cpu")
        assert all(torch.equal(v.cpu(), expected[k]) for k, v in loaded.items())
    # The file holds the values, readable without the simulation.
    outside = torch.load(path, map_location="cpu")
    assert all(torch.equal(outside[k], expected[k]) and torch.equal(on_host[k], expected[k])
               for k in expected)


def test_copy_and_pickle_of_a_device_tensor_give_device_tensors_as_on_cuda() -> None:
    with simulated_cuda():
        t = torch.arange(4.0, device="cuda")
        before = torch.cuda.memory_allocated()
        alias = copy.copy(t)  # on CUDA: a new tensor over the same memory
        assert alias.device == t.device and alias is not t
        alias[0] = 10.0
        assert t[0].item() == 10.0 and torch.cuda.memory_allocated() == before
        weight = nn.Parameter(torch.ones(2, device="cuda"), requires_grad=False)
        for source in (t, weight):
            restored = pickle.loads(pickle.dumps(source))
            assert restored.device == source.device and type(restored) is type(source)
            assert restored.tolist() == source.tolist()
        assert isinstance(pickle.loads(pickle.dumps(weight)), nn.Parameter)
        pickled = pickle.dumps(t)
    # The bytes say cuda:0: after the block they load as on a machine without CUDA, or onto
    # the real GPU where there is one.
    if torch.cuda.is_available():
        restored = pickle.loads(pickled)
        assert type(restored) is torch.Tensor and restored.device == torch.device("cuda", 0)
        assert restored.tolist() == [10.0, 1.0, 2.0, 3.0]
    else:
        with pytest.raises(RuntimeError, match="CUDA"):
            pickle.loads(pickled)
    with pytest.raises(RuntimeError, match="after its `with adaptmem.testing.simulated_cuda"):
        copy.copy(alias)


def test_storages_read_and_safetensors_save_as_on_cuda(tmp_path: Any) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "t.safetensors"
    with simulated_cuda():
        t = torch.arange(4.0, device="cuda")
        assert t[1:].untyped_storage().data_ptr() == t.data_ptr()
        host = t.untyped_storage().cpu()
        assert host.device.type == "cpu" and host.nbytes() == 16
        assert torch.tensor([], dtype=torch.float32).set_(host).tolist() == t.tolist()
        assert t.storage().tolist() == [0.0, 1.0, 2.0, 3.0]
        safetensors_torch.save_file({"t": t}, path)
        assert torch.equal(safetensors_torch.load_file(path, device="cuda")["t"], t)
        with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
            t.pin_memory()
    assert torch.equal(safetensors_torch.load_file(path)["t"], torch.arange(4.0))


def test_autograd_is_off_for_simulated_tensors() -> None:
    with simulated_cuda():
        layer = nn.Linear(4, 4).cuda()
        out = layer(torch.ones(2, 4, device="cuda"))  # no abort: runs under no_grad
        assert not out.requires_grad
        # Inside a Python-level torch function (its body runs with modes popped) too.
        attention = nn.MultiheadAttention(16, 2).cuda()
        q = torch.randn(3, 1, 16, device="cuda", requires_grad=True)
        assert attention(q, q, q)[0].device.type == "cuda"


def test_a_host_tensor_that_requires_grad_moves_to_the_device_without_its_graph() -> None:
    # A CPU layer's output in grad mode handed to device code (chunk's host part before a
    # residual add): recorded in autograd, a CUDA tensor made the process abort in C++
    # (no Python error at all), so this runs in a child process.
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from adaptmem import adaptive
        from adaptmem.testing import simulated_cuda

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

            def forward(self, x):
                return x + self.b(self.a(x))  # b's output meets x on the caller's device

        with simulated_cuda(devices=1, total_memory="64MiB"):
            w = torch.randn(2, 4, requires_grad=True) * 2
            moved = [w.cuda(), w.to("cuda"), w.to(device="cuda", non_blocking=True),
                     w.to("cuda", torch.float16), torch.as_tensor(w, device="cuda")]
            assert all(m.is_cuda and not m.requires_grad for m in moved)
            assert torch.equal(moved[0].cpu(), w.detach())
            assert w.to(torch.float16).requires_grad  # a host cast keeps its graph
            torch.manual_seed(0)
            model = Block().eval()
            x = torch.randn(2, 256)
            with torch.no_grad():
                want = model(x)
            chunker = adaptive.chunk(model, "cuda", capacity="300KiB")
            out = model(x)  # no no_grad, as a first try would be written
            assert torch.allclose(out, want, atol=1e-6)
            chunker.remove()
        print("done")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "done"


def test_a_device_to_device_copy_inside_a_trace_runs() -> None:
    # torchvision's batch_images pads images into a new device buffer with copy_: under an
    # "auto" trace both are device tensors holding fakes, and the copy wrote through a
    # fake's storage, a segmentation fault (so this runs in a child process).
    script = textwrap.dedent("""
        import torch
        from adaptmem import adaptive
        from adaptmem.testing import simulated_cuda

        images = torch.rand(32, 3, 20, 24)
        want = torch.zeros(32, 3, 32, 32)
        want[..., :20, :24] = images
        with simulated_cuda(devices=1, total_memory="1GiB"):
            @adaptive.batch(initial_batchsize="auto")
            def pad(batchsize, images):
                out = []
                for i in range(0, len(images), batchsize):
                    chunk = images[i:i + batchsize].cuda()
                    buf = chunk.new_zeros(chunk.shape[0], 3, 32, 32)
                    buf[..., :20, :24].copy_(chunk)
                    out.append(buf.cpu())
                return torch.cat(out)

            assert torch.equal(pad(images), want)
            assert pad.prediction is not None
        print("done")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "done"


@pytest.mark.parametrize("kind", ["plain", "causal", "mask"])
def test_scaled_dot_product_attention_gives_the_cpus_values(kind: str) -> None:
    # Its composite picks a kernel by device type, not through the dispatcher: where torch
    # has real CUDA it picked memory-efficient attention, which the host cannot run; where
    # not, the math kernel, whose values differ from the CPU's own choice.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16) for _ in range(3))
    mask = torch.rand(33, 33) > 0.3
    extra: dict[str, Any] = {"plain": {}, "causal": {"is_causal": True},
                             "mask": {"attn_mask": mask}}[kind]
    expected = F.scaled_dot_product_attention(q, k, v, **extra)
    with simulated_cuda():
        on_device = {name: t.cuda() if isinstance(t, torch.Tensor) else t
                     for name, t in extra.items()}
        q, k, v = q.cuda(), k.cuda(), v.cuda()
        before = torch.cuda.memory_allocated()
        out = F.scaled_dot_product_attention(q, k, v, **on_device)
        assert out.device.type == "cuda"
        assert torch.cuda.memory_allocated() == before + out.nbytes  # 33 blocks of 512 bytes
        assert torch.equal(out.cpu(), expected)
        with pytest.raises(RuntimeError, match="cpu"):  # a host mask, as CUDA refuses it
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# -- memory ----------------------------------------------------------------------------------

def test_allocations_are_counted_freed_and_cached() -> None:
    with simulated_cuda(total_memory="1GiB"):
        assert torch.cuda.memory_allocated() == 0
        a = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(1000, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_allocated() == 4 * MiB + 1024  # blocks of 512 bytes
        view = a[:10]
        del a
        assert torch.cuda.memory_allocated() == 4 * MiB + 1024  # the view keeps it
        del view
        assert torch.cuda.memory_allocated() == 1024
        assert torch.cuda.max_memory_allocated() == 4 * MiB + 1024
        reserved = torch.cuda.memory_reserved()
        assert reserved >= 4 * MiB + 1024  # freed blocks stay reserved
        free, total = torch.cuda.mem_get_info()
        assert total == 1024**3 and free == total - reserved
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() < reserved
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == 1024
        del b


def test_resizing_writes_give_the_tensor_its_new_shape_and_memory() -> None:
    with simulated_cuda():
        y = torch.arange(6.0, device="cuda")
        out = torch.empty(0, device="cuda")
        assert torch.add(y, 1, out=out) is out
        assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        values = torch.empty(0, device="cuda")
        indices = torch.empty(0, dtype=torch.long, device="cuda")
        torch.sort(y.flip(0), out=(values, indices))
        assert values.tolist() == y.tolist() and indices.tolist() == [5, 4, 3, 2, 1, 0]
        before = torch.cuda.memory_allocated()
        grown = torch.empty(0, device="cuda").resize_(1000)
        assert grown.shape == (1000,) and grown.device.type == "cuda"
        assert torch.cuda.memory_allocated() - before == 4096  # 4000 bytes in 512-byte blocks
        del grown
        assert torch.cuda.memory_allocated() == before
        q = torch.ones(4, device="cuda")
        q.set_(y)  # q is y's memory now; its own block is freed
        assert q.shape == (6,) and torch.cuda.memory_allocated() == before
        q[0] = 100.0
        assert y[0].item() == 100.0


def test_a_resize_past_the_limit_fails_before_the_op_writes_anything() -> None:
    with simulated_cuda(total_memory="8MiB"):
        a = torch.ones(1 << 20, device="cuda")  # 4 MiB
        w = torch.full((4,), 7.0, device="cuda")
        before = torch.cuda.memory_allocated()
        with pytest.raises(torch.OutOfMemoryError):
            torch.mul(a, 2, out=w)
        assert w.tolist() == [7.0] * 4 and torch.cuda.memory_allocated() == before
        with pytest.raises(torch.OutOfMemoryError):
            w.resize_(1 << 21)
        assert w.shape == (4,) and torch.cuda.memory_allocated() == before
        # Its memory did not grow behind the count: growing it now takes a block of the
        # new size (1000 floats in 512-byte blocks) in place of the old one.
        view = w[:2]
        w.resize_(1000)
        assert torch.cuda.memory_allocated() - before == 4096 - 512
        # On CUDA the storage the view shares was reallocated: the old block is gone.
        view[0] = 3.0
        assert w[0].item() == 3.0 and w[2].item() == 7.0
        del view
        assert torch.cuda.memory_allocated() - before == 4096 - 512
        torch.mul(a[:2000], 2, out=w.resize_(0))  # a growth that fits
        assert w.shape == (2000,) and w[1999].item() == 2.0
        assert torch.cuda.memory_allocated() - before == 8192 - 512


def test_an_allocation_past_the_limit_raises_cudas_oom_and_allocates_nothing() -> None:
    with simulated_cuda(total_memory="1GiB"):
        keep = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.set_per_process_memory_fraction(0.5)
        assert torch.cuda.get_per_process_memory_fraction() == 0.5
        before = torch.cuda.memory_allocated()
        with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory\. Tried to "
                           r"allocate 300\.00 MiB"):
            torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(300 * MiB, dtype=torch.uint8).to("cuda")
        host = torch.empty(300 * MiB, dtype=torch.uint8)  # never touched: costs no memory
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty_like(host, device="cuda")  # how a pager makes each device copy
        with pytest.raises(torch.OutOfMemoryError):
            torch.full((300 * MiB,), 7, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            keep + keep
        assert torch.cuda.memory_allocated() == before
        torch.cuda.set_per_process_memory_fraction(1.0)
        assert (keep + keep).numel() == 300 * MiB


def test_the_memory_fraction_wants_a_device_index_as_torch_does() -> None:
    # On a real GPU torch refuses torch.device("cuda") here (an H200 run found two callers
    # the simulation had let through).
    with simulated_cuda(devices=2):
        for call in (lambda d: torch.cuda.set_per_process_memory_fraction(0.5, d),
                     torch.cuda.get_per_process_memory_fraction):
            with pytest.raises(ValueError, match="with a specified index or an integer"):
                call(torch.device("cuda"))
            with pytest.raises(ValueError, match="with a specified index or an integer"):
                call("cuda")
        torch.cuda.set_per_process_memory_fraction(0.25, "cuda:1")
        torch.cuda.set_per_process_memory_fraction(0.5, 0)
        assert torch.cuda.get_per_process_memory_fraction(torch.device("cuda", 1)) == 0.25
        assert torch.cuda.get_per_process_memory_fraction() == 0.5


# -- streams and events ----------------------------------------------------------------------

def _copy_on_a_side_stream(host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Stream]:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dev = torch.empty_like(host, device="cuda")
        dev.copy_(host, non_blocking=True)
    return dev, side


def test_a_freed_blocks_memory_serves_the_next_copy_of_its_size_until_empty_cache() -> None:
    # See [Note: the host memory of cached blocks]: the address comes back, as the caching
    # allocator hands it back on a GPU, and the new copy's values are its own.
    with simulated_cuda(total_memory="1GiB"):
        first = torch.empty_like(torch.ones(MiB // 4), device="cuda").copy_(torch.ones(MiB // 4))
        address = first.data_ptr()
        del first
        second = torch.empty_like(torch.ones(MiB // 4), device="cuda")
        assert second.data_ptr() == address
        second.copy_(torch.full((MiB // 4,), 2.0).pin_memory(), non_blocking=True)
        torch.cuda.synchronize()
        assert second.eq(2).all().item()
        assert torch.cuda.memory_allocated() == MiB
        view = second[:10]
        del second  # the view holds the block: nothing is freed
        other = torch.empty_like(torch.ones(MiB // 4), device="cuda")
        assert other.data_ptr() != address and view.eq(2).all().item()
        del view, other
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 0


@pytest.mark.parametrize("non_blocking", [False, True])
def test_copy_into_a_device_tensor_bumps_its_version_as_torch_does(non_blocking: bool) -> None:
    with simulated_cuda():
        host = torch.arange(6.0).pin_memory()
        dev = torch.zeros(6, device="cuda")
        before = dev._version
        dev.copy_(host, non_blocking=non_blocking)
        torch.cuda.synchronize()
        assert dev._version == before + 1
        assert dev.cpu().tolist() == host.tolist()
        back = torch.zeros(6)
        back.copy_(dev)
        assert back._version == 1 and back.tolist() == host.tolist()


def _writes_through_views(device: str) -> list[int]:
    """The version of a tensor after each of three writes through a view of it."""
    base = torch.zeros(4, 3, device=device)
    versions = [base._version]
    base[:2] = 1.0
    versions.append(base._version)
    base[:2].copy_(torch.full((2, 3), 2.0, device=device))
    versions.append(base._version)
    base.view(-1)[0] = 3.0
    versions.append(base._version)
    return versions


def test_a_write_through_a_view_bumps_the_base_version_as_torch_does() -> None:
    expected = _writes_through_views("cpu")
    assert expected == [0, 1, 2, 3]
    with simulated_cuda():
        assert _writes_through_views("cuda") == expected


def _writes_into_views(device: str) -> tuple[list[list[float]], list[int]]:
    """A tensor's values and version, and its view's, after writes through views of it."""
    with torch.no_grad():
        base = torch.zeros(4, 3, device=device)
        view = base[1:3]
        assert view._base is base and view.device == base.device
        view.add_(1)
        base.t()[0].mul_(5)
        base[None, ..., 2].sub_(1)
        base[torch.tensor([0, 3], device=device)] = 9.0  # advanced indexing writes in place
        picked = base[[1, 2]]  # and reads into a copy
        picked.add_(100)
        assert not picked._is_view()
        return base.cpu().tolist(), [base._version, view._version]


def test_writes_through_views_reach_the_base_values_and_version() -> None:
    expected = _writes_into_views("cpu")
    assert expected == ([[9.0, 9.0, 9.0], [5.0, 1.0, 0.0], [5.0, 1.0, 0.0], [9.0, 9.0, 9.0]],
                        [4, 4])
    with simulated_cuda():
        assert _writes_into_views("cuda") == expected


def _in_place_view_ops(device: str) -> list[Any]:
    """What in-place view ops (aten's ``inplace_view``) do to a tensor and a view of it."""
    seen: list[Any] = []
    for op in (lambda t: t.transpose_(0, 1), lambda t: t.t_(), lambda t: t.unsqueeze_(1),
               lambda t: t.unsqueeze_(0).squeeze_(0), lambda t: t.swapdims_(0, 1),
               lambda t: t.as_strided_((3, 2), (1, 3))):
        x = torch.arange(6.0, device=device).reshape(2, 3)
        view = x[:, 1:]
        assert op(x) is x
        x.mul_(2)  # through the new shape, into the same memory
        seen.append((tuple(x.shape), x.stride(), x.cpu().tolist(), view.cpu().tolist(),
                     x.is_contiguous()))
    return seen


def test_in_place_view_ops_give_the_tensor_its_new_shape_as_on_cuda() -> None:
    # transpose_ (which nn.GRU and nn.RNN use for batch_first outputs), unsqueeze_ and the
    # rest changed only the backing: the tensor kept its old shape over reordered values.
    expected = _in_place_view_ops("cpu")
    with simulated_cuda():
        assert _in_place_view_ops("cuda") == expected
        assert torch.cuda.memory_allocated() == 0


def _inference_mode_views(device: str) -> list[Any]:
    """What torch says of views and in-place writes in and out of inference mode."""
    seen: list[Any] = []
    normal = torch.ones(2, 4, device=device)
    with torch.inference_mode():
        for view in (normal.t(), normal.view(-1), normal[:1], normal.expand(3, 2, 4)):
            seen.append((view.is_inference(), view._is_view(), view._base is normal))
        seen.append((normal + 1).is_inference())
        normal[:1] = 2.0
        seen.append(normal._version)
        made = torch.ones(2, 4, device=device)
        for view in (made.t(), made[:1]):
            seen.append((view.is_inference(), view._is_view()))
        made[0] = 3.0
        made.t().add_(1)
        seen.append(made.sum().item())
    seen += [made.t().is_inference(), (made + 1).is_inference()]
    for write in (lambda: made.add_(1), lambda: made.__setitem__(0, 1.0),
                  lambda: made[:1].copy_(torch.ones(1, 4, device=device))):
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            write()
    return seen


def test_views_in_inference_mode_are_what_torch_makes_on_the_cpu() -> None:
    # A view of a normal tensor is a normal tensor sharing its version, a view of an
    # inference tensor an inference tensor, in inference mode or out of it.
    expected = _inference_mode_views("cpu")
    with simulated_cuda():
        assert _inference_mode_views("cuda") == expected


def test_a_vision_transformer_runs_in_inference_mode_and_matches_the_cpu() -> None:
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
        mlp_dim=64).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        expected = model(x)
    with simulated_cuda():
        model.cuda()  # normal tensors, viewed and expanded in the forward
        with torch.inference_mode():
            out = model(x.cuda())
        assert out.device.type == "cuda" and out.is_inference()
        out = out.cpu()
        model.cpu()
    torch.testing.assert_close(out, expected)


def test_a_read_on_a_stream_that_did_not_wait_for_the_copy_raises() -> None:
    with simulated_cuda(bandwidth=1):
        host = torch.ones(MiB // 4).pin_memory()
        dev, side = _copy_on_a_side_stream(host)
        # torch.cuda.current_stream().wait_stream(side) deliberately missing
        with pytest.raises(StreamRaceError, match="read before its copy completed"):
            dev.sum()
        torch.cuda.synchronize()


def test_views_of_a_tensor_a_copy_still_writes_are_no_read_but_reading_them_is() -> None:
    with simulated_cuda(bandwidth=1):
        host = torch.randn(MiB // 4).pin_memory()
        dev, side = _copy_on_a_side_stream(host)
        # Views read nothing on a GPU: no race to take them before the wait.
        first, second = dev.split([MiB // 8, MiB // 8])
        head, row, grid = dev[:4], dev[3], dev.view(256, -1)
        narrow, chunks = dev.narrow(0, 8, 8), dev.chunk(4)
        with pytest.raises(StreamRaceError, match="read before its copy completed"):
            (head * 2).sum()  # reading one is
        with pytest.raises(StreamRaceError, match="read before its copy completed"):
            dev[torch.tensor([0, 1], device="cuda")]  # and so is gathering by index
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(head.cpu(), host[:4]) and torch.equal(second.cpu(), host[MiB // 8:])
        assert torch.equal(row.cpu(), host[3]) and torch.equal(grid.cpu(), host.view(256, -1))
        assert torch.equal(narrow.cpu(), host[8:16]) and torch.equal(chunks[3].cpu(),
                                                                      host.chunk(4)[3])
        assert torch.equal(first.cpu(), host[:MiB // 8])


def test_with_stream_makes_it_current_as_torch_cuda_stream_does() -> None:
    with simulated_cuda(devices=2, bandwidth=1):
        side = torch.cuda.Stream(device=1)
        with side as entered:
            assert entered is side
            assert torch.cuda.current_stream(1) is side and torch.cuda.current_device() == 1
        assert torch.cuda.current_stream(1) is torch.cuda.default_stream(1)
        assert torch.cuda.current_device() == 0
        # A copy issued inside `with side:` runs on it, so a read without a wait races.
        host = torch.ones(MiB // 4).pin_memory()
        with torch.cuda.Stream():
            dev = host.to("cuda", non_blocking=True)
        with pytest.raises(StreamRaceError, match="read before its copy completed"):
            dev.sum()
        torch.cuda.synchronize()


def test_streams_made_through_torch_stream_and_external_stream_are_simulated() -> None:
    real_stream = torch.Stream
    with simulated_cuda():
        side = torch.Stream("cuda")
        assert isinstance(side, torch.cuda.Stream) and side.device == torch.device("cuda", 0)
        assert isinstance(side, torch.Stream) and isinstance(torch.Stream("cpu"), torch.Stream)
        assert torch.cuda.ExternalStream(0) is torch.cuda.default_stream()
        assert torch.cuda.ExternalStream(side.cuda_stream) is side
        with pytest.raises(ValueError, match="no stream with that cuda_stream"):
            torch.cuda.ExternalStream(side.cuda_stream + 1000)
    assert torch.Stream is real_stream


def test_writing_a_pinned_source_before_its_copy_completed_raises() -> None:
    with simulated_cuda(bandwidth=0.1):  # 4 MB at 0.1 GB/s: 40 ms
        host = torch.ones(10**6).pin_memory()
        dev = host.to("cuda", non_blocking=True)
        with pytest.raises(StreamRaceError, match="still reads it"):
            host.fill_(5)
        with pytest.raises(StreamRaceError, match="still reads it"):
            host[:3] = 2.0
        host.sum()  # reading it is fine
        torch.cuda.current_stream().synchronize()
        host.fill_(5)
        assert dev[:2].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("how", ["to", "copy_"])
def test_using_the_pinned_destination_of_a_copy_from_the_device_before_it_landed_raises(
        how: str) -> None:
    # On a GPU a non_blocking copy to pinned host memory returns before the bytes land: the
    # host reads old values until it synchronizes. It used to land at once here.
    with simulated_cuda(bandwidth=0.1):  # 4 MB at 0.1 GB/s: 40 ms
        dev = torch.ones(10**6, device="cuda")
        if how == "to":
            host = dev.to("cpu", non_blocking=True)
            assert host.is_pinned()  # as CUDA's: pinned, so that it can land later
        else:
            host = torch.zeros(10**6).pin_memory()
            host.copy_(dev, non_blocking=True)
        with pytest.raises(StreamRaceError, match="still writes it"):
            host.sum()  # a read
        with pytest.raises(StreamRaceError, match="still writes it"):
            host.fill_(2)  # a write
        with pytest.raises(StreamRaceError, match="still writes it"):
            host.to("cuda")  # a copy back to the device
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        assert float(host.sum()) == 10**6
        # A copy into pageable memory is synchronous, as on CUDA: usable at once.
        pageable = torch.zeros(10**6)
        pageable.copy_(dev, non_blocking=True)
        assert float(pageable.sum()) == 10**6


def test_writing_a_pinned_parameter_or_list_or_second_output_in_flight_raises() -> None:
    # 256 KiB at 1 MB/s: 262 ms. At 26 ms it failed in a run of 16 workers on an H200 host
    # (no race seen): most likely the copy completed before the busy host reached the write.
    with simulated_cuda(bandwidth=0.001):
        weight = nn.Parameter(torch.ones(1 << 16).pin_memory(), requires_grad=False)
        order = torch.arange(1 << 16).pin_memory()
        weight.to("cuda", non_blocking=True)
        order.to("cuda", non_blocking=True)
        with pytest.raises(StreamRaceError, match="still reads it"):
            weight.add_(1)
        with pytest.raises(StreamRaceError, match="still reads it"):
            torch._foreach_add_([torch.zeros(2), weight], 1)
        with pytest.raises(StreamRaceError, match="still reads it"):
            torch.sort(torch.ones(1 << 16), out=(torch.empty(0), order))
        torch.cuda.synchronize()
        weight.add_(1)


def test_pinned_bytes_count_torchs_blocks_rounded_and_registered_memory_as_it_is() -> None:
    with simulated_cuda() as sim:
        assert sim.pinned_bytes == 0
        block = torch.empty(3 * 2**20 + 1, dtype=torch.uint8, pin_memory=True)
        assert sim.pinned_bytes == 4 * 2**20  # CUDA's host allocator rounds to 2**k
        memory = mmap.mmap(-1, 3 * 2**20)
        address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        assert torch.cuda.cudart().cudaHostRegister(address, len(memory), 0) == 0
        assert sim.pinned_bytes == 7 * 2**20
        del block
        assert sim.pinned_bytes == 3 * 2**20
        assert torch.cuda.cudart().cudaHostUnregister(address) == 0
        assert sim.pinned_bytes == 0
    memory.close()
    assert sim.pinned_bytes == 0


def test_registered_host_memory_is_pinned_and_its_copies_are_checked() -> None:
    memory = mmap.mmap(-1, 1 << 20)
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    with pytest.raises(SimulatedCudaError, match="unregistered while a non_blocking copy"):
        with simulated_cuda(bandwidth=0.01):  # 1 MiB at 10 MB/s: 100 ms
            cudart = torch.cuda.cudart()
            host = torch.frombuffer(memory, dtype=torch.float32)
            assert not host.is_pinned()
            assert cudart.cudaHostRegister(address, len(memory), 0) == 0
            assert host.is_pinned() and host[1000:].is_pinned()
            assert cudart.cudaHostRegister(address + 4096, 4096, 0) == 712  # registered already
            assert cudart.cudaHostUnregister(address + 4096) == 713  # not where one starts
            assert cudart.cudaGetLastError() == 713  # kept for the thread until asked for
            assert cudart.cudaGetLastError() == 0
            host.fill_(1.0)
            dev = host.to("cuda", non_blocking=True)
            with pytest.raises(StreamRaceError, match="still reads it"):
                host.fill_(2.0)
            assert cudart.cudaHostUnregister(address) == 0  # reported: the copy still reads
            torch.cuda.synchronize()
            assert float(dev.sum()) == 2**18
            del host
    memory.close()


def test_a_failed_runtime_calls_error_left_pending_is_reported() -> None:
    # CUDA's runtime keeps a failed call's error for the thread, and torch's next kernel
    # launch raises it as its own: code that calls the runtime itself must clear it.
    with pytest.raises(SimulatedCudaError, match="failed with error 713 and left it pending"):
        with simulated_cuda():
            assert torch.cuda.cudart().cudaHostUnregister(4096) == 713


def test_a_host_tensor_at_a_freed_pinned_sources_address_may_be_written() -> None:
    # On a GPU pageable memory never takes a pinned block's address, and the caching host
    # allocator holds the block until its copy completes.
    with simulated_cuda(bandwidth=0.01) as sim:  # 256 KiB at 10 MB/s: 26 ms
        for _ in range(5):
            pinned = torch.ones(1 << 16).pin_memory()
            dev = pinned.to("cuda", non_blocking=True)
            del pinned
            # malloc hands the freed address to one of these as a rule: writing it is no
            # race.
            made = [torch.empty(1 << 16) for _ in range(4)]
            for x in made:
                x.fill_(2.0)
        assert dev[:2].tolist() == [1.0, 1.0]
        host = torch.ones(1 << 16).pin_memory()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            host.to("cuda", non_blocking=True)
        assert sim._state.host_reads
        side.synchronize()  # ordinary host ops stop checking for writes to pinned sources
        assert not sim._state.host_reads
        host.to("cuda", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        assert not sim._state.host_reads


def test_a_read_after_wait_stream_sees_the_copied_values() -> None:
    with simulated_cuda(bandwidth=1):  # 1 MiB at 1 GB/s: about a millisecond
        host = torch.ones(MiB // 4).pin_memory()
        dev, side = _copy_on_a_side_stream(host)
        torch.cuda.current_stream().wait_stream(side)
        dev.record_stream(torch.cuda.current_stream())
        assert dev.sum().item() == MiB // 4


def test_non_blocking_copies_complete_later_and_events_time_them() -> None:
    with simulated_cuda(bandwidth=0.5):  # 20 MB at 0.5 GB/s: 40 ms
        host = torch.ones(5 * 10**6).pin_memory()
        side = torch.cuda.Stream()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            dev = torch.empty_like(host, device="cuda").copy_(host, non_blocking=True)
            end.record()
        assert not end.query()  # still copying: the host went on
        with pytest.raises(RuntimeError, match="must be completed"):
            start.elapsed_time(end)
        end.synchronize()
        assert end.query() and side.query()
        assert 30 < start.elapsed_time(end) < 2000
        assert dev.sum().item() == 5 * 10**6  # the host synchronized: any stream may read


def test_a_copy_in_flight_completes_on_the_links_time_while_the_host_runs_python() -> None:
    threads = threading.active_count()
    with simulated_cuda(bandwidth=0.1) as sim:  # 20 MB at 0.1 GB/s: 200 ms
        host = torch.ones(5 * 10**6).pin_memory()
        side = torch.cuda.Stream()
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            dev = torch.empty_like(host, device="cuda").copy_(host, non_blocking=True)
            end.record()
        issued = time.perf_counter()
        assert not end.query()
        assert threading.active_count() == threads  # no thread of its own to fight for the GIL
        while time.perf_counter() - issued < 0.25:  # Python-heavy host work, holding the GIL
            sum(range(1000))
        assert end.query()  # done meanwhile: the host never waited for it
        torch.cuda.current_stream().wait_event(end)
        assert dev[0].item() == 1.0
        assert sim.copy_stats["copies"] == 1 and sim.copy_stats["wait_seconds"] == 0


def test_copies_on_one_stream_take_turns_on_the_link() -> None:
    with simulated_cuda(bandwidth=0.1) as sim:  # 10 MB at 0.1 GB/s: 100 ms each
        host = torch.ones(25 * 10**5).pin_memory()
        side = torch.cuda.Stream()
        first, second = torch.cuda.Event(), torch.cuda.Event()
        started = time.perf_counter()
        with torch.cuda.stream(side):
            torch.empty_like(host, device="cuda").copy_(host, non_blocking=True)
            first.record()
            torch.empty_like(host, device="cuda").copy_(host, non_blocking=True)
            second.record()
        first.synchronize()
        assert not second.query()  # still behind the first one
        second.synchronize()
        assert time.perf_counter() - started >= 0.2
        stats = sim.copy_stats
        assert stats["copies"] == 2 and 0 < stats["wait_seconds"] <= time.perf_counter() - started


def test_refilling_a_buffer_on_its_own_stream_does_not_hold_the_host() -> None:
    with simulated_cuda(bandwidth=0.005):  # 1 MB at 0.005 GB/s: 200 ms each
        first, second = torch.ones(25 * 10**4).pin_memory(), torch.full((25 * 10**4,), 2.0)
        second = second.pin_memory()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            buffer = torch.empty_like(first, device="cuda").copy_(first, non_blocking=True)
            issued = time.perf_counter()
            buffer.copy_(second, non_blocking=True)  # queued behind the first on the stream
            assert time.perf_counter() - issued < 0.1
        assert not side.query()
        torch.cuda.current_stream().wait_stream(side)
        assert buffer.sum().item() == 2 * 25 * 10**4
        assert time.perf_counter() - issued >= 0.39  # both took their turn on the link


def test_ops_returning_several_tensors_give_them_on_the_device() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    with simulated_cuda():
        d = x.cuda()
        top = torch.max(d, dim=0)  # a torch.return_types named tuple
        parts = torch.split(d, 2)  # a tuple of views
        var, mean = torch.var_mean(d, dim=1)
        assert all(t.device.type == "cuda" for t in (top.values, top.indices, *parts, mean, var))
        assert torch.equal(top.values.cpu(), x.max(dim=0).values)
        assert torch.equal(top.indices.cpu(), x.max(dim=0).indices)
        assert [p.cpu().tolist() for p in parts] == [p.tolist() for p in torch.split(x, 2)]
        assert torch.allclose(var.cpu(), torch.var_mean(x, dim=1)[0])


def test_non_blocking_from_pageable_memory_is_a_copy_on_its_stream() -> None:
    # PyTorch issues cudaMemcpyAsync for it: the bytes are staged before the call returns
    # (the source may be written at once), but the copy runs on the stream.
    with simulated_cuda(bandwidth=0.001):
        host = torch.ones(1000)
        assert not host.is_pinned() and host.pin_memory().is_pinned()
        dev, side = _copy_on_a_side_stream(host)
        host.fill_(2.0)  # staged: no race
        with pytest.raises(StreamRaceError, match="read before its copy completed"):
            dev.sum()
        torch.cuda.current_stream().wait_stream(side)
        assert dev.sum().item() == 1000
        moved = torch.ones(1000).cuda(non_blocking=True)  # on the current stream: no wait
        assert moved.sum().item() == 1000


@pytest.mark.parametrize("make", [
    lambda x: torch.empty_like(x, device="cpu"),
    lambda x: torch.zeros_like(x, device="cpu"),
    lambda x: torch.full_like(x, 2.0, device="cpu"),
    lambda x: x.new_zeros(5, device="cpu"),
    lambda x: x.new_empty(5, device=torch.device("cpu")),
], ids=["empty_like", "zeros_like", "full_like", "new_zeros", "new_empty"])
def test_host_tensors_made_from_a_device_tensor_are_on_the_host(make: Any) -> None:
    with simulated_cuda():
        x = torch.ones(3, device="cuda")
        held = torch.cuda.memory_allocated()
        out = make(x)
        assert out.device.type == "cpu" and type(out) is torch.Tensor
        assert torch.cuda.memory_allocated() == held
        out + torch.ones(()).expand_as(out)  # a host tensor mixes with host tensors


@pytest.mark.parametrize("grad_mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
def test_assigning_data_across_host_and_device_moves_the_tensor(grad_mode: Any) -> None:
    # What a pager does to a parameter: its data goes to a host master and back to a
    # device copy, the parameter object staying the same, in any grad mode.
    with simulated_cuda():
        param = nn.Parameter(torch.ones(3, device="cuda"), requires_grad=False)
        param.marked = True  # type: ignore[attr-defined]
        host = torch.full((3,), 2.0)
        device = torch.full((3,), 5.0, device="cuda")
        with grad_mode():
            param.data = host
            assert isinstance(param, nn.Parameter) and param.device.type == "cpu"
            assert param.data_ptr() == host.data_ptr() and param.sum().item() == 6.0
            param.data = device
            assert isinstance(param, nn.Parameter) and param.device == torch.device("cuda", 0)
            assert param.sum().item() == 15.0
        assert param.marked  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["cuda", "cpu", "meta"])
def test_a_parameter_remade_with_its_own_class_is_a_parameter_again(where: str) -> None:
    # ``type(param)(data, requires_grad=...)`` is how accelerate, transformers and
    # bitsandbytes re-make a parameter; on CUDA ``type(param)`` is nn.Parameter.
    with simulated_cuda():
        param = nn.Parameter(torch.ones(2, 3).to("cuda"))  # as accelerate makes them
        for _ in range(3):  # the result is re-made in turn, as on each offloaded forward
            data = torch.full((2, 3), 2.0).to(where)
            remade = type(param)(data, requires_grad=False)
            assert isinstance(remade, nn.Parameter) and not remade.requires_grad
            assert remade.device == data.device and remade.shape == (2, 3)
            if where != "meta":
                assert remade.sum().item() == 12.0
            if where != "cuda":
                assert type(remade) is nn.Parameter  # a host or meta one is a plain one
            assert type(type(remade)(data)) is type(remade) and type(remade)(data).requires_grad
            param = remade


def test_a_parameter_whose_data_went_to_the_host_is_remade_on_the_host() -> None:
    with simulated_cuda():
        param = nn.Parameter(torch.ones(3).to("cuda"), requires_grad=False)
        host = torch.full((3,), 2.0)
        param.data = host  # what a pager does to release a weight
        remade = type(param)(param, requires_grad=False)
        assert type(remade) is nn.Parameter and remade.device.type == "cpu"
        assert remade.data_ptr() == host.data_ptr() and remade.sum().item() == 6.0


@pytest.mark.parametrize("to_device", [True, False], ids=["host-to-device", "device-to-host"])
@pytest.mark.parametrize("how", ["to", "cuda-or-cpu", "copy_"])
def test_synchronous_copies_over_the_link_take_its_time(to_device: bool, how: str) -> None:
    # A benchmark comparing a pager that copies asynchronously with one that calls
    # .to("cuda") is only fair when both pay for the link: 4 MB at 0.02 GB/s is 200 ms, far
    # more than moving 4 MB on the host takes even on a loaded machine, so the host sleeps.
    with simulated_cuda(bandwidth=0.02) as sim:
        source = torch.ones(10**6) if to_device else torch.ones(10**6, device="cuda")
        target = "cuda" if to_device else "cpu"
        dest = torch.empty_like(source, device=target)
        started = time.perf_counter()
        if how == "to":
            out = source.to(target)
        elif how == "cuda-or-cpu":
            out = source.cuda() if to_device else source.cpu()
        else:
            out = dest.copy_(source)
        took = time.perf_counter() - started
        assert took >= 0.2
        assert out.device.type == target
        assert 0 < sim.copy_stats["wait_seconds"] <= took  # the host slept on the link and out.sum().item() == 10**6


def test_copies_on_the_device_do_not_use_the_link() -> None:
    with simulated_cuda(bandwidth=0.001):  # 4 MB over this link would take 4 s
        dev = torch.ones(10**6, device="cuda")
        started = time.perf_counter()
        assert dev.clone().to("cuda").sum().item() == 10**6
        assert time.perf_counter() - started < 2


@pytest.mark.parametrize("workers", [0, 1])
def test_pin_memory_loaders_give_pinned_batches(workers: int) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(8.0).reshape(4, 2))
    with simulated_cuda():
        loader = DataLoader(data, batch_size=2, pin_memory=True, num_workers=workers)
        batches = [b for (b,) in loader]
        assert all(b.is_pinned() for b in batches)
        assert torch.equal(torch.cat([b.cuda(non_blocking=True) for b in batches]).cpu(),
                           data.tensors[0])


def test_freeing_a_tensor_another_stream_used_without_record_stream_is_reported() -> None:
    with pytest.raises(SimulatedCudaError, match="without tensor.record_stream"), \
            simulated_cuda() as sim:
        host = torch.ones(1000).pin_memory()
        dev, side = _copy_on_a_side_stream(host)
        torch.cuda.current_stream().wait_stream(side)
        dev.sum()  # used on the compute stream, allocated on the side stream
        del dev
        assert sim.problems


def test_host_only_and_device_only_calls_are_refused_as_on_cuda() -> None:
    np = pytest.importorskip("numpy")
    with simulated_cuda():
        t = torch.arange(4.0, device="cuda")
        with pytest.raises(NotImplementedError, match="aten::record_stream.*'CPU' backend"):
            torch.ones(2).record_stream(torch.cuda.Stream())
        message = "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu()"
        with pytest.raises(TypeError, match=message):
            t.numpy()
        with pytest.raises(TypeError, match=message):
            np.asarray(t)
        assert t.cpu().numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
        # CUDA copies to the host with non_blocking=True into pinned memory.
        host = t.to("cpu", non_blocking=True)
        assert host.is_pinned() and host.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert not t.to("cpu").is_pinned()


def test_record_stream_makes_that_free_safe() -> None:
    with simulated_cuda() as sim:
        host = torch.ones(1000).pin_memory()
        dev, side = _copy_on_a_side_stream(host)
        torch.cuda.current_stream().wait_stream(side)
        dev.record_stream(torch.cuda.current_stream())
        dev.sum()
        del dev
    assert sim.problems == []



@pytest.mark.parametrize("wait", ["wait_event", "wait_stream"])
def test_a_free_after_the_allocating_stream_waited_for_the_user_is_safe(wait: str) -> None:
    # Reuse on the allocating stream is ordered after the work it waited for, as on a GPU.
    with simulated_cuda(total_memory="256MiB") as sim:
        side = torch.cuda.Stream()
        x = torch.randn(1 << 20, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
            event = side.record_event()
        if wait == "wait_event":
            torch.cuda.current_stream().wait_event(event)
        else:
            torch.cuda.current_stream().wait_stream(side)
        del x
        z = y + 1
    assert sim.problems == [] and z.device.type == "cuda"


def test_a_free_is_reported_when_the_user_went_on_after_the_wait() -> None:
    with pytest.raises(SimulatedCudaError, match="nor waited for by"), simulated_cuda():
        side = torch.cuda.Stream()
        x = torch.ones(1000, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            event = side.record_event()
            x * 2  # after the event: the wait does not cover it
        torch.cuda.current_stream().wait_event(event)
        del x


@pytest.mark.parametrize("read", ["item", "cpu", "tolist", "copy_"])
def test_a_blocking_read_to_the_host_synchronizes_its_stream(read: str) -> None:
    # On a GPU the host waits for all the work queued on the stream before the read.
    def host_read(t: torch.Tensor) -> None:
        if read == "item":
            t.sum().item()
        elif read == "cpu":
            t.cpu()
        elif read == "tolist":
            t[:4].tolist()
        else:
            torch.empty(t.shape).copy_(t)

    with simulated_cuda(bandwidth=1) as sim:  # the free after a read on the compute stream
        side, host = torch.cuda.Stream(), torch.ones(1 << 18).pin_memory()
        with torch.cuda.stream(side):
            d = host.to("cuda", non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
        host_read(d * 2)
        del d
    assert sim.problems == []
    with simulated_cuda(bandwidth=1):  # another stream's read after one on the copy's stream
        side, host = torch.cuda.Stream(), torch.ones(1 << 18).pin_memory()
        with torch.cuda.stream(side):
            d = host.to("cuda", non_blocking=True)
            host_read(d)
        assert (d * 2).sum().item() == 2 * (1 << 18)


@pytest.mark.parametrize("poll", ["event", "stream"])
def test_polling_query_until_true_counts_as_a_synchronize(poll: str) -> None:
    with simulated_cuda(bandwidth=1):
        side = torch.cuda.Stream()
        host = torch.ones(1 << 18).pin_memory()
        with torch.cuda.stream(side):
            d = host.to("cuda", non_blocking=True)
            event = side.record_event()
        done = event if poll == "event" else side
        while not done.query():
            time.sleep(0.001)
        assert (d * 2).sum().item() == 2 * (1 << 18)  # the host saw the copy complete
        host.fill_(3.0)  # and its source may be written



@pytest.mark.parametrize("waits", [False, True], ids=["no-wait", "wait_stream"])
def test_refilling_a_buffer_another_stream_still_reads_needs_a_wait(waits: bool) -> None:
    # Double buffering: the side stream's copy may overwrite the buffer while the compute
    # stream still reads it, unless the side stream waited for that read.
    with simulated_cuda(total_memory="256MiB", bandwidth=1):
        side = torch.cuda.Stream()
        buffer = torch.empty(1 << 18, device="cuda")
        hosts = [torch.full((1 << 18,), float(i)).pin_memory() for i in range(3)]
        outs = []
        for i, host in enumerate(hosts):
            if waits:
                side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                if i and not waits:
                    with pytest.raises(StreamRaceError, match="did not wait for that use"):
                        buffer.copy_(host, non_blocking=True)
                    return
                buffer.copy_(host, non_blocking=True)
                event = side.record_event()
            torch.cuda.current_stream().wait_event(event)
            outs.append(buffer * 2)
        assert [o[0].item() for o in outs] == [0.0, 2.0, 4.0]



def test_the_allocators_history_is_refused_with_a_simulated_cuda_error() -> None:
    with simulated_cuda():
        with pytest.raises(SimulatedCudaError, match="_record_memory_history is not simulated"):
            torch.cuda.memory._record_memory_history(max_entries=1000)
        torch.cuda.memory._record_memory_history(enabled=None)  # off: nothing to refuse
        with pytest.raises(SimulatedCudaError, match="memory_snapshot is not simulated"):
            torch.cuda.memory_snapshot()


def test_a_cuda_call_in_another_thread_raises_a_simulated_cuda_error() -> None:
    # In a fresh process: torch asks torch.cuda._lazy_init only until something has
    # initialized CUDA in the process (see limitations.md).
    script = textwrap.dedent("""
        import threading, torch
        from adaptmem.testing import SimulatedCudaError, simulated_cuda
        errors = []
        def make():
            try:
                torch.zeros(3, device="cuda")
            except BaseException as exc:
                errors.append(exc)
        with simulated_cuda():
            worker = threading.Thread(target=make)
            worker.start()
            worker.join()
            assert torch.zeros(3, device="cuda").device.type == "cuda"
        print(type(errors[0]).__name__, "|", errors[0])
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("SimulatedCudaError |")
    assert "where the simulation is not active" in done.stdout


# -- random state ----------------------------------------------------------------------------

_CUDA_DRAWS = {
    "randn factory": lambda: torch.randn(8, device="cuda"),
    "randint factory": lambda: torch.randint(0, 1000, (8,), device="cuda"),
    "randperm factory": lambda: torch.randperm(16, device="cuda"),
    "normal_ in place": lambda: torch.zeros(8, device="cuda").normal_(),
    "uniform_ in place": lambda: torch.zeros(8, device="cuda").uniform_(),
    "rand_like": lambda: torch.rand_like(torch.zeros(8, device="cuda")),
    "dropout": lambda: nn.functional.dropout(torch.ones(64, device="cuda"), 0.5, True),
    "bernoulli": lambda: torch.bernoulli(torch.full((64,), 0.5, device="cuda")),
    "multinomial": lambda: torch.multinomial(torch.ones(2, 10, device="cuda"), 5),
    "nn.Linear made on cuda": lambda: nn.Linear(4, 4, device="cuda").weight,
}


@pytest.mark.parametrize("draw", list(_CUDA_DRAWS.values()), ids=list(_CUDA_DRAWS))
def test_cuda_draws_leave_the_cpu_stream_alone_and_follow_the_cuda_seed(draw) -> None:
    torch.manual_seed(123)
    expected_cpu = torch.rand(3)
    torch.manual_seed(123)
    with simulated_cuda(total_memory="1GiB"):
        torch.cuda.manual_seed(7)
        first = draw().cpu()
        assert torch.equal(torch.rand(3), expected_cpu)  # the CUDA draw took nothing
        second = draw().cpu()
        torch.cuda.manual_seed(7)
        torch.rand(5)  # a CPU draw between seed and draw changes nothing on CUDA
        again = draw().cpu()
    assert torch.equal(again, first)
    assert not torch.equal(second, first)  # the device's stream advanced


def test_torch_manual_seed_seeds_the_simulated_devices_too() -> None:
    torch.manual_seed(5)
    with simulated_cuda(devices=2, total_memory="1GiB"):
        at_entry = torch.randn(4, device="cuda:1").cpu()
        torch.manual_seed(5)
        assert torch.equal(torch.randn(4, device="cuda:1").cpu(), at_entry)
        assert torch.cuda.initial_seed() == 5
        torch.manual_seed(6)
        assert not torch.equal(torch.randn(4, device="cuda:1").cpu(), at_entry)


def test_each_device_has_its_own_stream_and_state_round_trips() -> None:
    with simulated_cuda(devices=2, total_memory="1GiB"):
        assert len(torch.cuda.default_generators) == 2
        torch.cuda.manual_seed_all(1)
        with torch.cuda.device(1):
            torch.cuda.manual_seed(2)  # the current device only
        assert torch.cuda.initial_seed() == 1
        state0, state1 = torch.cuda.get_rng_state(0), torch.cuda.get_rng_state("cuda:1")
        a0, a1 = torch.randn(4, device="cuda:0").cpu(), torch.randn(4, device="cuda:1").cpu()
        assert not torch.equal(a0, a1)
        torch.cuda.set_rng_state_all([state0, state1])
        assert torch.equal(torch.randn(4, device="cuda:1").cpu(), a1)
        torch.cuda.set_rng_state(state0, torch.device("cuda", 0))
        assert torch.equal(torch.randn(4, device="cuda:0").cpu(), a0)
        assert all(torch.equal(s, g.get_state()) for s, g in
                   zip(torch.cuda.get_rng_state_all(), torch.cuda.default_generators,
                       strict=True))
        torch.cuda.seed_all()
        seeds = {g.initial_seed() for g in torch.cuda.default_generators}
        assert len(seeds) == 1 and seeds != {1}
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.cuda.get_rng_state(2)


def test_a_cuda_generator_draws_for_the_device_and_generators_must_match_the_device() -> None:
    # diffusers' ``generator=torch.Generator("cuda").manual_seed(0)``.
    with simulated_cuda(devices=2):
        generator = torch.Generator("cuda").manual_seed(0)
        assert generator.device == torch.device("cuda", 0)
        assert isinstance(generator, torch.Generator)
        assert isinstance(torch.Generator(), torch.Generator)
        first = torch.randn(3, device="cuda", generator=generator)
        generator.manual_seed(0)
        assert torch.equal(torch.randn(3, device="cuda", generator=generator).cpu(), first.cpu())
        assert torch.Generator("cuda:1").device == torch.device("cuda", 1)
        assert torch.cuda.default_generators[1].device == torch.device("cuda", 1)
        assert torch.Generator().device.type == "cpu"
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but "
                                               "found 'cpu'"):
            torch.randn(3, device="cuda", generator=torch.Generator())
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator"):
            first.normal_(generator=torch.Generator())
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but "
                                               "found 'cuda'"):
            torch.randn(3, generator=generator)
    assert torch.Generator().device.type == "cpu"


def test_a_gpus_16_byte_rng_state_seeds_the_device_generator_with_its_seed() -> None:
    gpu_state = torch.tensor([*(1234).to_bytes(8, "little"), 7, *[0] * 7], dtype=torch.uint8)
    with simulated_cuda():
        torch.cuda.set_rng_state(gpu_state)  # a checkpoint's "cuda_rng_state" from a GPU
        drawn = torch.randn(3, device="cuda").cpu()
        assert torch.cuda.initial_seed() == 1234
        torch.cuda.manual_seed(1234)
        assert torch.equal(torch.randn(3, device="cuda").cpu(), drawn)


def test_fork_rng_on_cuda_puts_the_device_stream_back() -> None:
    with simulated_cuda(total_memory="1GiB"):
        torch.cuda.manual_seed(3)
        expected = torch.randn(4, device="cuda").cpu()
        torch.cuda.manual_seed(3)
        with torch.random.fork_rng(devices=[0], device_type="cuda"):
            torch.randn(4, device="cuda")
        assert torch.equal(torch.randn(4, device="cuda").cpu(), expected)


def test_random_state_functions_are_put_back_after_the_block() -> None:
    names = ("default_generators", "get_rng_state", "set_rng_state", "manual_seed",
             "manual_seed_all", "seed", "seed_all", "initial_seed")
    before = [getattr(torch.cuda, n) for n in names]
    before_random = [getattr(torch.cuda.random, n, None) for n in names]
    with simulated_cuda(devices=3):
        assert len(torch.cuda.default_generators) == 3
    assert [getattr(torch.cuda, n) for n in names] == before
    assert [getattr(torch.cuda.random, n, None) for n in names] == before_random


def test_a_model_already_on_the_simulated_device_can_be_chunked() -> None:
    from adaptmem import adaptive

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).eval()
    x = torch.randn(2, 256)
    with torch.no_grad():
        expected = model(x)
        with simulated_cuda(total_memory="64MiB"):
            model.cuda()
            handle = adaptive.chunk(model, "cuda", capacity=600_000)
            out = model(x.cuda()).cpu()
            handle.remove()
            model.cpu()
    assert torch.equal(out, expected)


# -- kernels CUDA picks by device type -------------------------------------------------------

@pytest.mark.parametrize("cudnn", [False, True], ids=["as-simulated", "cudnn-turned-on"])
def test_a_torchvision_model_runs_and_matches_the_cpu(cudnn: bool) -> None:
    # The simulated device has no cuDNN (batch norm takes torch's own kernel); turned on
    # inside the block, cudnn_batch_norm runs as its CPU equivalent.
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
        with simulated_cuda():
            torch.backends.cudnn.enabled = cudnn
            out = model.cuda()(x.cuda()).cpu()
            model.cpu()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("beams", [1, 2])  # beam search slices by a 0-dim device tensor
def test_gpt2_generate_runs_and_matches_the_cpu(beams: int) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                     n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 5))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "num_beams": beams}
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
        with simulated_cuda():
            model.to("cuda")
            out = model.generate(ids.cuda(), **kwargs)
            assert out.device.type == "cuda"
            out = out.cpu()
            model.to("cpu")
    assert torch.equal(out, expected)


def test_the_pytest_fixture_runs_a_test_on_the_simulated_device(pytester: pytest.Pytester
                                                                ) -> None:
    pytester.makeconftest('pytest_plugins = ["adaptmem.testing_plugin"]')
    pytester.makepyfile(f"""
        import pytest, torch

        @pytest.mark.simulated_cuda(devices=2, total_memory="1GiB")
        def test_it(simulated_cuda_device):
            assert torch.cuda.device_count() == 2
            assert torch.cuda.get_device_properties(0).total_memory == 1024**3

        @pytest.mark.simulated_cuda(2)  # positional, as simulated_cuda(2): once ignored
        def test_positional(simulated_cuda_device):
            assert torch.cuda.device_count() == 2

        def test_without():  # outside the mark: the machine's own devices
            assert torch.cuda.device_count() == {torch.cuda.device_count()}
    """)
    # pytest-benchmark, where installed, warns under xdist: an error in this suite.
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:benchmark"
                                 ).assert_outcomes(passed=3)


def test_cuda_takes_its_arguments_as_torch_does_and_properties_have_every_field() -> None:
    x = torch.randn(2, 3, 4, 4)
    with simulated_cuda(bandwidth=1):
        assert x.cuda(memory_format=torch.channels_last).is_contiguous(
            memory_format=torch.channels_last)
        on = x.cuda()
        assert on.cuda(memory_format=torch.channels_last).is_contiguous(
            memory_format=torch.channels_last)
        assert on.cuda() is on
        host = torch.ones(MiB // 4).pin_memory()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            dev = host.cuda(0, True)  # non_blocking by position: a copy in flight
        with pytest.raises(StreamRaceError, match="read before its copy completed"):
            dev.sum()
        torch.cuda.synchronize()
        props = torch.cuda.get_device_properties(0)
        fields = [a for a in dir(torch._C._CudaDeviceProperties) if not a.startswith("_")]
        assert [f for f in fields if not hasattr(props, f)] == []
        # The default stream is 0, as on CUDA, and ExternalStream(0) is it.
        assert torch.cuda.current_stream().cuda_stream == 0
        assert torch.cuda.ExternalStream(0) is torch.cuda.default_stream()
        assert torch.cuda.Stream().cuda_stream != 0


def test_empty_tensors_allocate_nothing_and_out_of_memory_reads_as_cudas() -> None:
    with simulated_cuda(total_memory="64MiB"):
        for _ in range(3):
            del _
            _ = torch.empty(0, device="cuda")
        del _
        stats = torch.cuda.memory_stats()
        assert stats["allocation.all.current"] == stats["active.all.current"] == 0
        assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] == 0
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
        # torch's message always has this sentence; code matching on it works the same.
        assert "is free. Including non-PyTorch memory, this process has " in str(info.value)
        torch.cuda.set_per_process_memory_fraction(0.5)
        with pytest.raises(torch.OutOfMemoryError, match=r"this process has .* memory in use\. "
                                                         r"Process has 32\.00 MiB memory allowed"):
            torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")


def test_backward_of_a_device_tensor_says_the_simulation_has_no_autograd() -> None:
    with simulated_cuda():
        layer = nn.Linear(4, 1).cuda()
        loss = layer(torch.randn(2, 4, device="cuda")).sum()
        with pytest.raises(SimulatedCudaError, match=r"backward\(\) of a tensor on the "
                                                     r"simulated CUDA device: the simulation "
                                                     r"has no autograd"):
            loss.backward()
        host = torch.ones(2, requires_grad=True)
        (host * 3).sum().backward()  # the host's autograd is torch's own
        assert torch.equal(host.grad, torch.full((2,), 3.0))


def test_a_default_device_set_to_cuda_inside_the_block_is_put_back_with_a_warning() -> None:
    with pytest.warns(UserWarning, match=r"set_default_device\('cuda(:0)?'\) inside "
                                         r"simulated_cuda\(\) was undone"):
        with simulated_cuda():
            torch.set_default_device("cuda")
            assert torch.ones(1).is_cuda
    assert torch.ones(1).device.type == "cpu"
    assert not torch._C._is_torch_function_mode_enabled()
    torch.set_default_device("cpu")  # one of the user's own, kept as it was
    try:
        with simulated_cuda():
            assert torch.ones(1).device.type == "cpu"
        assert torch.get_default_device().type == "cpu"
    finally:
        torch.set_default_device(None)


def test_memory_summary_and_stats_read_as_cudas_do() -> None:
    with simulated_cuda(total_memory="64MiB"):
        a = torch.empty(3 * 2**20, dtype=torch.uint8, device="cuda")
        b = torch.empty(128, device="cuda")
        del a
        stats = torch.cuda.memory_stats()
        assert stats["allocated_bytes.all.current"] == torch.cuda.memory_allocated() == 512
        assert stats["allocated_bytes.all.peak"] == torch.cuda.max_memory_allocated()
        assert stats["allocation.all.current"] == 1 and stats["allocation.all.allocated"] == 2
        assert stats["reserved_bytes.all.current"] == torch.cuda.memory_reserved()
        summary = torch.cuda.memory_summary()  # once a KeyError
        assert "PyTorch CUDA memory summary, device ID 0" in summary
        assert "Allocated memory" in summary and "CUDA OOMs: 0" in summary
        del b


def test_what_fitted_still_fits_after_an_out_of_memory_error_emptied_the_cache() -> None:
    # See [Note: emptying whole segments]: weights of a little over 8 MiB on a 12 MiB
    # device, then three activations of 1.13 MiB (what batch 580 of a 512-wide layer
    # takes). They fit; a larger size fails and the release that comes with its OOM must
    # not leave the 580 failing where it fitted before (it did: the release kept only the
    # bytes in use reserved, stranding the tail of their last segment).
    def activations(nbytes: int) -> None:
        blocks = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(3)]
        del blocks

    with simulated_cuda(total_memory=12 * MiB):
        weights = [torch.empty(MiB + 2048, dtype=torch.uint8, device="cuda") for _ in range(8)]
        activations(580 * 512 * 4)
        with pytest.raises(torch.OutOfMemoryError):
            activations(700 * 512 * 4)
        activations(580 * 512 * 4)  # the same blocks as before the failure
        assert torch.cuda.memory_reserved() % (2 * MiB) == 0  # whole segments
        # A block larger than what is cached takes the cached bytes plus what is missing.
        torch.cuda.empty_cache()
        activations(MiB)
        big = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_allocated() == 8 * (MiB + 2048) + 3 * MiB
        del big, weights


def test_host_autograd_inside_the_block_is_torchs_own() -> None:
    # The simulation's handlers (slicing, setitem, .to, copy_) ran without grad for host
    # tensors too: x[1:] had no graph and x.grad stayed None, with no error.
    with simulated_cuda():
        x = torch.arange(4.0, requires_grad=True)
        (x[1:] * 2).sum().backward()
        grad = x.grad
        kept = [x[[0, 1]].requires_grad, x.to(torch.float64).requires_grad]
        w = torch.zeros(4)
        w[1:] = x[1:]
        kept.append(w.requires_grad)
        with pytest.raises(RuntimeError, match="requires grad"):
            x.numpy()
        forced = torch.ones(2, device="cuda").numpy(force=True)  # a host copy, as documented
    assert grad is not None and grad.tolist() == [0.0, 2.0, 2.0, 2.0]
    assert kept == [True, True, True]
    assert forced.tolist() == [1.0, 1.0]


def test_empty_and_sparse_host_tensors_are_no_pinned_copys_source() -> None:
    # Every empty storage is at address 0: an empty pinned tensor's copy in flight made
    # every empty host tensor "its source"; a sparse tensor's write asked for a storage.
    with simulated_cuda(bandwidth=0.01):
        source = torch.zeros(4 << 20).pin_memory()
        source.to("cuda", non_blocking=True)  # a copy in flight
        torch.empty(0).pin_memory().to("cuda", non_blocking=True)
        grown = torch.empty(0).resize_(5)
        out = torch.exp(torch.ones(3), out=torch.empty(0))
        sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,),
                                         check_invariants=True)
        sparse.mul_(2)
        pinned_empty = torch.empty(0).is_pinned()
        with pytest.raises(StreamRaceError):
            source.fill_(1)  # the real source still is one
        torch.cuda.synchronize()
    assert grown.shape == (5,) and out.shape == (3,) and not pinned_empty
    assert sparse.to_dense().tolist() == [2.0, 4.0, 0.0]


def test_copy_of_a_parameter_and_an_out_binding_behave_as_on_cuda() -> None:
    import copy

    with simulated_cuda():
        p = nn.Parameter(torch.ones(3, device="cuda"))
        c = copy.copy(p)
        assert isinstance(c, nn.Parameter) and c.requires_grad and c.data_ptr() == p.data_ptr()
        a = torch.tensor([1.0, -1, 2, 3], device="cuda")
        o = torch.empty(0, dtype=torch.long, device="cuda")  # (a non-empty one warns on CUDA)
        r = torch.nonzero(a > 0, out=o)  # a binding with the device guard, out= given
        assert r is o and o.shape == (3, 1) and o.cpu().flatten().tolist() == [0, 2, 3]


def test_an_op_with_cpu_kernels_only_is_refused_on_the_device_as_cuda_refuses_it() -> None:
    """A dynamically quantized linear has no CUDA kernel: a GPU raises, so a paged or
    chunked quantized model must not pass its tests on the simulation in silence."""
    with warnings.catch_warnings():  # torch deprecates eager quantization for torchao
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(
            nn.Sequential(nn.Linear(4, 4)), {nn.Linear}, dtype=torch.qint8).eval()
    x = torch.randn(2, 4)
    with simulated_cuda(devices=1, total_memory="64MiB"):
        with pytest.raises(NotImplementedError, match=r"linear_dynamic.*'CUDA' backend"):
            model(x.cuda())
        assert model(x).device.type == "cpu"  # on the host it runs


def test_streams_a_synchronised_stream_waited_for_are_let_go() -> None:
    """A pager makes a side stream per page(); the default stream waits for each. After the
    host synchronised, those entries say nothing, and kept they held every side stream and
    its last copy for the life of the block."""
    import gc
    import weakref

    with simulated_cuda(devices=1, total_memory="64MiB"):
        host = torch.randn(256).pin_memory()
        streams = []
        for _ in range(5):
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                on_device = host.to("cuda", non_blocking=True)
            torch.cuda.current_stream().wait_stream(side)
            on_device.record_stream(torch.cuda.current_stream())
            on_device.sum()  # safe: the default stream waited
            streams.append(weakref.ref(side))
            del side, on_device
        torch.cuda.synchronize()
        gc.collect()
        assert all(ref() is None for ref in streams)
        # and race detection still holds after the entries went
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            late = host.to("cuda", non_blocking=True)
        with pytest.raises(StreamRaceError):
            late.sum()
        torch.cuda.synchronize()
        del late


def test_slices_bounded_by_a_0_dim_device_tensor_read_and_write_as_on_a_gpu() -> None:
    with simulated_cuda(devices=1, total_memory="64MiB"):
        t = torch.arange(10, device="cuda").reshape(2, 5)
        n = torch.tensor(3, device="cuda")
        assert t[:, :n].cpu().tolist() == [[0, 1, 2], [5, 6, 7]]
        assert t[:, n::torch.tensor(1, device="cuda")].shape == (2, 2)
        t[:, :n] = 0
        assert t.cpu().tolist() == [[0, 0, 0, 3, 4], [0, 0, 0, 8, 9]]
        with warnings.catch_warnings():  # a list holding a slice: deprecated, still an index
            warnings.simplefilter("ignore")
            assert t[[slice(None, n), 3]].cpu().tolist() == [3, 8]
        assert t[[0, 1]].shape == (2, 5)  # a list of rows is still advanced indexing


def test_a_loader_pinning_in_the_simulations_own_thread_keeps_the_simulation_on() -> None:
    # A DataLoader without workers pins in the main thread; pinning took that thread off
    # the simulation's list, and every later CUDA call there raised SimulatedCudaError.
    from torch.utils.data import DataLoader, TensorDataset

    with simulated_cuda():
        loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4, pin_memory=True)
        assert all(batch.is_pinned() for (batch,) in loader)
        assert torch.cuda.get_sync_debug_mode() == 0
        assert (torch.ones(2, device="cuda") * 2).sum().item() == 4.0


def test_a_copied_device_generator_stays_on_its_device_with_its_state() -> None:
    # copy.deepcopy made a CPU generator of it, which the device's random ops then refused.
    import copy

    with simulated_cuda():
        generator = torch.Generator("cuda").manual_seed(3)
        copied = copy.deepcopy(generator)
        assert copied.device == torch.device("cuda", 0)
        drawn = torch.randn(4, device="cuda", generator=copied)
        assert torch.equal(drawn.cpu(), torch.randn(4, device="cuda", generator=generator).cpu())


def test_a_blocking_copy_from_the_host_synchronizes_its_stream() -> None:
    # As CUDA's memcpy_and_sync: a free after it is no misuse (it was reported as one).
    with simulated_cuda():
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            made = torch.empty(100, device="cuda")
        torch.cuda.current_stream().wait_stream(side)
        made.copy_(torch.ones(100))
        del made
        moved = torch.ones(100).to("cuda")
        assert moved.sum().item() == 100.0
