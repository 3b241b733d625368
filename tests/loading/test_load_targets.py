"""adaptive.load: where each tensor ends up, in which dtype and memory format, what the
statistics count, and that a load failing while it makes tensors changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from adaptmem import LoadError, adaptive
from adaptmem.testing import simulated_cuda

safetensors_torch = pytest.importorskip("safetensors.torch")


class _WithMask(nn.Module):
    """A 1 MiB linear layer and a 4 MiB non-persistent buffer the constructor computes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(512, 512)
        self.register_buffer("mask", torch.ones(1024, 1024), persistent=False)


def _devices(model: nn.Module) -> dict[str, str]:
    return {n: str(t.device) for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("into", ["built", "factory"])
def test_running_out_of_device_memory_late_in_a_load_leaves_the_model_as_it_was(
    into: str, tmp_path: Path,
) -> None:
    # The parameters fit the 3 MiB device; the buffer moved after them does not.
    torch.save(_WithMask().state_dict(), tmp_path / "m.pt")
    with simulated_cuda(devices=1, total_memory="3MiB"):
        model = _WithMask() if into == "built" else adaptive.empty_model(_WithMask)
        before = _devices(model)
        with pytest.raises(torch.OutOfMemoryError):
            adaptive.load(model, tmp_path / "m.pt", device="cuda")
        assert _devices(model) == before  # not parameters on the GPU and the buffer on CPU
        assert torch.cuda.memory_allocated() == 0


def test_non_persistent_buffers_moved_by_the_load_count_in_bytes_by_device(
    tmp_path: Path,
) -> None:
    torch.save(_WithMask().state_dict(), tmp_path / "m.pt")
    with simulated_cuda(devices=1):
        model, stats = adaptive.load(_WithMask, tmp_path / "m.pt", device="cuda",
                                     return_stats=True)
        on_device = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
        assert stats.bytes_by_device == {"cuda:0": on_device}


def _stack() -> nn.Module:
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])


def test_a_plan_made_with_a_dtype_loads_each_tensor_in_the_dtype_it_was_sized_in(
    tmp_path: Path,
) -> None:
    torch.save(_stack().state_dict(), tmp_path / "m.pt")
    with simulated_cuda(devices=1, total_memory="64MiB"):
        plan = adaptive.plan(adaptive.empty_model(_stack),
                             devices={"cuda:0": "600KiB", "cpu": None}, dtype=torch.float16)
        model, stats = adaptive.load(_stack, tmp_path / "m.pt", device=plan, return_stats=True)
        assert {p.dtype for p in model.parameters()} == {torch.float16}
        assert stats.bytes_by_device["cuda:0"] <= 600 * 2**10  # the budget the plan kept
        with pytest.raises(ValueError, match="conflicts with the plan"):
            adaptive.load(_stack, tmp_path / "m.pt", device=plan, dtype=torch.float32)


def test_a_plan_with_a_dtype_per_device_converts_only_that_devices_tensors(
    tmp_path: Path,
) -> None:
    source = _stack()
    torch.save(source.state_dict(), tmp_path / "m.pt")
    plan = adaptive.plan(adaptive.empty_model(_stack),
                         devices={"cpu@float16": "600KiB", "cpu": None})
    model = adaptive.load(_stack, tmp_path / "m.pt", device=plan)
    half = {t for u in plan.units if u.placement == "cpu@float16" for t in u.tensors}
    assert half and len(half) < len(model.state_dict())
    for name, t in model.state_dict().items():
        assert t.dtype == (torch.float16 if name in half else torch.float32), name
        assert torch.equal(t, source.state_dict()[name].to(t.dtype)), name


def _channels_last_conv() -> nn.Module:
    return nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)


def _channels_last(t: torch.Tensor) -> bool:
    return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("how", ["built, converted", "factory", "factory, copy=False"])
def test_the_models_memory_format_is_kept(how: str, tmp_path: Path) -> None:
    source = _channels_last_conv()
    torch.save(source.state_dict(), tmp_path / "m.pt")  # saved as it is, channels last
    if how == "built, converted":
        model = adaptive.load(_channels_last_conv(), tmp_path / "m.pt", dtype=torch.float16)
    else:
        model = adaptive.load(_channels_last_conv, tmp_path / "m.pt", device="cpu",
                              copy=not how.endswith("copy=False"))
    assert _channels_last(model.weight)
    assert torch.equal(model.weight.float(), source.weight.to(model.weight.dtype).float())


def test_a_batch_counter_missing_from_the_checkpoint_of_a_meta_model_starts_at_zero(
    tmp_path: Path,
) -> None:
    state = {k: v for k, v in nn.BatchNorm1d(8).state_dict().items()
             if k != "num_batches_tracked"}
    torch.save(state, tmp_path / "v1.pt")
    with torch.device("meta"):
        model = nn.BatchNorm1d(8)
    model = adaptive.load(model, tmp_path / "v1.pt", device="cpu", strict=True)
    assert model.num_batches_tracked.item() == 0  # as load_state_dict(assign=True) gives


@pytest.mark.parametrize("value", [None, 3, ["a.safetensors"]])
def test_an_index_naming_no_shard_file_is_a_load_error(value: object, tmp_path: Path) -> None:
    safetensors_torch.save_file(nn.Linear(4, 4).state_dict(), tmp_path / "a.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"weight": "a.safetensors", "bias": value}}))
    with pytest.raises(LoadError, match="not shard file names: 'bias'"):
        adaptive.load(nn.Linear(4, 4), tmp_path)


def test_copy_false_maps_a_built_models_cpu_tensors_too(tmp_path: Path) -> None:
    source = nn.Linear(1024, 1024)
    torch.save(source.state_dict(), tmp_path / "m.pt")
    model = nn.Linear(1024, 1024)
    weight = model.weight
    model, stats = adaptive.load(model, tmp_path / "m.pt", copy=False, return_stats=True)
    assert model.weight is weight  # the Parameter stays; its .data is the file's mapping
    assert stats.bytes_read == 0
    assert stats.bytes_mapped == sum(p.nbytes for p in source.parameters())
    assert torch.equal(model.weight, source.weight)
    with torch.no_grad():
        model.weight.add_(1)  # copy-on-write: the file keeps its values
    assert torch.equal(torch.load(tmp_path / "m.pt")["weight"], source.weight)


def test_flags_must_be_booleans(tmp_path: Path) -> None:
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "m.pt")
    for flag, value in (("strict", "False"), ("strict", None), ("copy", "no"),
                        ("return_stats", 1)):
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got {value!r}"):
            adaptive.load(nn.Linear(2, 2), tmp_path / "m.pt", **{flag: value})


def test_paged_plan_tensors_stay_pinned_on_the_simulated_device(tmp_path: Path) -> None:
    torch.save(_stack().state_dict(), tmp_path / "m.pt")
    with simulated_cuda(devices=1):
        plan = adaptive.plan(adaptive.empty_model(_stack), unit_bytes="1KiB")
        model, stats = adaptive.load(_stack, tmp_path / "m.pt", device=plan, return_stats=True)
        assert list(stats.bytes_by_device) == ["cpu (pinned)"]
        assert all(p.is_pinned() for p in model.parameters())  # pinning is the storage's


@pytest.mark.parametrize("engine", ["page", "chunk", "split"])
def test_pinned_tensors_stay_pinned_after_placement_and_remove(tmp_path: Path,
                                                               engine: str) -> None:
    # A paging plan's load pins the host units; placing the model and removing the engine
    # gives them back laid out in new memory (page packs each unit's masters), which must be
    # pinned again, or the next placement's copies would no longer be asynchronous.
    source = _stack().eval()
    torch.save(source.state_dict(), tmp_path / "m.pt")
    with simulated_cuda(devices=1):
        plan = adaptive.plan(adaptive.empty_model(_stack), unit_bytes="1KiB")
        model = adaptive.load(_stack, tmp_path / "m.pt", device=plan).eval()
        x = torch.randn(2, *source[0].weight.shape[1:])
        if engine == "page":
            handle = adaptive.page(model, device="cuda")
        elif engine == "chunk":
            handle = adaptive.chunk(model, device="cuda", capacity="600KiB")
        else:
            handle = adaptive.split(model, {"cuda": "600KiB", "cpu": None})
        with torch.no_grad():
            model(x.to("cuda" if engine == "page" else "cpu"))
        if engine != "page":  # page's units are on the device only while they run
            assert any(p.device.type == "cuda" for p in model.parameters())
        handle.remove()
        assert all(t.device.type == "cpu" and t.is_pinned() for t in model.state_dict().values())
        for name, t in model.state_dict().items():
            assert torch.equal(t, source.state_dict()[name]), name


def test_copy_false_leaves_a_model_built_under_inference_mode_usable(tmp_path: Path) -> None:
    source = nn.Linear(2, 2)
    torch.save(source.state_dict(), tmp_path / "m.pt")
    with torch.inference_mode():
        model = nn.Linear(2, 2)
    adaptive.load(model, tmp_path / "m.pt", copy=False)
    assert model.weight.is_inference()  # filled in place, not given a mapping
    assert torch.equal(model.weight, source.weight)
    with torch.inference_mode():
        assert torch.equal(model(torch.ones(1, 2)), source(torch.ones(1, 2)))
    model.weight.t()  # once: "Inference tensors do not track version counter"


class _Flat(nn.Module):
    """Two parameters over one flat storage, as flattened-parameter wrappers keep them."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.zeros(8)
        self.a = nn.Parameter(flat[:4])
        self.b = nn.Parameter(flat[4:])


class _FlatView(nn.Module):
    """A weight and a non-persistent buffer that views all of it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4))
        self.register_buffer("flat", self.weight.data.view(-1), persistent=False)


def test_copy_false_keeps_a_storage_the_models_own_tensors_share(tmp_path: Path) -> None:
    safetensors_torch.save_file({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)},
                                tmp_path / "m.safetensors")
    model = adaptive.load(_Flat(), tmp_path / "m.safetensors", copy=False)
    assert model.a.tolist() == [1.0] * 4 and model.b.tolist() == [2.0] * 4
    assert model.a.untyped_storage().data_ptr() == model.b.untyped_storage().data_ptr()
    # Each covering the whole storage: still one memory, the buffer sees the weight.
    safetensors_torch.save_file({"weight": torch.full((4, 4), 3.0)}, tmp_path / "w.safetensors")
    viewed = adaptive.load(_FlatView(), tmp_path / "w.safetensors", copy=False)
    assert viewed.flat.tolist() == [3.0] * 16
    assert viewed.flat.untyped_storage().data_ptr() == viewed.weight.untyped_storage().data_ptr()


class _OnDeviceWithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("big", torch.zeros(64, 1024, 1024), persistent=False)  # 256 MiB


def test_running_out_while_moving_buffers_leaves_tensors_filled_in_place_unwritten(
    tmp_path: Path,
) -> None:
    torch.save({"lin.weight": torch.full((4, 4), 7.0), "lin.bias": torch.full((4,), 7.0)},
               tmp_path / "m.pt")
    with simulated_cuda(total_memory="200MiB"):
        model = _OnDeviceWithBuffer()
        model.lin.to("cuda")  # already in place: filled by the reads themselves
        before = model.lin.weight.detach().cpu().clone()
        with pytest.raises(torch.OutOfMemoryError):
            adaptive.load(model, tmp_path / "m.pt", device="cuda")
        assert torch.equal(model.lin.weight.detach().cpu(), before)
        assert model.big.device.type == "cpu"


def _pair_and_checkpoint(tmp_path: Path) -> tuple[nn.Module, nn.Module, nn.Module, Path]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).eval()

    source = make()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1)
    torch.save(source.state_dict(), tmp_path / "m.pt")
    return make(), make(), source, tmp_path / "m.pt"


def test_a_handle_loads_only_the_model_it_holds(tmp_path: Path) -> None:
    # The same architecture twice: loading b through a's pager used to fill a with the
    # checkpoint and return b untouched, with no error.
    a, b, source, path = _pair_and_checkpoint(tmp_path)
    before_a = [p.detach().clone() for p in a.parameters()]
    x = torch.randn(2, 8)
    with adaptive.page(a, "cpu", unit_bytes=0, resident_bytes=0) as pager:
        with pytest.raises(LoadError, match="holds a different model"):
            adaptive.load(b, path, device=pager)
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before_a, strict=True))
        adaptive.load(a, path, device=pager)
        with torch.no_grad():
            torch.testing.assert_close(a(x), source(x), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [{"dtype": torch.float16}, {"copy": False},
                                    {"device": "cpu"}])
def test_a_placed_model_refuses_a_load_that_would_go_around_its_handle(
        kwargs: dict[str, object], tmp_path: Path) -> None:
    # These swapped or mapped tensors under the engine: with dtype= the next forward failed
    # and remove() put the old weights back, the checkpoint lost.
    a, _, source, path = _pair_and_checkpoint(tmp_path)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    x = torch.randn(2, 8)
    chunker = adaptive.chunk(a, "cpu", capacity="1MiB", dtype=torch.bfloat16, example_inputs=x)
    with pytest.raises(LoadError, match=r"held by adaptive.chunk .*chunker.remove\(\) first"):
        adaptive.load(a, path, **kwargs)
    with torch.no_grad():
        a(x)  # still runs as placed
    chunker.remove()
    assert all(torch.equal(a.state_dict()[k], v) for k, v in before.items())
    adaptive.load(a, path, **kwargs)  # once given back, it loads
    want = torch.float16 if kwargs.get("dtype") else torch.float32
    assert all(torch.equal(a.state_dict()[k], v.to(want)) for k, v in source.state_dict().items())


def test_a_plain_load_of_a_placed_model_goes_through_its_handle(tmp_path: Path) -> None:
    # A bfloat16 chunk keeps the float32 originals for remove(): a load into the model's
    # own (bfloat16) tensors left the checkpoint there at bfloat16 precision only.
    a, _, source, path = _pair_and_checkpoint(tmp_path)
    x = torch.randn(2, 8)
    with adaptive.chunk(a, "cpu", capacity="1MiB", dtype=torch.bfloat16, example_inputs=x):
        adaptive.load(a, path)
        with torch.no_grad():
            torch.testing.assert_close(a(x), source(x), rtol=0.05, atol=0.05)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in source.state_dict().items())


def test_a_model_held_for_a_decorated_function_loads_through_it_or_says_how_to_free_it(tmp_path: Path) -> None:
    a, _, source, path = _pair_and_checkpoint(tmp_path)

    @adaptive.batch(initial_batchsize=2, model=a, device="cpu")
    def run(batchsize: int, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([a(c) for c in x.split(batchsize)])

    x = torch.randn(4, 8)
    run(x)
    with pytest.raises(LoadError, match=r"decorated function .*run.remove\(\) first"):
        adaptive.load(a, path, dtype=torch.float64)
    adaptive.load(a, path)  # through the function's engine
    torch.testing.assert_close(run(x), source(x), rtol=0, atol=0)
    run.remove()
    assert all(torch.equal(a.state_dict()[k], v) for k, v in source.state_dict().items())


def _nested() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 2)).eval()


def test_a_model_with_placed_parts_loads_each_part_through_its_engine(tmp_path: Path) -> None:
    source = _nested()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1)
    torch.save(source.state_dict(), tmp_path / "whole.pt")
    torch.save(source[0].state_dict(), tmp_path / "child.pt")
    x = torch.randn(2, 8)
    model = _nested()
    pager = adaptive.page(model[0], "cpu", unit_bytes=0, resident_bytes=0)
    chunker = adaptive.chunk(model[1], "cpu", capacity="1MiB", dtype=torch.bfloat16,
                             example_inputs=x)
    adaptive.load(model, tmp_path / "whole.pt")
    with torch.no_grad():
        torch.testing.assert_close(model[0](x), source[0](x), rtol=0, atol=0)  # paged: exact
    pager.remove()
    chunker.remove()  # the bfloat16 chunk's float32 originals got the checkpoint too
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 source.state_dict().values(), strict=True))
    # A part of a paged model: its tensors only, through the pager of the whole.
    model = _nested()
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0) as whole:
        with pytest.raises(LoadError, match="is part of the model it holds"):
            adaptive.load(model[0], tmp_path / "child.pt", device=whole)
        adaptive.load(model[0], tmp_path / "child.pt")
    assert all(torch.equal(a, b) for a, b in zip(model[0].state_dict().values(),
                                                 source[0].state_dict().values(), strict=True))
    assert torch.equal(model[1].weight, _nested()[1].weight)
    with pytest.raises(LoadError, match="holds no model now"):
        adaptive.load(model, tmp_path / "whole.pt", device=whole)  # removed by its block


@pytest.mark.parametrize("device", ["cuda:1", "split"])
def test_a_staging_chunk_is_refilled_only_once_its_copies_to_another_gpu_are_done(
        device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The reader refilled a pinned chunk once an event on the *current* device's stream had
    # passed, but a copy to cuda:1 runs on cuda:1's stream: the chunk was overwritten while
    # that copy still read it (silently wrong weights on a GPU). Here a torch write into the
    # chunk before each refill raises where a copy still reads it.
    from adaptmem._loading import checkpoints, staging

    monkeypatch.setattr(checkpoints, "_CHUNK", 1 << 20)  # tensors of several chunks
    real_init = staging.Staging.__init__

    def init(self: staging.Staging, fill: Any, chunk: int) -> None:
        def checked(file: str, offset: int, dest: torch.Tensor) -> None:
            dest.zero_()  # a copy still reading ``dest`` makes this a stream race
            fill(file, offset, dest)

        real_init(self, checked, chunk)
        self._threadless = True  # read on this thread: the one the simulation watches

    monkeypatch.setattr(staging.Staging, "__init__", init)
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 4 MiB weights
    torch.save(source.state_dict(), tmp_path / "m.pt")
    with simulated_cuda(devices=2, total_memory="64MiB", bandwidth=0.5):  # 2 ms a MiB
        assert torch.cuda.current_device() == 0
        if device == "split":
            model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).eval()
            with adaptive.split(model, {"cuda:0": "5MiB", "cuda:1": None},
                                example_inputs=torch.randn(2, 1024)) as splitter:
                adaptive.load(model, tmp_path / "m.pt", device=splitter)
                got = {k: v.cpu() for k, v in model.state_dict().items()}
                assert {torch.device(d).index for d in splitter.device_map.values()} == {0, 1}
        else:
            model = adaptive.load(lambda: nn.Sequential(nn.Linear(1024, 1024),
                                                        nn.Linear(1024, 1024)),
                                  tmp_path / "m.pt", device=device)
            assert {t.device for t in model.state_dict().values()} == {torch.device(device)}
            got = {k: v.cpu() for k, v in model.state_dict().items()}
    for key, value in source.state_dict().items():
        assert torch.equal(got[key], value), key


def test_a_gathered_view_after_a_chunked_copy_to_the_gpu_waits_for_that_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A small view of a large storage is gathered through the first staging chunk, which a
    # copy to the device of the tensor before it may still be reading.
    from adaptmem._loading import checkpoints

    monkeypatch.setattr(checkpoints, "_CHUNK", 1 << 20)

    class TwoWeights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.empty(1024, 1024))  # 4 MiB: read in chunks
            self.b = nn.Parameter(torch.empty(1000))  # a view spread over 4 MB: gathered

    torch.manual_seed(0)
    state = {"a": torch.randn(1024, 1024), "b": torch.randn(1000 * 1000)[::1000]}
    torch.save(state, tmp_path / "m.pt")
    with simulated_cuda(devices=1, total_memory="64MiB", bandwidth=0.5):
        model = adaptive.load(TwoWeights, tmp_path / "m.pt", device="cuda")
        got = {k: v.cpu() for k, v in model.state_dict().items()}
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])
