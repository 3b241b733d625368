"""chunk / split with a dtype: edits made to the converted copies between calls (through
``.data``, which moves no version counter) are kept by ``remove()``; gradients come back in
the parameter's dtype. And capacities and budgets no forward could run under are refused
at the call that received them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from adaptmem import PlacementError, adaptive
from adaptmem.testing import simulated_cuda


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).eval()


PLACERS: dict[str, Callable[[nn.Module], object]] = {
    "chunk bf16": lambda m: adaptive.chunk(m, "cpu", capacity=10**6, dtype=torch.bfloat16),
    "split float64": lambda m: adaptive.split(m, {"cpu@float64": None, "cpu": None}),
}


def _fill(w: nn.Parameter) -> None:
    w.data.fill_(0.5)


def _assign(w: nn.Parameter) -> None:
    w.data = torch.full_like(w.data, 0.5)


@pytest.mark.parametrize("placer", list(PLACERS))
@pytest.mark.parametrize("edit", [_fill, _assign], ids=["data.fill_", "data ="])
def test_an_edit_through_data_between_calls_is_kept_by_remove(
    placer: str, edit: Callable[[nn.Parameter], None],
) -> None:
    model, x = _model(), torch.randn(3, 8)
    handle = PLACERS[placer](model)
    with torch.no_grad():
        model(x)
        edit(model[0].weight)
        edited = model(x)  # the forward uses the edit
    handle.remove()  # type: ignore[attr-defined]
    assert model[0].weight.dtype == torch.float32
    assert bool((model[0].weight == 0.5).all())
    with torch.no_grad():
        assert torch.allclose(model(x), edited, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("placer", list(PLACERS))
def test_an_edit_of_one_element_leaves_the_others_unrounded(placer: str) -> None:
    model = _model()
    before = model[0].weight.detach().clone()
    handle = PLACERS[placer](model)
    with torch.no_grad():
        model(torch.randn(3, 8))
    model[0].weight.data[0, 0] = 0.5
    handle.remove()  # type: ignore[attr-defined]
    after = model[0].weight.detach()
    assert after[0, 0].item() == 0.5
    assert torch.equal(after.flatten()[1:], before.flatten()[1:])  # bitwise, not rounded
    assert torch.equal(model[1].weight, _model()[1].weight)


def test_gradients_made_while_placed_come_back_in_the_parameters_dtype() -> None:
    model = _model()
    handle = adaptive.chunk(model, "cpu", capacity=10**6, dtype=torch.bfloat16)
    model(torch.randn(3, 8)).sum().backward()
    assert model[0].weight.grad is not None
    handle.remove()
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype == torch.float32
    model(torch.randn(3, 8)).sum().backward()  # accumulates into the fp32 gradients


def test_capacities_and_budgets_no_forward_could_run_under_are_refused() -> None:
    model = _model()
    with simulated_cuda(devices=1, total_memory="4MiB"):
        with pytest.raises(ValueError, match=r"capacity=100.0 MiB is more than cuda:0 can hold"):
            adaptive.chunk(model, "cuda", capacity="100MiB")
        with pytest.raises(ValueError, match=r"devices\['cuda:0'\]=100.0 MiB is more than"):
            adaptive.split(model, {"cuda:0": "100MiB", "cpu": None})
        with pytest.raises(ValueError, match="device_budget=0"):
            adaptive.page(model, "cuda", device_budget=0)
        with pytest.raises(TypeError, match="pin_memory must be True or False, got 'no'"):
            adaptive.page(model, "cuda", pin_memory="no")  # type: ignore[arg-type]
        # Nothing was applied: the model runs on the CPU as before, with no hooks left.
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert not model._forward_pre_hooks and not model[0]._forward_pre_hooks
    # A plan is for any machine: its capacities are not checked against this one.
    adaptive.plan(model, devices={"cuda:0": "100GiB", "cpu": None})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_converted_copies_on_the_simulated_gpu_come_back_exact_or_with_their_edits(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16)).eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(3, 64)
    with simulated_cuda(total_memory="64MiB"):
        handle = adaptive.chunk(model, "cuda", capacity="1MiB", dtype=dtype)
        with torch.no_grad():
            out = model(x.cuda()).cpu()
        model[0].weight.data[1, 2] = 0.5  # one element of one converted copy
        handle.remove()
    reference = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16)).eval().to(dtype)
    reference.load_state_dict({n: t.to(dtype) for n, t in before.items()})
    with torch.no_grad():
        assert torch.equal(out, reference(x.to(dtype)).to(out.dtype))  # copies untouched
    for name, p in model.named_parameters():
        expected = before[name].clone()
        if name == "0.weight":
            expected[1, 2] = 0.5
        assert p.device.type == "cpu" and p.dtype == torch.float32
        assert torch.equal(p.detach(), expected), name  # bitwise, but for the edit


def _four() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)),
                          nn.Linear(32, 8)).eval()
    x = torch.randn(2, 32)
    with torch.no_grad():
        return model, x, model(x)


@pytest.mark.parametrize("value", ["cpu:0", torch.device("cpu")])
def test_a_device_map_alone_takes_any_spelling_of_a_device(value: object) -> None:
    model, x, want = _four()
    with adaptive.split(model, device_map={"": value, "1": "cpu"}, example_inputs=x) as s:
        assert s.device_map == {"": "cpu"}
        with torch.no_grad():
            torch.testing.assert_close(model(x), want)


def test_a_device_map_takes_a_gpu_index_and_a_device_without_its_index() -> None:
    # accelerate's maps give GPUs as integers; "cuda" is the current device. Both used to be
    # refused, with errors about a devices= argument the call never had.
    model, x, want = _four()
    with simulated_cuda(devices=2, total_memory="64MiB"):
        torch.cuda.set_device(1)
        with adaptive.split(model, device_map={"0": 0, "1": "cuda", "2": "cpu"},
                            example_inputs=x) as s:
            assert s.device_map == {"0": "cuda:0", "1": "cuda:1", "2": "cpu"}
            with torch.no_grad():
                got = model(x).cpu()
            s.device_map = {"": 1}
            assert {p.device for p in model.parameters()} == {torch.device("cuda", 1)}
    torch.testing.assert_close(got, want)


def test_a_device_map_key_that_more_specific_keys_overrule_everywhere_is_refused() -> None:
    # Setting a parent in a map that lists its children moved nothing and said nothing.
    model, x, want = _four()
    with adaptive.split(model, {"cpu@bfloat16": "8KiB", "cpu": None}, example_inputs=x) as s:
        edited = {"0": "cpu@bfloat16", "1.0": "cpu@bfloat16", "1.1": "cpu", "2": "cpu"}
        s.device_map = edited
        edited["1"] = "cpu"
        with pytest.raises(PlacementError, match=r"device_map\['1'\] places nothing.*'1.0', "
                                                 r"'1.1'"):
            s.device_map = edited
        assert s.device_map == {k: v for k, v in edited.items() if k != "1"}  # unchanged
        s.device_map = {"": "cpu@bfloat16", "1": "cpu"}  # a default and an override: fine
        assert s.device_map == {"0": "cpu@bfloat16", "1": "cpu", "2": "cpu@bfloat16"}
        with torch.no_grad():
            torch.testing.assert_close(model(x), want, rtol=0.05, atol=0.05)


def test_a_plans_device_map_passed_as_devices_is_named_a_device_map() -> None:
    model = _model()
    device_map = adaptive.plan(model, devices={"cpu@bfloat16": 200, "cpu": None}).device_map
    with pytest.raises(TypeError, match=r"maps module names to devices: that is a device_map; "
                                        r"pass it as adaptive.split\(model, device_map=\.\.\.\)"):
        adaptive.split(model, device_map)
    with adaptive.split(model, device_map=device_map, example_inputs=torch.ones(1, 8)) as s:
        assert s.device_map == device_map


def test_a_device_map_value_naming_a_missing_gpu_names_its_entry() -> None:
    model = _model()
    with simulated_cuda(devices=2, total_memory="64MiB"):
        with pytest.raises(ValueError, match=r"^device_map\['1'\]='cuda:7' but only 2 CUDA "):
            adaptive.split(model, device_map={"0": "cuda:0", "1": "cuda:7"})
        with pytest.raises(ValueError, match=r"^device_map\['1'\]='cuda:7'"):
            adaptive.split(model, device_map={"0": 0, "1": 7})


@pytest.mark.parametrize("place", ["split float16", "chunk float16", "split cpu bfloat16"])
def test_converting_a_model_on_the_gpu_keeps_its_originals_in_host_memory(place: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).eval()  # 16 MiB
    x = torch.randn(2, 1024)
    expected = model(x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_cuda(devices=1, total_memory="24MiB"):
        model.cuda()
        if place == "split float16":  # 8 MiB once converted: fits beside nothing else
            handle = adaptive.split(model, {"cuda:0@float16": None}, example_inputs=x.cuda())
        elif place == "chunk float16":
            handle = adaptive.chunk(model, "cuda", capacity="12MiB", dtype=torch.float16,
                                    example_inputs=x.cuda())
        else:
            handle = adaptive.split(model, {"cpu@bfloat16": None}, example_inputs=x.cuda())
        gpu = sum(n for k, n in handle.plan.bytes_by_placement().items() if "cuda" in k)
        assert torch.cuda.memory_allocated() <= gpu + 64 * 1024
        torch.testing.assert_close(model(x.cuda()).cpu(), expected, atol=0.05, rtol=0.05)
        handle.remove()
        assert torch.cuda.memory_allocated() >= 16 * 2**20
        for name, value in model.state_dict().items():
            assert value.is_cuda and torch.equal(value.cpu(), before[name]), name
