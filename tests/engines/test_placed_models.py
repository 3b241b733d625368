"""What a model held by page, chunk or split refuses, for every engine: being deep-copied
or pickled whole, and dtype or device conversions (``model.half()``, ``.to()``) made behind
the engine's back. After ``remove()`` the model is as it was, bitwise, and copies fine."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import run_if
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import DIM, SPLIT_WIDTH, build_tree_for_split, module_trees, module_trees_for_split
from torch import nn

from adaptmem import PlacementError, adaptive


class _TiedModel(nn.Module):
    """A tied weight, a buffer registered under two names, float and int buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 8)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.bn.register_buffer("scale", self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.emb(x)) * self.scale)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = _TiedModel().eval()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.num_batches_tracked.fill_(7)
    return model


_X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

ENGINES: dict[str, Callable[[nn.Module], Any]] = {
    "page": lambda m: adaptive.page(m, "cpu", unit_bytes=0, resident_bytes=0),
    "page, resident": lambda m: adaptive.page(m, "cpu", unit_bytes=0, resident_bytes="auto"),
    "chunk, bfloat16 part": lambda m: adaptive.chunk(m, "cpu", capacity=150, dtype=torch.bfloat16,
                                                     example_inputs=_X),
    "chunk, placed at the first call": lambda m: adaptive.chunk(m, "cpu", capacity=150,
                                                                dtype=torch.bfloat16),
    "split": lambda m: adaptive.split(m, {"cpu": None}, example_inputs=_X),
}


def _state(model: nn.Module) -> dict[str, tuple[int, torch.dtype, torch.device, torch.Tensor]]:
    return {k: (id(v), v.dtype, v.device, v.detach().clone())
            for k, v in model.state_dict(keep_vars=True).items()}


def _assert_as_before(model: nn.Module, before: dict[str, Any]) -> None:
    after = _state(model)
    assert after.keys() == before.keys()
    for key, (ident, dtype, device, value) in before.items():
        assert after[key][:3] == (ident, dtype, device), key
        assert torch.equal(after[key][3], value), key


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("copier", ["deepcopy", "torch.save"])
def test_a_placed_model_refuses_to_be_copied_naming_remove(engine: str, copier: str) -> None:
    model = _model()
    expected = model(_X)
    original = _state(model)
    handle = ENGINES[engine](model)
    placed_output = model(_X)

    def copy_it() -> Any:
        if copier == "deepcopy":
            return copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    with pytest.raises(PlacementError, match=r"cannot copy or pickle.*\.remove\(\) first"):
        copy_it()
    assert torch.equal(model(_X), placed_output)  # the placed model is unharmed
    handle.remove()
    _assert_as_before(model, original)
    clone = copy_it()  # the way out the message names
    assert torch.equal(clone(_X), expected) and torch.equal(model(_X), expected)
    for key, value in clone.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key


CONVERSIONS: dict[str, Callable[[nn.Module], Any]] = {
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "to(float64)": lambda m: m.to(torch.float64),
    "to('meta')": lambda m: m.to("meta"),
    "a submodule's half": lambda m: m.bn.half(),
    "double of one buffer's owner": lambda m: m.bn.double(),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_a_conversion_of_a_placed_model_is_refused_and_remove_undoes_it(
    engine: str, conversion: str
) -> None:
    model = _model()
    expected = model(_X)
    before = _state(model)
    handle = ENGINES[engine](model)
    model(_X)
    forwards = handle.stats.forwards
    CONVERSIONS[conversion](model)
    with pytest.raises(PlacementError, match=r"holds the model.*this call did not run.*"
                                             r"\.remove\(\) first"):
        model(_X)
    with pytest.raises(PlacementError, match="did not run"):  # and again, until remove()
        model(_X)
    assert handle.stats.forwards == forwards
    handle.remove()
    _assert_as_before(model, before)
    assert torch.equal(model(_X), expected)
    model.half()  # once removed, converting is the user's business again
    assert model.emb.weight.dtype == model.scale.dtype == torch.float16


@pytest.mark.parametrize("engine", ENGINES)
def test_load_state_dict_with_assign_while_placed_is_refused_saying_remove_drops_it(
    engine: str, adaptmem_log: pytest.LogCaptureFixture
) -> None:
    model = _model()
    before = _state(model)
    loaded = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    handle = ENGINES[engine](model)
    model(_X)
    model.load_state_dict(loaded, assign=True)  # new objects in place of the placed ones
    with pytest.raises(PlacementError, match=(
            r"replaced by another object \(.*load_state_dict\(\.\.\., assign=True\)\).*this "
            r"call did not run.*remove\(\) registers the original objects again, which drops "
            r"whatever was assigned in their place \(weights loaded with assign=True too\): "
            r"to load weights into a placed model use adaptive\.load\(model, checkpoint\) or "
            r"load_state_dict\(state_dict\) without assign=True")):
        model(_X)
    handle.remove()
    _assert_as_before(model, before)  # what was loaded is gone, as the message said
    assert "dropped those: a conversion, an assignment or load_state_dict(..., assign=True)" \
        in adaptmem_log.text
    handle = ENGINES[engine](model)  # the way it names: loading without assign=True
    model(_X)
    model.load_state_dict(loaded)
    model(_X)
    handle.remove()
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded[key]), key


@pytest.mark.parametrize("engine", ["page", "chunk, bfloat16 part", "split"])
def test_a_part_called_on_its_own_after_a_conversion_is_refused(engine: str) -> None:
    model = _model()
    before = _state(model)
    handle = ENGINES[engine](model)
    model(_X)
    model.half()
    with pytest.raises(PlacementError, match="did not run"):
        model.emb(_X)
    handle.remove()
    _assert_as_before(model, before)


def test_a_conversion_before_a_lazy_placement_is_refused_at_the_first_call() -> None:
    model = _model()
    before = _state(model)
    chunker = adaptive.chunk(model, "cpu", capacity=150, dtype=torch.bfloat16)
    model.half()
    with pytest.raises(PlacementError, match="did not run"):
        model(_X)
    assert chunker.plan is None  # nothing was placed
    chunker.remove()
    _assert_as_before(model, before)


@pytest.mark.parametrize("engine", ENGINES)
def test_conversions_that_change_nothing_are_allowed(engine: str) -> None:
    model = _model()
    expected = model(_X)
    with ENGINES[engine](model) as handle:
        placed_output = model(_X)
        if engine.startswith("chunk"):  # its bfloat16 part is already placed: leave it
            model.head.to("cpu")
        else:
            model.float().to("cpu").cpu()
        assert torch.equal(model(_X), placed_output)
        assert handle.stats.forwards == 2
    assert torch.equal(model(_X), expected)


def test_editing_the_device_map_after_a_conversion_is_refused() -> None:
    model = _model()
    before = _state(model)
    splitter = adaptive.split(model, {"cpu@bfloat16": None, "cpu": None}, example_inputs=_X)
    model.half()
    with pytest.raises(PlacementError, match="did not run"):
        splitter.device_map = {"": "cpu"}
    splitter.remove()
    _assert_as_before(model, before)


@run_if(cuda=True)
@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["page", "chunk"])
def test_moving_a_placed_model_between_devices_is_refused(engine: str) -> None:
    model = _model()
    expected = model(_X)
    before = _state(model)
    handle = (adaptive.page(model, "cuda", unit_bytes=0) if engine == "page"
              else adaptive.chunk(model, "cuda", capacity=150, example_inputs=_X))
    model(_X)
    model.cpu() if engine == "page" else model.cuda()
    with pytest.raises(PlacementError, match="did not run"):
        model(_X)
    handle.remove()
    _assert_as_before(model, before)
    assert torch.equal(model(_X), expected)


class _Stateful(nn.Module):
    """Replaces its own buffers in forward: by assignment, and by registering anew."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        self.register_buffer("scale", self.scale * 2)
        return self.lin(x) * self.scale * self.calls


@pytest.mark.parametrize("engine", ENGINES)
def test_buffers_a_forward_replaces_itself_are_its_own_state_not_a_conversion(
    engine: str,
) -> None:
    torch.manual_seed(0)
    reference, model = _Stateful().eval(), _Stateful().eval()
    model.load_state_dict(reference.state_dict())
    expected = [reference(_X) for _ in range(3)]
    with ENGINES[engine](model):
        outputs = [model(_X) for _ in range(3)]
        for out, ref in zip(outputs, expected, strict=True):
            if engine.startswith("chunk"):
                assert torch.allclose(out, ref, rtol=2e-2, atol=0.1)  # a bfloat16 part
            else:
                assert torch.equal(out, ref)
        model.half()  # a conversion of the replaced buffers is still refused
        with pytest.raises(PlacementError, match="did not run"):
            model(_X)
    assert model.calls.dtype == torch.float32 and model.scale.dtype == torch.float32
    assert model.lin.weight.dtype == torch.float32


class _GrowsAHead(_TiedModel):
    """A forward that puts a module of its own into the model (its state, not an edit)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "extra" not in self._modules:
            self.extra = nn.Identity()
        return self.extra(super().forward(x))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_module_put_in_while_placed_is_refused_if_it_brings_tensors_and_taken_if_not(
        engine: str) -> None:
    model = _model()
    before = _state(model)
    with torch.no_grad():
        expected = copy.deepcopy(model)(_X)
    handle = ENGINES[engine](model)
    model(_X)
    forwards = handle.stats.forwards
    # No new tensor: an unused module added, a placed module under a second name, a module
    # the forward did not need deleted. Taken as the model now is.
    model.unused = nn.Identity()
    model.head_again = model.head
    del model.unused
    out = model(_X)
    assert out.shape == expected.shape and handle.stats.forwards == forwards + 1
    # A new head where the model computes on one device in its own dtype (page on the CPU,
    # split over the CPU alone) runs as it is; where the engine converts (a bfloat16 part),
    # it is refused, and so is one on another device anywhere (on a GPU: a head left on the
    # host while the rest computes on the device).
    one_place = not engine.startswith("chunk")
    model.head = nn.Linear(8, 3).eval()
    if one_place:
        assert model(_X).shape == (4, 3) and handle.stats.forwards == forwards + 2
        forwards += 1
        model.head = nn.Linear(8, 3, device="meta").eval()
    on = r"adaptive\.\w+ computes on cpu" if one_place else "the engine moves or converts"
    with pytest.raises(PlacementError, match=(
            rf"parameter 'head\.weight' \(torch\.float32 on (cpu|meta)\) was put into module "
            rf"'head' while adaptive\.\w+ holds the model; {on}.*this call did not run. Call "
            rf"\w+\.remove\(\) first")):
        model(_X)
    with pytest.raises(PlacementError, match="did not run"):  # and again, until remove()
        model(_X)
    assert handle.stats.forwards == forwards + 1
    handle.remove()
    # remove() keeps the new head and restores everything the engine placed.
    assert model.head.out_features == 3 and model.head_again.out_features == 8
    del model.head_again
    model.head = before_head = nn.Linear(8, 8)  # (the meta head replaced too)
    before_head.weight = model.emb.weight
    with torch.no_grad():
        before_head.bias.copy_(before["head.bias"][3])
    _assert_as_before_except(model, before, "head.bias")
    assert torch.equal(model(_X), expected)


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ["page", "chunk"])
def test_on_a_gpu_a_tensor_put_in_on_the_host_is_refused_and_one_on_the_device_is_not(
        engine: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4, bias=False)).eval()
    x = torch.randn(2, 8)
    handle = (adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0) if engine == "page"
              else adaptive.chunk(model, "cuda", capacity=300))
    with torch.no_grad():
        model(x)
        # A bias where there was none, on the host: the forward would mix devices.
        model[2].bias = nn.Parameter(torch.zeros(4))
        with pytest.raises(PlacementError, match=r"parameter '2\.bias' \(torch\.float32 on cpu\) "
                                                 r"was put into module '2'"):
            model(x)
        model[2].bias = None
        if engine == "page":  # one device: a module already there runs as it is
            model.append(nn.Linear(4, 2).eval().cuda())
            assert model(x).shape == (2, 2)
        else:  # a chunk moves units between devices: anything new is refused
            model.append(nn.Linear(4, 2).eval().cuda())
            with pytest.raises(PlacementError, match="moves or converts"):
                model(x)
    handle.remove()


def _assert_as_before_except(model: nn.Module, before: dict[str, Any], new: str) -> None:
    after = _state(model)
    assert after.keys() == before.keys()
    for key, (ident, dtype, device, value) in before.items():
        assert after[key][1:3] == (dtype, device), key
        assert key == new or after[key][0] == ident, key
        assert torch.equal(after[key][3], value), key


@pytest.mark.parametrize("engine", ENGINES)
def test_a_module_the_forward_puts_in_itself_is_its_own_state(engine: str) -> None:
    torch.manual_seed(0)
    reference, model = _GrowsAHead().eval(), _GrowsAHead().eval()
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        expected = reference(_X)
    with ENGINES[engine](model):
        for _ in range(3):
            out = model(_X)
            tol = {"rtol": 2e-2, "atol": 0.1} if engine.startswith("chunk") else {}
            torch.testing.assert_close(out, expected, **tol)
    assert isinstance(model.extra, nn.Identity)


@pytest.mark.parametrize("engine", ["page", "chunk"])
def test_a_dynamic_rope_model_that_re_registers_inv_freq_keeps_generating(engine: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=8,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (1, 6))
    with torch.no_grad():  # past 8 positions: inv_freq is registered anew, then reset
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    handle = (adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0) if engine == "page"
              else adaptive.chunk(model, "cpu", capacity=10**5, example_inputs=ids))
    with handle, torch.no_grad():
        assert torch.equal(
            model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), expected)


_ANY_CONVERSION = {
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "double": lambda m: m.double(),
    "to('meta')": lambda m: m.to("meta"),
}


def _changed(before: dict[str, Any], model: nn.Module) -> bool:
    after = _state(model)
    return any(after[k][:3] != v[:3] for k, v in before.items())


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=module_trees(), unit_bytes=st.integers(0, 3000),
       resident=st.sampled_from([0, "auto"]), conversion=st.sampled_from(list(_ANY_CONVERSION)),
       pick=st.integers(0, 1000))
def test_any_paged_tree_refuses_any_conversion_of_any_part_and_remove_undoes_it(
    tree: nn.Module, unit_bytes: int, resident: Any, conversion: str, pick: int
) -> None:
    x = torch.randn(2, DIM)
    with torch.no_grad():
        expected = tree(x)
    original = _state(tree)
    pager = adaptive.page(tree, "cpu", unit_bytes=unit_bytes, resident_bytes=resident)
    _convert_one_part_and_call(tree, pager, x, conversion, pick)
    _assert_as_before(tree, original)
    with torch.no_grad():
        assert torch.equal(tree(x), expected)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=module_trees_for_split(), share=st.floats(0.0, 1.0),
       conversion=st.sampled_from(list(_ANY_CONVERSION)), pick=st.integers(0, 1000))
def test_any_chunked_tree_refuses_any_conversion_of_any_part_and_remove_undoes_it(
    spec: Any, share: float, conversion: str, pick: int
) -> None:
    model = build_tree_for_split(spec).eval()
    x = torch.randn(2, SPLIT_WIDTH)
    with torch.no_grad():
        expected = model(x)
    original = _state(model)
    capacity = int(share * sum(t.numel() * 2 for t in model.state_dict().values()))
    chunker = adaptive.chunk(model, "cpu", capacity=capacity, dtype=torch.bfloat16,
                             example_inputs=x)
    _convert_one_part_and_call(model, chunker, x, conversion, pick)
    _assert_as_before(model, original)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def _convert_one_part_and_call(model: nn.Module, handle: Any, x: torch.Tensor, conversion: str,
                               pick: int) -> None:
    """Convert one module of the placed ``model``: if that changed any tensor, the next call
    is refused (and nothing ran); if not, it runs. Then ``remove()``."""
    with torch.no_grad():
        placed_output = model(x)
        modules = [m for _, m in model.named_modules()]
        before = _state(model)
        _ANY_CONVERSION[conversion](modules[pick % len(modules)])
        if _changed(before, model):
            with pytest.raises(PlacementError, match="did not run"):
                model(x)
        else:
            assert torch.equal(model(x), placed_output)
    handle.remove()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_dropped_handle_is_found_by_holder_and_removed(engine: str) -> None:
    """``adaptive.page(model, ...)`` as a bare statement (pytorch-optimem's habit) keeps the
    model placed; the refusals then say how to find the handle, and removing it gives the
    model back."""
    model = _model()
    before = _state(model)
    ENGINES[engine](model)  # the handle is not kept
    model(_X)  # placed at its first call, for the engines that wait
    with pytest.raises(PlacementError, match=r"adaptive\.holder\(model\) returns it"):
        adaptive.page(model, "cpu")
    with pytest.raises(PlacementError, match=r"adaptive\.holder\(model\) returns it"):
        copy.deepcopy(model)
    handle = adaptive.holder(model)
    assert handle is not None and adaptive.holder(model.bn) is handle
    handle.remove()
    assert adaptive.holder(model) is None
    _assert_as_before(model, before)
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        adaptive.holder(model.state_dict())


_ON_A_DEVICE: dict[str, Callable[[nn.Module], Any]] = {
    "page": lambda m: adaptive.page(m, "cuda", resident_bytes="auto"),
    "chunk": lambda m: adaptive.chunk(m, "cuda", capacity="3MiB"),
    "split": lambda m: adaptive.split(m, {"cuda": "3MiB", "cpu": None}),
}


@pytest.mark.parametrize("engine", _ON_A_DEVICE)
def test_a_model_dropped_with_its_handle_gives_its_device_memory_back(engine: str) -> None:
    """A service reloading its model drops the old one and its handle without ``remove()``:
    the old model, its device copies and its claims used to live as long as the process
    (after a few reloads every new version ran fully paged). A dropped handle still keeps
    a live model placed."""
    import gc
    import weakref

    from adaptmem._common import claims
    from adaptmem.testing import simulated_cuda

    x = torch.randn(4, 512)
    with simulated_cuda(devices=1, total_memory="64MiB"), torch.no_grad():
        dropped = []
        for version in range(3):
            model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]).eval()
            expected = model(x)
            _ON_A_DEVICE[engine](model)  # the handle is not kept
            gc.collect()
            torch.testing.assert_close(model(x).cpu(), expected)  # still placed
            assert adaptive.holder(model) is not None and torch.cuda.memory_allocated() > 0
            dropped.append(weakref.ref(model))
            del model
            gc.collect()
            assert all(r() is None for r in dropped), f"version {version} kept alive"
            assert torch.cuda.memory_allocated() == 0
        assert not claims._TENSOR_CLAIMS


def _placed_by_run() -> tuple[nn.Module, Any]:
    """A model and a function named ``run`` decorated with ``model=`` it, called once (the
    model is placed, for ``run``)."""
    model = _model()

    @adaptive.batch(initial_batchsize=4, model=model)
    def run(batchsize: int) -> torch.Tensor:
        with torch.no_grad():
            return model(_X[:batchsize])

    run()
    return model, run


def test_holder_does_not_hand_out_the_engine_of_a_function_decorated_with_model() -> None:
    model, run = _placed_by_run()
    with pytest.raises(PlacementError, match=r"not yours to remove.*run\.remove\(\)"):
        adaptive.holder(model)
    run.remove()
    assert adaptive.holder(model) is None


@pytest.mark.parametrize("copier", ["deepcopy", "torch.save"])
def test_copying_a_model_a_decorated_function_holds_names_that_functions_remove(
        copier: str) -> None:
    model, run = _placed_by_run()
    with pytest.raises(PlacementError, match=r"cannot copy or pickle") as refused:
        copy.deepcopy(model) if copier == "deepcopy" else torch.save(model, io.BytesIO())
    message = str(refused.value)
    assert "run.remove() first" in message and "pager.remove()" not in message
    assert "adaptive.holder" not in message  # which would refuse: not the user's to remove
    run.remove()
    copy.deepcopy(model)


def _capture(how: str, model: nn.Module) -> Any:
    if how == "torch.jit.script":
        return torch.jit.script(model)
    if how == "torch.jit.trace":
        return torch.jit.trace(model, (_X,))
    return torch.export.export(model, (_X,))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("how", ["torch.jit.script", "torch.jit.trace", "torch.export"])
def test_torchscript_tracing_and_export_of_a_placed_model_are_refused_naming_remove(
        engine: str, how: str) -> None:
    if how == "torch.export" and not hasattr(torch.compiler, "is_exporting"):
        pytest.skip("torch.compiler.is_exporting arrived in torch 2.4")
    model = _model()
    expected = model(_X)
    original = _state(model)
    handle = ENGINES[engine](model)
    with torch.no_grad():
        placed_output = model(_X)
    with pytest.raises(PlacementError, match=rf"^{how} does not support a model while "
                                             rf"adaptive\.\w+ holds it.*\w+\.remove\(\) first"):
        _capture(how, model)
    with torch.no_grad():
        assert torch.equal(model(_X), placed_output)  # the placed model runs on
    handle.remove()
    _assert_as_before(model, original)
    if how == "torch.jit.trace":  # once removed: captured unplaced
        torch.testing.assert_close(_capture(how, model)(_X), expected)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_dropped_after_a_refused_script_is_freed(engine: str) -> None:
    # torch.jit.script stores the types it built before reaching the refusal, hooks and
    # all: they held the engine and the model for the life of the process.
    import gc
    import weakref

    model = _model()
    handle = ENGINES[engine](model)
    with torch.no_grad():
        model(_X)
    with pytest.raises(PlacementError):
        torch.jit.script(model)
    dropped = weakref.ref(model)
    del model, handle
    gc.collect()
    assert dropped() is None


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["page", "chunk"])
def test_a_shallow_copy_of_a_placed_model_runs_as_the_model(engine: str) -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).eval()
    x = torch.randn(2, 64)
    expected = model(x)
    with torch.no_grad():
        handle = (adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=40_000)
                  if engine == "page" else adaptive.chunk(model, "cuda", capacity=40_000))
        model(x)
        shallow = copy.copy(model)  # shares the model's parameters, children and hooks
        out = shallow(x)
        assert out.device == x.device
        torch.testing.assert_close(out, expected)
        assert handle.stats.forwards == 2
        torch.testing.assert_close(model(x), expected)
    handle.remove()
    assert all(p.device.type == "cpu" for p in model.parameters())
