"""The one parameter-size planner: sizes -> units -> (recorded execution order) -> targets ->
assignment -> ``Plan``. Pure arithmetic over the module tree apart from the recorder, whose
forward runs on a copy. Every engine, ``adaptive.plan`` and the CLI import from here."""

from .assignment import (
    ATOMIC_MODULE_TYPES,
    check_ties,
    label_for_unit,
    map_key,
    own_ties_where_first_used,
    placed_bytes,
    placement_units,
    plan_placement,
)
from .peak import activation_report, predict_model, predict_per_item
from .plan import Plan
from .planner import cannot_run_on_meta, plan, split_inputs
from .recording import Recording, record_execution_order, record_forward
from .sizes import HiddenWeightsError, ModuleSizes, TensorInfo, module_sizes, tensor_bytes
from .targets import (
    Target,
    auto_capacity,
    capacity_of,
    check_capacity,
    dtype_name,
    make_label,
    parse_dtype,
    qualify_labels,
    split_label,
    targets_from_devices,
)
from .units import Placement, Unit, assign_devices, order_units, paging_units, split_unit

__all__ = [
    "activation_report", "predict_model", "predict_per_item",
    "ATOMIC_MODULE_TYPES", "HiddenWeightsError", "ModuleSizes", "Placement", "Plan",
    "Recording", "Target",
    "TensorInfo", "Unit", "assign_devices", "auto_capacity", "capacity_of",
    "check_capacity", "check_ties", "dtype_name", "label_for_unit", "make_label", "map_key", "module_sizes",
    "order_units", "own_ties_where_first_used", "paging_units", "parse_dtype",
    "placed_bytes", "placement_units", "plan", "plan_placement", "qualify_labels",
    "record_execution_order", "record_forward", "split_inputs", "split_label", "split_unit",
    "cannot_run_on_meta",
    "targets_from_devices", "tensor_bytes",
]
