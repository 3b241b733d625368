"""adaptive.chunk / adaptive.split. On the CPU, dtype boundaries stand in for device
boundaries: the resident part is bf16 on "cpu", the rest fp32 on "cpu".

Tolerance: outputs are compared to the fp32 model by relative L2 error,
||y - y_ref|| / ||y_ref|| < 5e-2. bf16 keeps 8 significant bits (unit roundoff 2**-8, 0.4%);
rounding weights and activations through 50-100 layers compounds that to a few percent at most
(measured with these seeds: resnet50 0.8%, densenet121 0.4%, inception_v3 3%, vit 0.8%).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from conftest import run_if
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import CallsItself, HeadFirst, WithEmptyLayer, hf_gpt2, hf_gpt2_example
from strategies import (
    DIM,
    SPLIT_WIDTH,
    build_tree_for_split,
    module_trees,
    module_trees_for_split,
    split_placements,
)
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from adaptmem import adaptive
from adaptmem._planning import module_sizes
from adaptmem.testing import simulated_cuda

BF16_RTOL = 5e-2


class NoMixedDtypes(TorchFunctionMode):
    """Fails any torch op whose floating tensor arguments differ in dtype.

    On a CPU, dtype boundaries stand in for device boundaries, but mixed dtypes are promoted
    silently where mixed devices would fail ("Expected all tensors to be on the same
    device"). Under this mode a dtype mix fails as loudly as a device mix would.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        dtypes = {x.dtype for x in pytree.tree_leaves((args, kwargs))
                  if isinstance(x, torch.Tensor) and x.is_floating_point()}
        # Tensor.to converts; setting .data is placement at a first call, not compute.
        if len(dtypes) > 1 and func is not torch.Tensor.to and func.__name__ != "__set__":
            raise AssertionError(f"{func} mixes {sorted(map(str, dtypes))}")
        return func(*args, **kwargs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def assert_bitwise(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    for k, v in after.items():
        assert v.dtype == before[k].dtype and v.device == before[k].device, k
        assert torch.equal(v.detach(), before[k]), k


class TinyLM(nn.Module):
    """A transformer called with keyword arguments, returning a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor, *, mask: torch.Tensor | None = None,
                scale: float = 1.0) -> dict[str, torch.Tensor]:
        h = self.enc(self.emb(ids) * scale, src_key_padding_mask=mask)
        return {"logits": self.head(h), "pooled": h.mean(1)}


def small_vit() -> nn.Module:
    # torchvision's VisionTransformer (the vit_b_16 class) at a size a 2-core CPU runs fast.
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=4, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10)
    nn.init.normal_(vit.heads.head.weight)  # torchvision zero-initialises it: all-zero output
    return vit


def vision(name: str, **kwargs: object):
    return lambda: torchvision.models.get_model(name, weights=None, **kwargs)


def image(size: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(1, 3, size, size)}


def tokens() -> dict[str, object]:
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 5:] = True
    return {"ids": ids, "mask": mask, "scale": 0.5}


CASES = {
    "resnet50": (vision("resnet50"), lambda: image(32)),
    "densenet121": (vision("densenet121"), lambda: image(32)),
    "inception_v3": (vision("inception_v3", init_weights=True, aux_logits=True), lambda: image(75)),
    "vit": (small_vit, lambda: image(32)),
    "transformer_kwargs": (TinyLM, tokens),
    "head_first": (HeadFirst, lambda: {"x": torch.randn(2, 32)}),
}


def first_output(out: object) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else out  # type: ignore[index,return-value]


@pytest.mark.parametrize("case", list(CASES))
def test_chunk_keeps_an_execution_ordered_bf16_prefix_and_matches_fp32(case: str) -> None:
    torch.manual_seed(0)
    factory, make_inputs = CASES[case]
    model = factory().eval()
    inputs = make_inputs()
    with torch.no_grad():
        ref = model(**inputs)
    before = snapshot(model)
    capacity = module_sizes(model).total_bytes // 4  # half the model, counted in bf16 bytes
    with adaptive.chunk(model, "cpu", capacity=capacity, dtype=torch.bfloat16) as chunker:
        assert chunker.plan is None  # placed at the first call, which learns the order
        with torch.no_grad():
            model(**inputs)
        with torch.no_grad(), NoMixedDtypes():
            out = model(**inputs)
        plan = chunker.plan
        assert plan is not None and plan.mode == "chunk"
        labels = [u.placement for u in plan.units]
        resident = labels.count("cpu@bfloat16")
        assert 0 < resident < len(labels)
        assert labels == ["cpu@bfloat16"] * resident + ["cpu"] * (len(labels) - resident)
        assert plan.options["placed_bytes"]["cpu@bfloat16"] <= capacity
        params = dict(model.named_parameters())
        for unit in plan.units:
            want = torch.bfloat16 if unit.placement == "cpu@bfloat16" else torch.float32
            for name in unit.tensors:
                if name in params:
                    assert params[name].dtype == want, name
        if isinstance(out, dict):
            for key in ref:
                assert out[key].dtype == ref[key].dtype
                assert rel_err(out[key], ref[key]) < BF16_RTOL, key
        else:
            assert out.dtype == torch.float32
            assert rel_err(out, ref) < BF16_RTOL
    assert_bitwise(model, before)


def test_units_follow_execution_order_not_registration_order() -> None:
    model = HeadFirst().eval()
    x = torch.randn(2, 32)
    body_bf16 = sum(p.numel() for p in model.body.parameters()) * 2
    chunker = adaptive.chunk(model, "cpu", capacity=body_bf16, dtype=torch.bfloat16,
                             example_inputs=x)
    assert [u.module for u in chunker.plan.units] == ["body.0", "body.2", "head"]
    assert chunker.device_map == {"body": "cpu@bfloat16", "head": "cpu"}
    assert model.head.weight.dtype == torch.float32
    chunker.remove()


def test_attention_weights_read_by_the_parent_stay_with_it() -> None:
    torch.manual_seed(0)
    model = small_vit().eval()
    x = torch.randn(1, 3, 32, 32)
    sizes = module_sizes(model)
    for cap in range(0, sizes.total_bytes // 2, sizes.total_bytes // 9):
        with adaptive.chunk(model, "cpu", capacity=cap, dtype=torch.bfloat16,
                            example_inputs=x) as chunker:
            attn = model.encoder.layers.encoder_layer_1.self_attention
            assert attn.in_proj_weight.dtype == attn.out_proj.weight.dtype
            units = [u for u in chunker.plan.units if u.module.endswith("self_attention")]
            assert all(any(t.endswith("out_proj.weight") for t in u.tensors) for u in units)
            with torch.no_grad():
                model(x)


def test_a_child_weight_read_without_calling_the_child_is_learned() -> None:
    tree = build_tree_for_split(("seq", "linear", "reads_child", "linear")).eval()
    splitter = adaptive.split(tree, {"cpu@bfloat16": 1, "cpu": None},
                              example_inputs=torch.randn(2, SPLIT_WIDTH))
    units = {u.module: u.tensors for u in splitter.plan.units}
    assert units["1"] == ("1.proj.weight", "1.proj.bias")
    splitter.remove()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=module_trees_for_split(), placements=split_placements(), seed=st.integers(0, 2**16))
def test_random_trees_split_over_dtype_placements_match_the_reference(
    spec: object, placements: list[tuple[torch.dtype, float]], seed: int
) -> None:
    torch.manual_seed(seed)
    model = build_tree_for_split(spec).eval()
    x = torch.randn(3, SPLIT_WIDTH)
    with torch.no_grad():
        ref = model(x)
    before = snapshot(model)
    total = module_sizes(model).total_bytes
    devices: dict[object, object] = {("cpu", dt): int(share * total) for dt, share in placements}
    devices["cpu"] = None
    with adaptive.split(model, devices) as splitter:
        with torch.no_grad():
            out = model(x)
        with torch.no_grad(), NoMixedDtypes():
            again = model(x)
        assert out.dtype == torch.float32 and torch.equal(out, again)
        if ref.norm() > 0:
            assert rel_err(out, ref) < BF16_RTOL
        seen: dict[str, str] = {}
        for unit in splitter.plan.units:
            for name in unit.tensors:
                assert name not in seen  # every tensor placed once
                seen[name] = unit.placement
        assert set(seen) == set(module_sizes(model).tensors)
    assert_bitwise(model, before)


def test_consecutive_units_on_one_device_do_not_ping_pong() -> None:
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).eval()
    layer_bf16 = (16 * 16 + 16) * 2
    splitter = adaptive.split(model, {"cpu@bfloat16": 2 * layer_bf16, "cpu": None},
                              example_inputs=torch.randn(1, 16))
    with torch.no_grad():
        model(torch.randn(1, 16))
    # fp32 -> bf16 entering layer 0, bf16 -> fp32 entering layer 2; nothing else.
    assert splitter.stats.boundary_crossings == 2
    assert splitter.stats.forwards == 1
    splitter.remove()


def test_outputs_go_back_to_the_caller_only_where_its_code_combines_them() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 32, 32)
    half = module_sizes(model).total_bytes // 4  # half the weights, in bf16 bytes
    with adaptive.chunk(model, "cpu", capacity=half, dtype=torch.bfloat16,
                        example_inputs=x) as chunker:
        stays = chunker._stays
        # ResNet's own code only pools and flattens layer4's output: it stays on the CPU
        # for fc instead of a round trip through the resident device.
        assert {"layer4", "fc", "conv1", "bn1"} <= stays
        # A residual block adds bn2's output to its input (or downsample's output).
        assert "layer4.0.bn2" not in stays and "layer4.0.downsample" not in stays
        chunker.stats.reset()
        with torch.no_grad(), NoMixedDtypes():
            model(x)
        # Into bf16 at conv1; in the boundary block layer4.0 (which computes in bf16, where
        # its first unit is): into fp32 at conv2 and downsample, back to bf16 for the
        # residual add twice; into fp32 at layer4.1. Nothing after that: no round trips.
        assert chunker.stats.boundary_crossings == 6


def test_editing_the_device_map_moves_exactly_the_named_units() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(5)]).eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = model(x)
    layer_bf16 = (16 * 16 + 16) * 2
    splitter = adaptive.split(model, {"cpu@bfloat16": 2 * layer_bf16, "cpu": None},
                              example_inputs=x)
    assert splitter.device_map == {"0": "cpu@bfloat16", "1": "cpu@bfloat16", "2": "cpu",
                                   "3": "cpu", "4": "cpu"}
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    edited = dict(splitter.device_map)
    edited["1"] = "cpu"
    edited["3"] = "cpu@bfloat16"
    splitter.device_map = edited
    assert splitter.device_map == edited
    for name, p in model.named_parameters():
        moved = name.split(".")[0] in ("1", "3")
        assert (p.data_ptr() != storage[name]) == moved, name
        assert p.dtype == (torch.bfloat16 if name.split(".")[0] in ("0", "3") else torch.float32)
    # A unit moved back to its own dtype gets the original tensor back, bit for bit.
    assert torch.equal(model[1][0].weight, splitter.load_targets()["1.0.weight"][0])
    with torch.no_grad():
        assert rel_err(model(x), ref) < BF16_RTOL
    # Plain device names work when they are unambiguous; unknown labels are refused.
    with pytest.raises(adaptive.PlacementError, match="cuda:7"):
        splitter.device_map = {"": "cuda:7"}
    splitter.remove()


def test_split_takes_an_accelerate_style_device_map() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)).eval()
    before = snapshot(model)
    splitter = adaptive.split(model, device_map={"0": "cpu@bfloat16", "1": "cpu",
                                                 "2": "cpu@bfloat16"})
    with torch.no_grad():
        model(torch.randn(1, 8))
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2 \
        + [torch.bfloat16] * 2
    splitter.remove()
    assert_bitwise(model, before)
    with pytest.raises(adaptive.PlacementError, match=r"without a device \(first: '2.weight'\)"):
        adaptive.split(model, device_map={"0": "cpu", "1": "cpu"},
                       example_inputs=torch.randn(1, 8))
    assert adaptive.split(model, device_map={"": "cpu"}).remove() is None


@run_if(cuda=True)
@pytest.mark.parametrize("placer", ["chunk", "split"])
def test_a_device_map_names_the_dtype_a_placement_converts_to_and_places_in_it_again(
    placer: str,
) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).eval()
    x = torch.randn(2, 64)
    handle = (adaptive.chunk(model, "cuda", capacity="1MiB", dtype=torch.float16,
                             example_inputs=x) if placer == "chunk"
              else adaptive.split(model, {"cuda:0@bfloat16": None}, example_inputs=x))
    label = "cuda:0@float16" if placer == "chunk" else "cuda:0@bfloat16"
    dtype = torch.float16 if placer == "chunk" else torch.bfloat16
    device_map = handle.device_map
    assert device_map == {"": label} and model[0].weight.dtype == dtype
    assert {u.placement for u in handle.plan.units} == {label}
    assert f"totals: {label} " in str(handle.plan)
    handle.remove()
    with adaptive.split(model, device_map=device_map) as again:  # the map round-trips
        with torch.no_grad():
            model(x.cuda())
        assert again.device_map == device_map
        assert [(p.device.type, p.dtype) for p in model.parameters()] == [("cuda", dtype)] * 4
    assert adaptive.plan(model, devices={label: None}, example_inputs=x).device_map == device_map


def test_inputs_a_user_pre_hook_produces_are_converted_for_the_module() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)).eval()
    model[1].register_forward_pre_hook(lambda m, args: (args[0].float(),))
    with adaptive.split(model, device_map={"0": "cpu@bfloat16", "1": "cpu@bfloat16",
                                           "2": "cpu"}), torch.no_grad():
        for _ in range(2):  # the first call also records the model
            assert model(torch.randn(1, 8)).dtype == torch.float32


def test_tied_tensors_are_never_duplicated() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(100, 16)
            self.body = nn.Linear(16, 16)
            self.lm_head = nn.Linear(16, 100, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.body(self.wte(ids)))

    model = Tied().eval()
    ids = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        ref = model(ids)
    splitter = adaptive.split(model, {"cpu@bfloat16": 100 * 16 * 2, "cpu": None},
                              example_inputs=ids)
    assert model.lm_head.weight is model.wte.weight
    assert model.wte.weight.dtype == torch.bfloat16 and model.body.weight.dtype == torch.float32
    assert splitter.device_map["lm_head"] == "cpu@bfloat16"  # goes where its tied owner went
    with torch.no_grad():
        out = model(ids)
    assert out.dtype == torch.float32 and rel_err(out, ref) < BF16_RTOL
    edited = dict(splitter.device_map)
    edited["lm_head"] = "cpu"
    with pytest.raises(adaptive.PlacementError, match="tied"):
        splitter.device_map = edited
    splitter.remove()


def test_inputs_nested_int_and_subclass_tensors_are_converted_right() -> None:
    seen: dict[str, torch.dtype] = {}

    class Sub(torch.Tensor):
        pass

    class Takes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, extra: dict, *, ids: torch.Tensor,
                    pair: tuple) -> tuple[torch.Tensor, torch.Tensor]:
            seen.update(x=x.dtype, inner=extra["a"][0].dtype, ids=ids.dtype, mask=pair[1].dtype,
                        sub=pair[0].dtype)
            return self.lin(x) + extra["a"][0] + pair[0], ids

    model = nn.ModuleDict({"t": Takes()})
    model.eval()
    inner = model["t"]
    splitter = adaptive.split(inner, {"cpu@float64": None})
    x = torch.randn(2, 4)
    sub = torch.randn(2, 4).as_subclass(Sub)
    with torch.no_grad():
        out, ids = inner(x, {"a": [torch.randn(2, 4)]}, ids=torch.arange(3),
                         pair=(sub, torch.ones(2, dtype=torch.bool)))
    assert seen == {"x": torch.float64, "inner": torch.float64, "ids": torch.int64,
                    "mask": torch.bool, "sub": torch.float64}
    assert out.dtype == torch.float32 and ids.dtype == torch.int64
    splitter.remove()


def test_remove_restores_every_tensor_bitwise_and_keeps_identity() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    before = snapshot(model)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    chunker = adaptive.chunk(model, "cpu", capacity="10MiB", dtype=torch.float16,
                             example_inputs=torch.randn(1, 3, 32, 32))
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert type(model.layer1[0]) is torchvision.models.resnet.BasicBlock
    chunker.remove()
    chunker.remove()  # twice is fine
    assert all(p is params[n] for n, p in model.named_parameters())
    assert_bitwise(model, before)
    assert model._forward_pre_hooks == {} and model.layer1[0].conv1._forward_hooks == {}



def test_a_removed_handle_places_the_model_nowhere_again() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    chunker = adaptive.chunk(model, "cpu", capacity="1MiB", dtype=torch.float16,
                             example_inputs=torch.randn(1, 4))
    chunker.remove()
    model.train()  # the model is the user's again, training included
    for move in (lambda: setattr(chunker, "device_map", {"": "cpu@float16"}),
                 lambda: chunker.place(device_map={"": "cpu@float16"}),
                 # once "the model is placed already; assign device_map ...", which failed
                 lambda: chunker.place(example_inputs=torch.randn(1, 4))):
        with pytest.raises(adaptive.PlacementError, match=r"removed.*adaptive\.chunk\(model"):
            move()
        # Not converted again behind the user's back, with no hooks to undo it.
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert model._forward_pre_hooks == {}


def test_a_forward_that_raises_passes_through_and_the_next_call_works() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    splitter = adaptive.split(model, {"cpu@bfloat16": 40, "cpu": None},
                              example_inputs=torch.randn(1, 4))
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(1, 5))
    assert "shapes" in str(info.value) or "size" in str(info.value)
    assert model(torch.randn(1, 4)).dtype == torch.float32
    splitter.remove()


@pytest.mark.gpu
@run_if(cuda=True)
@pytest.mark.parametrize("placer", ["chunk", "split", pytest.param(
    "split_output_device", marks=run_if(cuda=True, min_gpus=2))])  # output on cuda:1
def test_a_model_that_calls_itself_is_one_forward_with_outputs_where_the_caller_wants(
        placer: str) -> None:
    torch.manual_seed(0)
    model = CallsItself().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = {d: copy.deepcopy(model).cuda()(x.cuda(), d).cpu() for d in (0, 2)}
    a_bytes = module_sizes(model).total_bytes // 2
    handle = {"chunk": lambda: adaptive.chunk(model, "cuda", capacity=a_bytes),
              "split": lambda: adaptive.split(model, {"cuda:0": a_bytes, "cpu": None}),
              "split_output_device": lambda: adaptive.split(
                  model, {"cuda:0": a_bytes, "cpu": None}, output_device="cuda:1")}[placer]()
    home = "cuda" if placer == "split_output_device" else "cpu"
    with handle, torch.no_grad():
        # The first call, which places the model, takes the path that combines outputs (see
        # limitations: placement learns from that forward which outputs need handing back).
        for depth in (2, 0, 2, 0):
            out = model(x, depth)
            # The inner calls hand their outputs to the outer forward, which hands the sum to
            # the caller: on the caller's device (or output_device), not where the model
            # computed its last part.
            assert out.device.type == home, (depth, out.device)
            torch.testing.assert_close(out.cpu(), expected[depth])
        assert handle.stats.forwards == 4  # the inner calls are part of the outer one
        assert {d.type for d in map(torch.device, handle.device_map.values())} == {"cuda", "cpu"}
        # A forward interrupted past its hooks leaves its frames behind; the next call of the
        # model is not taken for a call from inside it.
        model.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            model(x)
        model.interrupt = False
        out = model(x, 2)
        assert out.device.type == home
        torch.testing.assert_close(out.cpu(), expected[2])


def test_load_targets_name_every_tensor_and_fill_in_place() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
    chunker = adaptive.chunk(model, "cpu", capacity=40, dtype=torch.bfloat16,
                             example_inputs=torch.randn(2, 4))
    targets = chunker.load_targets()
    assert list(targets) == list(module_sizes(model).tensors)
    assert len(targets["0.weight"]) == 2  # placed bf16 copy + the kept fp32 original
    assert len(targets["2.weight"]) == 1  # not converted: nothing kept
    for tensors in targets.values():
        for t in tensors:
            t.fill_(3)
    assert torch.all(model[0].weight == 3) and model[0].weight.dtype == torch.bfloat16
    assert torch.all(model[1].running_var == 3) and torch.all(model[2].bias == 3)
    chunker.remove()
    assert model[0].weight.dtype == torch.float32 and torch.all(model[0].weight == 3)


def test_a_meta_model_can_be_placed_for_the_loader_and_filled_in_place() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).eval()
    x = torch.ones(1, 4)
    params = list(model.parameters())
    chunker = adaptive.chunk(model, "cpu", capacity=40, dtype=torch.bfloat16,
                             example_inputs=x.to("meta"), _allow_meta=True)
    assert not any(p.is_meta for p in model.parameters())
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    for tensors in chunker.load_targets().values():
        assert len(tensors) == 1  # nothing to keep: the originals were meta
        for t in tensors:
            t.fill_(0.5)
    with torch.no_grad():
        out = model(x)
    assert torch.equal(out, torch.full((1, 2), 5.5))  # (4 * 0.5 + 0.5) * 0.5 * 4 + 0.5
    edited = dict(chunker.device_map)
    edited["0"] = "cpu"
    chunker.device_map = edited  # re-placed from the filled values, not from meta
    assert torch.all(model[0].weight == 0.5) and model[0].weight.dtype == torch.float32
    chunker.remove()
    assert all(p.is_meta for p in model.parameters())
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))


def test_a_model_built_under_inference_mode_is_refused_before_anything_changes() -> None:
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).eval()
    before = snapshot(model)
    x = torch.randn(1, 4)
    with pytest.raises(adaptive.PlacementError, match="inference tensor"):
        adaptive.chunk(model, "cpu", capacity=10, dtype=torch.bfloat16, example_inputs=x)
    with pytest.raises(adaptive.PlacementError, match="inference tensor"):
        adaptive.split(model, {"cpu@bfloat16": 10, "cpu": None}, example_inputs=x)
    assert_bitwise(model, before)
    assert model._forward_pre_hooks == {}


def test_refusals_name_the_problem_and_leave_the_model_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = snapshot(model)
    with pytest.raises(adaptive.PlacementError, match="eval"):
        adaptive.chunk(model, "cpu", capacity=10)
    model.eval()
    with pytest.raises(ValueError, match="capacity='lots'"):
        adaptive.chunk(model, "cpu", capacity="lots")
    with pytest.raises(ValueError, match="capacity"):
        adaptive.chunk(model, "cpu", capacity=-5)
    with pytest.raises(ValueError, match="device='warp:0'"):
        adaptive.chunk(model, "warp:0", capacity=10)
    with pytest.raises(TypeError, match="dtype"):
        adaptive.chunk(model, "cpu", capacity=10, dtype=torch.int8)
    with pytest.raises(TypeError, match="devices"):
        adaptive.split(model, "cpu")
    with pytest.raises(ValueError, match="same device and dtype"):
        adaptive.split(model, {"cpu": 10, ("cpu", None): None})
    with pytest.raises(adaptive.PlacementError, match="capacity"):
        adaptive.split(model, {"cpu@bfloat16": 10}, example_inputs=torch.randn(1, 4))
    assert_bitwise(model, before)
    assert model._forward_pre_hooks == {}
    handle = adaptive.chunk(model, "cpu", capacity=10, dtype=torch.bfloat16)
    with pytest.raises(adaptive.PlacementError, match="already placed"):
        adaptive.split(model, {"cpu": None})
    with pytest.raises(adaptive.PlacementError, match="already placed"):
        adaptive.chunk(model[0], "cpu", capacity=10)
    handle.remove()
    with torch.device("meta"):
        meta = nn.Linear(4, 4).eval()
    with pytest.raises(adaptive.PlacementError, match="adaptive.load"):
        adaptive.chunk(meta, "cpu", capacity=10)


def test_a_model_that_cannot_run_on_meta_is_recorded_for_real() -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(x) if x.sum().item() > 0 else self.a(x)

    model = DataDependent().eval()
    x = torch.ones(1, 4)
    splitter = adaptive.split(model, {"cpu@bfloat16": 40, "cpu": None}, example_inputs=x)
    assert [u.module for u in splitter.plan.units][0] == "b"
    assert model(x).dtype == torch.float32
    splitter.remove()


@pytest.mark.gpu
@run_if(cuda=True)
def test_chunk_on_cuda_keeps_half_resident_and_matches() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    x = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        ref = model(x)
    half = module_sizes(model).total_bytes // 2
    with adaptive.chunk(model, "cuda", capacity=half) as chunker:
        with torch.no_grad():
            out = model(x.cuda())
        assert out.device.type == "cuda"
        placed = chunker.plan.options["placed_bytes"]
        assert 0 < placed["cuda:0"] <= half and placed["cpu"] > 0
        assert rel_err(out.cpu(), ref) < 1e-2  # cuDNN may use TF32 for convolutions
        with torch.no_grad():
            assert model(x).device.type == "cpu"


@pytest.mark.gpu
@run_if(cuda=True)
def test_split_over_cuda_and_cpu_with_fp16_matches() -> None:
    torch.manual_seed(0)
    model = TinyLM().eval()
    inputs = tokens()
    with torch.no_grad():
        ref = model(**inputs)
    third = module_sizes(model).total_bytes // 3
    with adaptive.split(model, {"cuda:0": third, "cpu": None}, dtype={"cuda:0": torch.float16},
                        example_inputs=inputs) as splitter:
        assert set(splitter.device_map.values()) == {"cuda:0@float16", "cpu"}
        with torch.no_grad():
            out = model(**inputs)
        assert out["logits"].device.type == "cpu"
        assert rel_err(out["logits"], ref["logits"]) < BF16_RTOL


def test_auto_capacity_is_free_memory_minus_the_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    import adaptmem._common.headroom as headroom
    import adaptmem._planning.targets as placement

    gib = 2**30
    monkeypatch.setattr(headroom, "memory_info", lambda device: (3 * gib, 10 * gib))
    assert placement.auto_capacity(torch.device("cpu")) == (2 * gib, gib)  # 10% of total
    monkeypatch.setattr(headroom, "memory_info", lambda device: (3 * gib, 2 * gib))
    assert placement.auto_capacity(torch.device("cpu"))[1] == 512 * 2**20  # the floor
    assert placement.auto_capacity(torch.device("cpu"), "1GiB") == (2 * gib, gib)
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    with adaptive.chunk(model, "cpu", dtype=torch.bfloat16, reserve="2.5GiB",
                        example_inputs=torch.randn(1, 4)) as chunker:
        assert chunker.plan.options["capacity"] == gib // 2
        assert model[0].weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="reserve"):
        adaptive.chunk(model, "cpu", capacity=10, reserve="1GiB")
    monkeypatch.setattr(headroom, "memory_info", lambda device: (gib, 80 * gib))
    assert placement.auto_capacity(torch.device("cpu")) == (gib // 2, gib // 2)  # half of free


def test_split_over_a_list_of_devices_and_output_device() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).eval()
    with adaptive.split(model, ["cpu"], output_device="cpu") as splitter:
        assert model(torch.randn(1, 4)).device.type == "cpu"
        assert splitter.device_map == {"": "cpu"}
        assert "Splitter(cpu" in repr(splitter)


def test_two_threads_making_the_first_call_place_the_model_once() -> None:
    import threading

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]).eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = model(x)
    outputs: list[torch.Tensor] = []
    with adaptive.split(model, {"cpu@bfloat16": 3 * (16 * 16 + 16) * 2, "cpu": None}):
        def call() -> None:
            with torch.no_grad():
                outputs.append(model(x))

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(outputs) == 4
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
        assert hooks == 2 + 2 * 6  # root hooks plus one pair per layer, once
        for out in outputs:
            assert rel_err(out, ref) < BF16_RTOL


def test_chunk_and_split_are_exported() -> None:
    for name in ("chunk", "split", "Chunker", "Splitter"):
        assert name in adaptive.__all__ and hasattr(adaptive, name)


def test_docstring_examples_run() -> None:
    import doctest

    import adaptmem._placement.api as placement

    result = doctest.testmod(placement)
    assert result.attempted > 0 and result.failed == 0


def test_place_with_example_inputs_places_a_lazy_handle_now_and_only_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).eval()
    x = torch.randn(1, 8)
    with torch.no_grad():
        ref = model(x)
    with adaptive.chunk(model, "cpu", capacity=8 * 9 * 2, dtype=torch.bfloat16) as chunker:
        assert chunker.plan is None
        chunker.place(example_inputs=x)
        assert chunker.device_map == {"0": "cpu@bfloat16", "1": "cpu"}
        assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
        with pytest.raises(adaptive.PlacementError, match="placed already"):
            chunker.place({"0": "cpu", "1": "cpu"}, example_inputs=x)
        assert chunker.device_map == {"0": "cpu@bfloat16", "1": "cpu"}  # nothing applied
        with pytest.raises(TypeError, match="device_map .* or example_inputs"):
            chunker.place()
        with torch.no_grad():
            assert rel_err(model(x), ref) < BF16_RTOL
    assert model[0].weight.dtype == torch.float32


def test_a_bad_device_map_fails_at_split_not_at_the_first_forward() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).eval()
    with pytest.raises(adaptive.PlacementError, match="without a device"):
        adaptive.split(model, {"cpu": None}, device_map={"0": "cpu"})
    with pytest.raises(adaptive.PlacementError, match="neither modules nor tensors"):
        adaptive.split(model, {"cpu": None}, device_map={"zzz": "cpu", "": "cpu"})
    with pytest.raises(adaptive.PlacementError, match="not among"):
        adaptive.split(model, {"cpu": None}, device_map={"0": "cuda:7", "1": "cpu"})
    assert not model._forward_pre_hooks
    splitter = adaptive.split(model, {"cpu": None}, device_map={"0": "cpu", "1": "cpu"})
    assert splitter.device_map == {"0": "cpu", "1": "cpu"}  # known before the first call
    splitter.remove()


# -- what placement must never do to a model or to the caller's objects ---------------------


class TwoNames(nn.Module):
    """``a`` is also ``b.0`` and ``layers[0]``; ``c.weight`` is tied to ``b.1.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Sequential(self.a, nn.Linear(8, 8))
        self.layers = nn.ModuleList([self.a])
        self.c = nn.Linear(8, 8)
        self.c.weight = self.b[1].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(x))


def identities(model: nn.Module) -> dict[str, int]:
    return {k: id(v) for k, v in model.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("how", ["split", "chunk_bf16", "first_call"])
def test_a_module_or_tensor_under_several_names_keeps_its_weights_and_remove_restores_them(
    how: str,
) -> None:
    torch.manual_seed(0)
    model = TwoNames().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
    before, ids = snapshot(model), identities(model)
    if how == "split":
        handle = adaptive.split(model, {"cpu": None}, example_inputs=x)
    elif how == "chunk_bf16":
        handle = adaptive.chunk(model, "cpu", capacity=(8 * 8 + 8) * 2, dtype=torch.bfloat16,
                                example_inputs=x)
    else:
        handle = adaptive.split(model, {"cpu@float64": (8 * 8 + 8) * 8, "cpu": None})
    assert not any(t.is_meta for t in model.state_dict().values())
    with torch.no_grad():
        out = model(x)
    if how == "chunk_bf16":
        assert rel_err(out, ref) < BF16_RTOL
    else:
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    handle.remove()
    assert_bitwise(model, before)
    assert identities(model) == ids


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=module_trees(), placements=split_placements(), seed=st.integers(0, 2**16))
def test_random_trees_with_shared_modules_keep_every_tensor_through_placement_and_remove(
    model: nn.Module, placements: list[tuple[torch.dtype, float]], seed: int
) -> None:
    """Trees from the paging strategy: a module under two names called through both, a
    module called twice, parents reading a child's weight, own parameters and buffers."""
    torch.manual_seed(seed)
    x = torch.randn(3, DIM)
    with torch.no_grad():
        ref = model(x)
    before, ids = snapshot(model), identities(model)
    total = module_sizes(model).total_bytes
    devices: dict[object, object] = {("cpu", dt): int(share * total) for dt, share in placements}
    devices["cpu"] = None
    with adaptive.split(model, devices):
        with torch.no_grad():
            out = model(x)  # placed at this call
        assert not any(t.is_meta for t in model.state_dict().values())
        if ref.norm() > 0:
            assert rel_err(out, ref) < BF16_RTOL
    assert_bitwise(model, before)
    assert identities(model) == ids


class CachesAnchors(nn.Module):
    """Builds a tensor from its own state at the first forward and keeps it (anchor caches),
    and rebinds a buffer to a new tensor on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("base", torch.randn(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.anchors: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.anchors is None:
            self.anchors = self.base * 2
        self.calls = self.calls + 1
        return self.lin(x) + self.anchors


def test_tensors_the_model_keeps_from_the_recorded_forward_leave_no_trace() -> None:
    torch.manual_seed(0)
    model = CachesAnchors().eval()
    twin = CachesAnchors().eval()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    splitter = adaptive.split(model, {"cpu@float64": 16 * 8, "cpu": None}, example_inputs=x)
    assert model.anchors is None and int(model.calls) == 0  # the recording ran on a copy
    with torch.no_grad():
        for _ in range(2):
            assert torch.allclose(model(x), twin(x))
    assert not model.anchors.is_meta and int(model.calls) == 2
    splitter.remove()
    assert int(model.calls) == 2 and model.calls.dtype == torch.long


class WritesIntoCache(nn.Module):
    """Appends what each layer computes to a cache object the caller passes (like a
    Hugging Face ``DynamicCache``)."""

    class Cache:
        def __init__(self) -> None:
            self.entries: list[torch.Tensor] = []

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, cache: WritesIntoCache.Cache) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            cache.entries.append(x)
        return x


@pytest.mark.parametrize("with_example_inputs", [False, True])
def test_objects_the_caller_passes_get_nothing_from_the_recorded_forward(
    with_example_inputs: bool,
) -> None:
    torch.manual_seed(0)
    model = WritesIntoCache().eval()
    x = torch.randn(1, 4)
    cache = WritesIntoCache.Cache()
    example = (x, cache) if with_example_inputs else None
    with adaptive.split(model, {"cpu@float64": 20 * 8, "cpu": None}, example_inputs=example):
        assert cache.entries == []
        fresh = WritesIntoCache.Cache()
        with torch.no_grad():
            model(x, fresh)  # the first call places the model when no example was given
        assert len(fresh.entries) == 3 and not any(t.is_meta for t in fresh.entries)
        assert cache.entries == []


class StepCounter(nn.Module):
    """Cannot run on meta (``.item()``); advances an int step and a float running sum, and
    draws random numbers, on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        self.total += x.sum(0)
        noise = torch.rand(()) if self.step.item() % 2 else torch.zeros(())
        return self.lin(x) * self.step + self.total + noise


def test_a_model_recorded_for_real_keeps_its_buffers_and_random_state(
    adaptmem_log: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = StepCounter().eval()
    twin = StepCounter().eval()
    twin.load_state_dict(model.state_dict())
    xs = [torch.randn(2, 4) for _ in range(3)]
    rng = torch.get_rng_state()
    splitter = adaptive.split(model, {"cpu@float64": 20 * 8, "cpu": None},
                              example_inputs=xs[0])
    assert "recording a real forward" in adaptmem_log.text
    assert torch.equal(torch.get_rng_state(), rng)
    # The real forward ran on a copy of the buffers.
    assert int(model.step) == 0 and torch.equal(model.total, torch.zeros(4, dtype=torch.float64))
    torch.manual_seed(1)
    with torch.no_grad():
        placed = [model(x) for x in xs]
    torch.manual_seed(1)
    with torch.no_grad():
        unplaced = [twin(x) for x in xs]
    for a, b in zip(placed, unplaced, strict=True):
        assert torch.allclose(a, b, rtol=1e-6)
    splitter.remove()
    assert model.step.dtype == torch.long and model.total.dtype == torch.float32
    assert int(model.step) == int(twin.step) == 3
    assert torch.allclose(model.total, twin.total)
    before = snapshot(model)
    adaptive.split(model, {"cpu": None}, example_inputs=xs[0]).remove()
    assert_bitwise(model, before)


def test_a_model_that_cannot_be_copied_for_recording_is_refused_clearly() -> None:
    import threading

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    model.lock = threading.Lock()  # type: ignore[assignment]
    before = snapshot(model)
    with pytest.raises(adaptive.PlacementError, match="deep-copied.*lock"):
        adaptive.split(model, {"cpu": None}, example_inputs=torch.randn(1, 4))
    assert_bitwise(model, before)
    assert not model._forward_pre_hooks


# -- ties whose owner never runs (T5's layout) ------------------------------------------------


class SharedEmbedding(nn.Module):
    """T5's layout: ``shared`` owns the embedding, ``emb`` and ``head`` use it; ``shared``
    itself is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(1000, 16)
        self.emb = nn.Embedding(1000, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1000, bias=False)
        self.emb.weight = self.shared.weight
        self.head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids)))


@pytest.mark.parametrize("capacity", [10_000, 40_000])
def test_a_tied_weight_whose_owner_is_never_called_is_placed_with_its_users(
    capacity: int,
) -> None:
    torch.manual_seed(0)
    model = SharedEmbedding().eval()
    ids = torch.randint(0, 1000, (2, 5))
    with torch.no_grad():
        ref = model(ids)
    before = snapshot(model)
    with adaptive.chunk(model, "cpu", capacity=capacity, dtype=torch.bfloat16) as chunker:
        with torch.no_grad():
            first = model(ids)  # placed at this call
        with torch.no_grad(), NoMixedDtypes():
            out = model(ids)
        assert torch.equal(first, out) and rel_err(out, ref) < BF16_RTOL
        resident = capacity >= 1000 * 16 * 2
        assert model.shared.weight.dtype == (torch.bfloat16 if resident else torch.float32)
        owner = next(u for u in chunker.plan.units if "shared.weight" in u.tensors)
        assert owner.module == "emb"  # the first unit that runs with it owns it
        places = {u.module: u.placement for u in chunker.plan.units}
        assert places["emb"] == places["head"] == places["shared"]
    assert_bitwise(model, before)


# -- plan and split agree ---------------------------------------------------------------------


class WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0])


def test_plan_counts_bytes_in_the_dtype_of_each_device_key_and_takes_a_list() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    layer_bf16 = (64 * 64 + 64) * 2
    for key in ("cpu@bfloat16", ("cpu", torch.bfloat16)):
        p = adaptive.plan(model, devices={key: layer_bf16, "cpu": None})
        assert p.device_map == {"0": "cpu@bfloat16", "1": "cpu"}
        assert p.options["placed_bytes"]["cpu@bfloat16"] == layer_bf16
    assert adaptive.plan(model, devices=["cpu"]).device_map == {"": "cpu"}
    # Devices are named, not probed: plan for a machine you are not on.
    assert adaptive.plan(model, devices={"cuda:3": None}).device_map == {"": "cuda:3"}
    with pytest.raises(ValueError, match="not a device name"):
        adaptive.plan(model, devices={"warp:0": None})
    if not torch.cuda.is_available():  # "auto" reads the device's free memory
        with pytest.raises(ValueError, match="capacity 'auto'.*give bytes, e.g. {'cuda:0': '20GiB'}"):
            adaptive.plan(model, devices=["cuda:0"])
    with pytest.raises(TypeError, match="unit_bytes"):
        adaptive.plan(model, devices=["cpu"], unit_bytes=10)


@run_if(cuda=True)
@pytest.mark.parametrize("how", ["split", "chunk", "split bfloat16"])
def test_a_model_loaded_where_its_plan_puts_it_is_then_placed_by_that_plan(
        how: str, tmp_path: Path) -> None:
    # plan -> load(device=plan) -> split(device_map=plan.device_map): the model is on two
    # devices before any boundary exists, and a Hugging Face model given an attention mask
    # cannot run on meta, so its first forward is recorded for real (it mixed devices).
    torch.manual_seed(0)
    reference = hf_gpt2()
    torch.save(reference.state_dict(), tmp_path / "gpt2.pt")
    inputs = {**hf_gpt2_example(), "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    with torch.no_grad():
        want = reference(**inputs).logits
    dtype = torch.bfloat16 if how.endswith("bfloat16") else None
    devices = {"cuda:0": "24KiB", "cpu": None}
    plan = adaptive.plan(adaptive.empty_model(hf_gpt2), devices=devices, dtype=dtype)
    model = adaptive.load(hf_gpt2, tmp_path / "gpt2.pt", device=plan)
    assert {p.device.type for p in model.parameters()} == {"cuda", "cpu"}
    handle = (adaptive.chunk(model, "cuda", capacity="24KiB")
              if how == "chunk" else adaptive.split(model, device_map=plan.device_map))
    with handle, torch.no_grad():
        got = model(**{k: v.cuda() for k, v in inputs.items()}).logits.cpu()
    if dtype is None:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        assert rel_err(got, want) < BF16_RTOL


def test_plan_and_split_give_the_same_map_and_split_takes_the_plans_map() -> None:
    torch.manual_seed(0)
    model = WithAttention().eval()
    x = torch.randn(2, 3, 16)
    sizes = module_sizes(model)
    for cap in range(0, sizes.total_bytes // 2, sizes.total_bytes // 12):
        devices = {"cpu@bfloat16": cap, "cpu": None}
        planned = adaptive.plan(model, devices=devices, example_inputs=x)
        assert "attn.in_proj_weight" not in planned.device_map  # attention stays whole
        with adaptive.split(model, devices, example_inputs=x) as splitter:
            assert splitter.device_map == planned.device_map
        with adaptive.split(model, devices, device_map=planned.device_map,
                            example_inputs=x) as splitter:
            assert splitter.device_map == planned.device_map


def small_maxvit() -> nn.Module:
    from torchvision.models.maxvit import MaxVit

    return MaxVit(input_size=(32, 32), stem_channels=16, partition_size=2,
                  block_channels=[16, 32], block_layers=[1, 1], head_dim=8,
                  stochastic_depth_prob=0.0)


@pytest.mark.parametrize("name", ["swin_t", "maxvit"])
def test_windowed_attention_blocks_are_kept_whole_by_plan_as_by_split(name: str) -> None:
    torch.manual_seed(0)
    if name == "swin_t":
        model, x = torchvision.models.swin_t(weights=None).eval(), torch.randn(1, 3, 64, 64)
    else:
        model, x = small_maxvit().eval(), torch.randn(1, 3, 32, 32)
    total = module_sizes(model).total_bytes
    for share in (0.25,):
        devices = {"cpu@bfloat16": int(share * total / 2), "cpu": None}
        planned = adaptive.plan(model, devices=devices, example_inputs=x.to("meta"))
        with adaptive.split(model, devices, example_inputs=x) as splitter:
            assert splitter.device_map == planned.device_map
        # split takes the plan's map: it splits no block whose weights are read together.
        with adaptive.split(model, devices, device_map=planned.device_map,
                            example_inputs=x) as splitter:
            assert splitter.device_map == planned.device_map
            with torch.no_grad(), NoMixedDtypes():
                model(x)


@pytest.mark.parametrize("engine", ["split", "page"])
def test_plan_of_a_model_an_engine_holds_records_without_its_hooks(engine: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    x = torch.randn(1, 4)
    devices = {"cpu@bfloat16": 40, "cpu": None}
    expected = adaptive.plan(model, devices=devices, example_inputs=x).device_map
    handle = (adaptive.split(model, devices, example_inputs=x) if engine == "split"
              else adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0))
    with handle, torch.no_grad():
        out = model(x)
        assert adaptive.plan(model, devices=devices, example_inputs=x).device_map == expected
        assert torch.equal(model(x), out)


def test_device_map_before_the_first_call_says_how_to_get_one() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    with adaptive.split(model, {"cpu@bfloat16": 40, "cpu": None}) as splitter:
        with pytest.raises(adaptive.PlacementError, match="example_inputs=.*adaptive.plan"):
            splitter.device_map  # noqa: B018
        with torch.no_grad():
            model(torch.randn(1, 4))
        assert splitter.device_map == {"0": "cpu@bfloat16", "1": "cpu"}


# -- acceptance: the paging zoo and Hugging Face models, placed at the first call -------------


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                      n_positions=32, bos_token_id=0, eos_token_id=1,
                                      pad_token_id=0))


def _hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=100,
                                        max_position_embeddings=64, bos_token_id=0,
                                        eos_token_id=1, pad_token_id=0))


def _hf_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    # T5's layout: `shared` is tied to both embed_tokens and lm_head and never called.
    return T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=2,
                                               num_heads=2, vocab_size=100,
                                               decoder_start_token_id=0, pad_token_id=0,
                                               eos_token_id=1))


HF = {"hf_gpt2": _hf_gpt2, "hf_llama": _hf_llama, "hf_t5": _hf_t5}


def _zoo_case(name: str) -> tuple[nn.Module, tuple[object, ...], dict[str, object]]:
    if name in HF:
        torch.manual_seed(0)
        model = HF[name]().eval()
        ids = torch.randint(2, 100, (2, 6))
        kwargs: dict[str, object] = {"input_ids": ids}
        if name == "hf_t5":
            kwargs["decoder_input_ids"] = torch.randint(2, 100, (2, 3))
        return model, (), kwargs
    from models import ZOO

    model, args, kwargs = ZOO[name]()
    for p in model.parameters():  # torchvision zero-initialises some heads: all-zero outputs
        if p.is_floating_point() and not p.any():
            nn.init.normal_(p, std=0.05)
    return model, args, kwargs


def _logits(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out["logits"]  # type: ignore[index,return-value]


def _zoo_cases() -> list[tuple[str, str]]:
    from models import ZOO

    # chunk is split over {device@dtype: capacity, "cpu": None}: the same code, so it runs on
    # the cheap models only, the first calls inside generate() among them.
    return [(name, "split") for name in [*ZOO, *HF]] + [(name, "chunk") for name in HF]


@pytest.fixture
def one_thread() -> Any:
    """Tiny forwards: on a busy 2-core machine thread hand-offs cost more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("name", "engine"), _zoo_cases())
def test_zoo_and_hugging_face_models_placed_at_the_first_call_match_and_restore(
    name: str, engine: str, one_thread: None
) -> None:
    """Every model of the paging zoo plus GPT-2, LLaMA and T5 configs: placed at the first
    call (``generate``'s, for the Hugging Face models), with a float64 prefix standing in
    for a second device (the outputs match the float32 model to rounding), the same map as
    ``adaptive.plan``, and ``remove()`` giving every tensor back bitwise, same objects."""
    model, args, kwargs = _zoo_case(name)
    with torch.no_grad():
        ref = _logits(model(*args, **kwargs))
    generate = dict(max_new_tokens=3, do_sample=False)
    ref_tokens = model.generate(kwargs["input_ids"], **generate) if name in HF else None
    before, ids = snapshot(model), identities(model)
    total = module_sizes(model).total_bytes
    devices = {"cpu@float64": total, "cpu": None}  # about half the model, in float64 bytes
    example = args[0] if args else kwargs
    planned = adaptive.plan(model, devices=devices, example_inputs=example)
    if engine == "split":
        handle = adaptive.split(model, devices)
    else:
        handle = adaptive.chunk(model, "cpu", capacity=total, dtype=torch.float64)
    # T5's layer norm computes in float32 whatever its input (and converts back only to half
    # types): its own code mixes float32 with a float64 input, placed or not.
    strict = NoMixedDtypes() if name != "hf_t5" else contextlib.nullcontext()
    with handle, torch.no_grad(), strict:
        if ref_tokens is not None:  # generate makes the first call, with its own cache
            assert torch.equal(model.generate(kwargs["input_ids"], **generate), ref_tokens)
            assert torch.equal(model.generate(kwargs["input_ids"], **generate), ref_tokens)
        out = _logits(model(*args, **kwargs))
        assert out.dtype == ref.dtype and rel_err(out, ref) < 1e-5
        placed = handle.plan.options["placed_bytes"]
        assert 0 < placed["cpu@float64"] <= total and placed["cpu"] > 0
        if name != "hf_t5":
            assert handle.device_map == planned.device_map
        # else: generate's first call to T5 passes encoder_outputs, so that forward (which
        # decides the placement) runs only the decoder; the plan's example ran both.
    assert_bitwise(model, before)
    assert identities(model) == ids


def test_t5_chunked_in_bfloat16_generates_and_matches() -> None:
    """T5's ``shared`` embedding (tied to both ``embed_tokens`` and ``lm_head``, never called)
    goes with its first user, so a bfloat16 prefix computes in one dtype."""
    model, _, kwargs = _zoo_case("hf_t5")
    with torch.no_grad():
        ref = model(**kwargs).logits
    total = module_sizes(model).total_bytes
    with adaptive.chunk(model, "cpu", capacity=total // 4, dtype=torch.bfloat16,
                        example_inputs=kwargs) as chunker:
        places = {u.module: u.placement for u in chunker.plan.units}
        assert places["shared"] == places["encoder.embed_tokens"] == places["lm_head"]
        assert model.shared.weight.dtype == torch.bfloat16
        tokens = model.generate(kwargs["input_ids"], max_new_tokens=3, do_sample=False)
        assert tokens.shape == (2, 4)
        with torch.no_grad():
            assert rel_err(model(**kwargs).logits, ref) < BF16_RTOL


def test_a_tie_that_would_overflow_a_device_moves_on_to_the_next_instead_of_failing() -> None:
    """A buffer placed first (32 B) is also the buffer of a later module (136 B more): that
    module must follow it, so the first device's prefix ends before the tie (150 B)."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(8, 8)
            self.bn = nn.BatchNorm1d(8)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
            self.bn.register_buffer("scale", self.scale)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.emb(x) * self.scale)

    model = Tied().eval()
    x = torch.randn(4, 8)
    expected = model(x)
    plan = adaptive.plan(model, devices={"cpu@float64": 150, "cpu": None}, example_inputs=x)
    assert plan.options["placed_bytes"]["cpu@float64"] <= 150
    with adaptive.split(model, {"cpu@float64": 150, "cpu": None}, example_inputs=x) as s:
        assert s.device_map == plan.device_map
        torch.testing.assert_close(model(x), expected)


class MixedFloats(nn.Module):
    """bfloat16 layers, then float16 ones; the forward converts between them itself."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        self.layers[:2].to(torch.bfloat16)
        self.layers[2:].half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x.to(layer.weight.dtype))
        return x


@pytest.mark.gpu
@pytest.mark.parametrize("share", [0.0, 0.5, 2.0])
def test_chunk_of_a_model_mixing_float_dtypes_gives_each_layer_its_own_dtype(
        share: float) -> None:
    torch.manual_seed(0)
    model = MixedFloats().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    capacity = int(module_sizes(model).total_bytes * share)
    with adaptive.chunk(model, "cuda", capacity=capacity), torch.no_grad():
        out = model(x)
    assert out.device == x.device and out.dtype == torch.float16
    assert torch.equal(out, expected)


class _TokensToLogits(nn.Module):
    def __init__(self, final_cast: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50)
        self.final_cast = final_cast

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(self.emb(ids)).float())
        return logits.to(torch.bfloat16) if self.final_cast else logits


@pytest.mark.parametrize("final_cast", [False, True])
@pytest.mark.parametrize("loaded", ["bfloat16 parts loaded so", "float32 throughout"])
def test_outputs_of_a_call_given_token_ids_come_back_in_the_dtype_the_model_gives(
        loaded: str, final_cast: bool) -> None:
    """The model takes no floating input, so its outputs come back in the dtype its recorded
    forward gave them: float32 logits from a float32 head, also when the parts before it
    were loaded in bfloat16 for a plan's bfloat16 device (``load(device=plan)``), and what
    the model casts to itself. A part called on its own keeps its own dtype."""
    torch.manual_seed(0)
    model = _TokensToLogits(final_cast).eval()
    if loaded.startswith("bfloat16"):
        model.emb.to(torch.bfloat16)
        model.body.to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        reference = copy.deepcopy(model)
        expected, embedded = reference(ids), reference.emb(ids)
        with adaptive.split(model, {"cpu@bfloat16": "8KiB", "cpu": None},
                            device_map={"emb": "cpu@bfloat16", "body": "cpu@bfloat16",
                                        "head": "cpu"}):
            out, alone = model(ids), model.emb(ids)
    assert out.dtype == expected.dtype and alone.dtype == embedded.dtype
    if loaded.startswith("bfloat16"):  # nothing converted: the same numbers
        assert torch.equal(out, expected)


def test_a_module_whose_tensors_are_all_empty_follows_its_placement() -> None:
    # Its 0 bytes gave it no unit: its empty weights stayed on the CPU in float32, and torch
    # refused the mix ("mat1 and mat2 must have the same dtype", "cuda:0 and cpu").
    x = torch.randn(4, 16)
    want = WithEmptyLayer().eval()(x)
    model = WithEmptyLayer().eval()
    with adaptive.split(model, {"cpu@float64": None}), torch.no_grad():
        torch.testing.assert_close(model(x).float(), want)
        assert model.z.weight.dtype == torch.float64
    with simulated_cuda(devices=1, total_memory="1GiB"):
        model = WithEmptyLayer().eval()
        with adaptive.chunk(model, "cuda", capacity=10**6) as c, torch.no_grad():
            torch.testing.assert_close(model(x).cpu(), want)
            assert c.device_map == {"": "cuda:0"}
            assert model.z.weight.device == torch.device("cuda", 0)
