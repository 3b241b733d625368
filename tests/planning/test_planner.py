from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import HeadFirst, WithEmptyLayer, dynamically_quantized
from torch import nn

from adaptmem import adaptive
from adaptmem._planning import Plan, module_sizes, paging_units, record_execution_order


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(100, 16)
        self.body = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 100, bias=False)
        self.lm_head.weight = self.wte.weight
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.wte(ids)) * self.scale)


def test_sizes_count_tied_tensors_once_and_are_dtype_aware() -> None:
    model = Tied()
    sizes = module_sizes(model)
    expected = (100 * 16 + 16 * 16 + 16 + 16) * 4
    assert sizes.total_bytes == expected
    assert sizes.tensors["wte.weight"].aliases == ("lm_head.weight",)
    assert sizes.subtree_bytes["lm_head"] == 100 * 16 * 4
    assert sizes.own_bytes("") == 16 * 4
    assert sizes.own_bytes("", torch.float16) == 16 * 2


class ShortcutToAChild(nn.Module):
    """``top`` is a second name for ``a[0]``, registered on a parent walked before ``a``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.top = self.a[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.top(x))


def test_a_module_under_two_names_belongs_to_its_first_wherever_the_second_sits() -> None:
    model = ShortcutToAChild().eval()
    sizes = module_sizes(model)
    assert sizes.children[""] == ["a"] and sizes.children["a"] == ["a.0", "a.1"]
    assert sizes.subtree_bytes[""] == sizes.total_bytes == 2 * (16 + 4) * 4
    x = torch.randn(2, 4)
    expected = model(x)
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0), torch.no_grad():
        assert torch.equal(model(x), expected) and torch.equal(model(x), expected)


def test_units_descend_only_where_a_module_is_too_large() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), nn.Linear(64, 4))
    sizes = module_sizes(model)
    whole = paging_units(sizes, None)
    assert [u.module for u in whole] == [""]
    coarse = paging_units(sizes, sizes.subtree_bytes["0"])
    assert [u.module for u in coarse] == ["0", "1"]
    fine = paging_units(sizes, 64 * 64 * 4 + 64 * 4)
    assert [u.module for u in fine] == ["0.0", "0.1", "1"]
    assert sum(u.nbytes for u in fine) == sizes.total_bytes


def test_a_module_whose_tensors_are_all_empty_gets_a_unit_a_plan_places(tmp_path: Path) -> None:
    # Its 0 bytes gave it no unit, so a load through the plan failed: "the plan does not
    # place z.weight, z.bias".
    units = paging_units(module_sizes(WithEmptyLayer()), 0)
    assert [(u.module, u.nbytes, u.tensors) for u in units][-1] == (
        "z", 0, ("z.weight", "z.bias"))
    torch.save(WithEmptyLayer().state_dict(), tmp_path / "m.pt")
    x = torch.randn(4, 16)
    plan = adaptive.plan(WithEmptyLayer(), devices={"cpu@float64": None}, example_inputs=(x,))
    assert plan.device_map == {"": "cpu@float64"}
    model = adaptive.load(WithEmptyLayer, tmp_path / "m.pt", device=plan)
    assert model.z.weight.dtype == torch.float64


def test_bytes_by_placement_keys_are_plain_strings_for_both_kinds_of_plan() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    paging = adaptive.plan(model, unit_bytes=0)
    placed = adaptive.plan(model, devices={"cuda:0": 64 * 64 * 4 + 64 * 4, "cpu": None})
    total = sum(p.nbytes for p in model.parameters())
    assert paging.bytes_by_placement() == {"paged": total}
    assert placed.bytes_by_placement() == {"cuda:0": 64 * 65 * 4, "cpu": 65 * 4 * 4}
    for plan in (paging, placed):
        assert {type(k) for k in plan.bytes_by_placement()} == {str}  # no enum member


def test_tied_weight_is_owned_by_one_unit_and_borrowed_by_the_other() -> None:
    units = paging_units(module_sizes(Tied()), 0)
    owners = [u for u in units if "wte.weight" in u.tensors]
    borrowers = [u for u in units if "wte.weight" in u.borrowed]
    assert len(owners) == 1 and [u.module for u in borrowers] == ["lm_head"]
    assert [u.name for u in units][0] == "<root> (own)"


def test_plan_uses_execution_order_not_registration_order() -> None:
    with torch.device("meta"):
        model = HeadFirst()
        x = torch.empty(1, 32)
    order = record_execution_order(model, x)
    assert order[:3] == ["", "body", "body.0"] and order[-1] == "head"
    p = adaptive.plan(model, unit_bytes=0, example_inputs=x)
    assert [u.module for u in p.units] == ["body.0", "body.2", "head"]


def test_plan_places_a_prefix_per_device_and_round_trips() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    layer = 256 * 256 * 4 + 256 * 4
    p = adaptive.plan(model, devices={"cuda:0": 2 * layer, "cpu": None})
    assert p.device_map == {"0": "cuda:0", "1": "cuda:0", "2": "cpu", "3": "cpu"}
    # Capacity counts bytes in the dtype placed there: in fp16 twice as many layers fit.
    half = adaptive.plan(model, devices={"cuda:0": 2 * layer, "cpu": None},
                         dtype={"cuda:0": torch.float16})
    assert half.device_map == {"": "cuda:0@float16"}  # the dtype it places in, too
    # ... and the plan reports them so: units, totals and the printed table.
    assert half.total_bytes == sum(u.nbytes for u in half.units) == 4 * layer // 2
    assert half.bytes_by_placement()["cuda:0@float16"] == 4 * layer // 2
    assert "totals: cuda:0@float16 514.0 KiB" in str(half)
    # A dtype key names a device as the devices do ("cuda" is cuda:0); one naming no device
    # is an error, not ignored.
    short = adaptive.plan(model, devices={"cuda:0": 2 * layer, "cpu": None},
                          dtype={"cuda": torch.float16})
    assert short.device_map == {"": "cuda:0@float16"}
    with pytest.raises(ValueError, match=r"dtype names 'cuda:1', which is not among the "
                                         r"devices \('cuda:0', 'cpu'\)"):
        adaptive.plan(model, devices={"cuda:0": 2 * layer, "cpu": None},
                      dtype={"cuda:1": torch.float16})
    again = Plan.from_dict(json.loads(p.to_json()))
    assert again.to_dict() == p.to_dict()
    text = str(p)
    assert "cuda:0" in text and "totals" in text


_UNIT = {"module": "0", "own": False, "bytes": 16, "tensors": ["0.weight"]}


@pytest.mark.parametrize(("given", "error", "match"), [
    ({"units": []}, ValueError, r"the plan has no 'mode' field; expected the dict "
                                r"plan.to_dict\(\) returns: 'mode', 'total_bytes', 'units'"),
    ("plan.json", TypeError, r"got str 'plan.json'; read the JSON first: .*"
                             r"Plan.from_dict\(json.load\(open\(path\)\)\) for a file"),
    ('{"mode": "page"}', TypeError, r"Plan.from_dict\(json.loads\(text\)\) for JSON text"),
    ({"mode": "page", "total_bytes": 0, "units": [{"module": "0"}]}, ValueError,
     r"units\[0\] of the plan has no 'own' field; a unit is the dict Unit.to_dict\(\)"),
    ({"mode": "page", "total_bytes": "16", "units": []}, TypeError,
     r"'total_bytes' of the plan must be an int number of bytes \(0 or more\), got str '16'"),
    ({"mode": "page", "total_bytes": 16, "units": [{**_UNIT, "bytes": -1}]}, ValueError,
     r"'bytes' of units\[0\] of the plan must be an int number of bytes .*got -1"),
    ({"mode": "page", "total_bytes": 16, "units": [_UNIT, {**_UNIT, "tensors": "0.weight"}]},
     TypeError, r"'tensors' of units\[1\] of the plan must be a list of tensor names"),
    ({"mode": "page", "total_bytes": 16, "units": [["0", False]]}, TypeError,
     r"units\[0\] of the plan must be a dict, got list"),
])
def test_a_plan_read_from_bad_data_names_the_field_and_what_was_expected(
        given: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        adaptive.Plan.from_dict(given)  # type: ignore[arg-type]
    good = {"mode": "page", "total_bytes": 16, "units": [_UNIT]}
    assert adaptive.Plan.from_dict(good).to_dict() == {
        **good, "options": {}, "refinements": [],
        "units": [{**_UNIT, "borrowed": [], "placement": ""}]}


def test_plan_rejects_what_is_not_a_module() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        adaptive.plan("resnet50")  # type: ignore[arg-type]
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match="order must be a list of module names"):
        adaptive.plan(model, order="first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"order names 'frist', not module\(s\)"):
        adaptive.plan(model, order=["1", "frist"])
    with pytest.raises(ValueError, match=r"^devices key 'bogus:0' is not a device name"):
        adaptive.plan(model, devices={"bogus:0": None})
    with pytest.raises(ValueError, match="unit_bytes"):
        adaptive.plan(nn.Linear(2, 2), unit_bytes="lots")


def test_an_order_naming_a_module_twice_or_given_with_example_inputs_is_refused() -> None:
    # Both were taken: a name given twice silently, and order= silently overrode the order
    # example_inputs' forward recorded.
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"order names '1' more than once; give each module "
                                         r"once"):
        adaptive.plan(model, order=["1", "0", "1"])
    with pytest.raises(TypeError, match=r"order= and example_inputs= both give the execution "
                                        r"order.*pass one"):
        adaptive.plan(model, order=["1", "0"], example_inputs=torch.randn(1, 2))
    assert [u.module for u in adaptive.plan(model, unit_bytes=0, order=["1", "0"]).units] == [
        "1", "0"]


def test_split_unit_keeps_ownership_and_borrows_ties() -> None:
    from adaptmem._planning import split_unit

    model = Tied()
    sizes = module_sizes(model)
    [whole] = paging_units(sizes, None)
    parts = split_unit(sizes, whole)
    assert parts is not None
    assert [p.name for p in parts] == ["<root> (own)", "wte", "body", "lm_head"]
    owned = [n for p in parts for n in p.tensors]
    assert sorted(owned) == sorted(whole.tensors)  # nothing lost, nothing twice
    assert sum(p.nbytes for p in parts) == whole.nbytes
    lm_head = parts[-1]
    assert lm_head.tensors == () and lm_head.borrowed == ("wte.weight",)
    assert split_unit(sizes, parts[0]) is None  # own tensors are needed at once
    assert split_unit(sizes, parts[2]) is None  # a leaf cannot be split


class _ReadsValues(nn.Module):
    """A forward that needs values (``nonzero``), as detection models' does."""

    def __init__(self) -> None:
        super().__init__()
        self.second = nn.Linear(4, 4)
        self.first = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        return self.second(x[x.sum(1).nonzero().squeeze(1)])


@pytest.mark.parametrize("devices", [None, {"cuda:0": "1MiB", "cpu": None}])
def test_a_model_on_meta_that_cannot_run_there_is_planned_in_registration_order(
        devices: object) -> None:
    with torch.device("meta"):
        model = _ReadsValues()
        x = torch.empty(2, 4)
    plan = adaptive.plan(model, devices=devices, example_inputs=x,
                         **({} if devices else {"unit_bytes": 0}))
    assert [u.module for u in plan.units] == ["second", "first"]  # as registered
    report = plan.options["activations"]
    assert report["predicted"] is False
    assert "cannot run on the meta device" in report["reason"]
    assert "registration order" in report["reason"]
    # With real weights the same call records for real (execution order).
    real = _ReadsValues()
    order = [u.module for u in adaptive.plan(real, unit_bytes=0,
                                             example_inputs=torch.ones(2, 4)).units]
    assert order.index("first") < order.index("second")
    # Another error of the model's, on meta too, is raised as it was.
    with pytest.raises(RuntimeError, match="reduction dim"):
        adaptive.plan(model, example_inputs=torch.empty(2, 5, device="meta"))


@pytest.mark.parametrize("how", ["plan", "page", "chunk", "split"])
def test_weights_packed_by_quantization_are_refused_naming_the_module(how: str) -> None:
    # They live in a ScriptObject, not in parameters: the plan said "0 units, 0 B" and page
    # took a 64 KiB budget while placing nothing.
    model = dynamically_quantized()
    x = torch.randn(2, 64)
    want = model(x)
    with pytest.raises(ValueError, match=r"module '0._packed_params' \(LinearPackedParams\) "
                                         r"keeps its weights packed .*without adaptmem"):
        if how == "plan":
            adaptive.plan(model, unit_bytes=0)
        elif how == "page":
            adaptive.page(model, "cpu", device_budget="64KiB")
        elif how == "chunk":
            adaptive.chunk(model, "cpu", capacity=10**6)
        else:
            adaptive.split(model, {"cpu@bfloat16": None})
    assert torch.equal(model(x), want)


@pytest.mark.parametrize("devices", [{"cuda": None}, ["cuda"], {None: None},
                                     {"cuda@float16": "4MiB", "cpu": None}])
def test_plan_reads_cuda_as_the_current_device_as_split_does(devices: object,
                                                              tmp_path: Path) -> None:
    from adaptmem.testing import simulated_cuda

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2)).eval()
    with simulated_cuda(devices=2, total_memory="64MiB"):
        torch.cuda.set_device(1)
        planned = adaptive.plan(model, devices=devices, dtype={"cuda": torch.float16}
                                if devices == ["cuda"] else None)
        assert {u.placement.partition("@")[0] for u in planned.units} == {"cuda:1"}
        with adaptive.split(model, devices, dtype={"cuda": torch.float16}
                            if devices == ["cuda"] else None,
                            example_inputs=torch.ones(1, 64)) as s:
            assert s.device_map == planned.device_map
        torch.save(model.state_dict(), tmp_path / "model.pt")
        loaded = adaptive.load(lambda: nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2)),
                               tmp_path / "model.pt", device=planned)
        assert {t.device for t in loaded.state_dict().values()} == {torch.device("cuda", 1)}


def test_auto_capacities_on_one_device_share_its_budget() -> None:
    from adaptmem.testing import simulated_cuda

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(32)]).eval()
    devices = {"cuda:0@float16": "auto", "cuda:0@bfloat16": "auto", "cuda:0": "auto",
               "cpu": None}
    with simulated_cuda(devices=1, total_memory="40MiB"):
        from adaptmem._planning import auto_capacity

        budget, _ = auto_capacity(torch.device("cuda:0"))
        planned = adaptive.plan(model, devices=devices).bytes_by_placement()
        on_gpu = sum(n for label, n in planned.items() if label.startswith("cuda:0"))
        assert 0 < on_gpu <= budget
        assert planned["cuda:0@float16"] == on_gpu  # the first key fills first
        x = torch.randn(2, 1024)
        expected = model(x)
        device_map = adaptive.plan(model, devices=devices, example_inputs=x).device_map
        with adaptive.split(model, devices, example_inputs=x) as s:  # before: out of memory
            assert s.device_map == device_map
            torch.testing.assert_close(model(x), expected, atol=0.05, rtol=0.05)


def test_explicit_capacities_on_one_device_that_pass_its_memory_are_refused() -> None:
    from adaptmem.testing import simulated_cuda

    model = nn.Sequential(nn.Linear(8, 8)).eval()
    with simulated_cuda(devices=1, total_memory="40MiB"):
        with pytest.raises(ValueError, match=r"^devices gives cuda:0 60\.0 MiB in all "
                                             r"\('cuda:0@float16': 30\.0 MiB, 'cuda:0': 30\.0 MiB"
                                             r"\), more than it can hold"):
            adaptive.split(model, {"cuda:0@float16": "30MiB", "cuda:0": "30MiB", "cpu": None})
