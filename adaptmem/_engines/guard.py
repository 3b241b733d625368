"""What a placed model refuses: being copied or pickled whole, and dtype or device
conversions made behind its engine's back. Used by the Pager, Chunker and Splitter alike.

[Note: a placed model is neither copied nor converted]
While an engine holds a model, its tensors are the engine's (paged host masters, device
copies, copies in another dtype) and its hooks are the engine's bound methods.

- ``copy.deepcopy(model)`` and ``torch.save(model)`` reach the engine through those hooks;
  the engine refuses to be copied or pickled, with an error naming ``remove()``. A copy
  would hold the placed tensors, not the model's own, and hooks tied to the original; and
  since pickling reaches the hooks only after the model's own parameters, no hook can make
  the copy what ``remove()`` would give.
- ``model.half()``, ``.float()``, ``.to(...)``, ``.cuda()``, ``.cpu()`` go through
  ``nn.Module._apply``, which no hook sees: it points each parameter at a converted copy and
  registers a new object for each converted buffer (catching it at the call would mean
  patching the module, which placement never does). The engine checks at every outermost
  call, before doing anything, that every tensor it placed is still registered and still
  has the dtype and device it gave it; if not, the call raises a ``PlacementError`` and
  nothing runs. ``remove()`` registers the original objects again and restores every
  tensor bitwise, as it was before placement; the conversion is dropped with the rest.
  An object the forward itself registers in place of one of the engine's (dynamic RoPE
  re-registers ``inv_freq``; ``self.steps = self.steps + 1`` reassigns a buffer) is the
  model's own state: it is accepted at the end of that call, checked from then on, and
  kept by ``remove()``, in the dtype and device of the object it replaced.

[Note: no capture of a placed model]
``torch.jit.script``, ``torch.jit.trace`` and ``torch.export.export`` of a placed model failed
inside PyTorch (script compiles the engine's hooks: ``SetComp aren't supported``; trace of a
paged model: an internal assert asking to report a bug to PyTorch), or worse, a trace of a
chunked model succeeded with today's placement baked in and failed once removed. Trace and
export run the model, so the check at every outermost call (``check``) refuses them, at
the cost of one C call and one flag read. Script runs nothing: it compiles the model's
hooks, the root's first, reading each one's ``__name__`` and then its ``__globals__``; the
engine's hooks on the root are ``RootHook`` objects (``base.py``) whose ``__globals__``
raises this refusal. ``torch.compile`` is left alone: it graph-breaks on the hooks and runs.
Strict export (``strict=True``) traces the refusal with dynamo, which reports it inside its
own ``Unsupported`` error.

[Note: a module put into a placed model]
``model.head = nn.Linear(...)``, ``model[2] = ...``, ``model.append(...)`` or a bias set
where there was none, between calls, registers tensors the engine never placed: on the host
while the rest computes on the device, the forward used to fail deep inside with a
device-mismatch error. Every call compares one count of registrations made in the process
(see ``_registrations``); when it moved, the model's registrations are walked once: a new
tensor (neither in the model at placement, nor put in the place of a placed one, which the
checks above refuse) is taken where the model computes on one device without conversion
and the tensor is there (a pager's device, a CPU placement: it runs as it is), and
otherwise makes the call raise a ``PlacementError`` before anything runs. A change that
brings no new tensor (an activation swapped, a module deleted, a placed module moved under
a new parent) is taken as the model now is (a module put in is not held to eval mode: it
holds nothing placed that a training forward could write). ``remove()`` keeps what was
put in and restores the tensors the engine placed. What the forward itself puts in is its
own state, taken as it is at the end of that call, like a buffer it registers.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import torch
from torch import nn

from .._common.claims import LOST_HANDLE, owner_of, refuse_training
from .._common.errors import PlacementError
from .._common.tree import registrations

__all__ = ["NotCopyable", "PlacementGuard"]

logger = logging.getLogger("adaptmem")


class NotCopyable:
    """An engine handle: refuses ``copy.deepcopy`` and pickling, and so does a model whose
    hooks it holds. See [Note: a placed model is neither copied nor converted]."""

    made_by = "adaptmem"  # the function that made the handle, named in messages
    handle_name = "handle"  # what users call the handle
    held_as = "placed"  # what a model held by this engine is: "paged" or "placed"

    def _refuse_copy(self) -> NoReturn:
        owner = owner_of(self)  # a function decorated with model=: its remove() frees it
        fix = (f". Call {self.handle_name}.remove() first (the model is then exactly as "
               f"before; {LOST_HANDLE}), copy or save it, and place it again" if owner is None
               else f"; {owner.fix()}; then copy or save it")
        raise PlacementError(
            f"cannot copy or pickle a model while {self.made_by} holds it (copy.deepcopy, "
            f"torch.save of the whole model): its tensors are the placed ones and its hooks "
            f"belong to this {type(self).__name__}{fix}"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        self._refuse_copy()

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        self._refuse_copy()


class PlacementGuard:
    """Where each placed tensor is registered and what it should hold between calls.

    ``expect`` records the data each tensor holds at rest; ``check`` (at every outermost
    call) raises if a registered object was replaced or a tensor's dtype or device changed;
    ``put_back`` (in ``remove()``) undoes both, before the engine restores its tensors, and
    ``release`` then drops what it held.
    """

    __slots__ = ("_names", "_tensors", "_dtypes", "_devices", "_registries", "_attrs",
                 "_registered", "_kinds", "_homes", "_adopted", "_passed", "_data", "_engine",
                 "_handle", "_modules", "_ptrs", "on_new_data", "_released", "_known",
                 "_seen", "_slots", "_computes_on")

    def __init__(self, model: nn.Module, tensors: Mapping[str, torch.Tensor], engine: str,
                 handle: str, computes_on: torch.device | None = None) -> None:
        self._engine, self._handle = engine, handle
        # The one device the model computes on, without conversion (a pager's; a placement
        # on one device in its own dtype): a tensor put in there runs as it is. None: more
        # than one, or a conversion. See [Note: a module put into a placed model].
        self._computes_on = computes_on
        self._modules = dict(model.named_modules())  # each once, checked at every call
        self._names = list(tensors)
        self._tensors = list(tensors.values())
        # Every registration: a tensor registered under two names is checked under both.
        where = {id(t): n for n, t in tensors.items()}
        self._registries: list[dict[str, Any]] = []
        self._attrs: list[str] = []
        self._registered: list[torch.Tensor | None] = []
        self._kinds: list[str] = []
        self._homes: list[tuple[torch.dtype, torch.device]] = []  # as before placement
        for r in registrations(model):
            if id(r.tensor) in where:
                self._registries.append(r.registry)
                self._attrs.append(r.attr)
                self._registered.append(r.tensor)
                self._kinds.append(f"{r.kind} {r.name}")
                self._homes.append((r.tensor.dtype, r.tensor.device))
        # Registrations whose object a forward replaced: index -> (dtype, device) it had.
        self._adopted: dict[int, tuple[torch.dtype, int]] = {}
        self._passed = False  # the last check passed: the call that followed really ran
        # Called by check() with the names of tensors given other data of their dtype and
        # device since (``t.data = new``); None: such data is not looked for.
        self.on_new_data: Any = None
        self._released = False
        # The tensors registered when the model was last taken as it is (placed or not), by
        # id; held, so that no new tensor takes a freed one's id (a weak reference would make
        # torch.utils.swap_tensors refuse them).
        self._known = _by_id(model)
        self._slots = {(id(r), a) for r, a in zip(self._registries, self._attrs, strict=True)}
        self._seen = _registrations[0]  # See [Note: a module put into a placed model]
        self.expect({n: t.data for n, t in tensors.items()})

    def expect(self, data: Mapping[str, torch.Tensor]) -> None:
        """The data each tensor holds at rest from now on (kept to put it back)."""
        self._data = {n: data[n] for n in self._names}
        with _no_modes():  # read as check() reads them
            self._dtypes, self._devices = _metadata(list(self._data.values()))
        self._ptrs = _pointers(list(self._data.values()))

    def check(self) -> None:
        """Raise ``PlacementError`` if a tensor was replaced or converted since placement, or
        the handle was removed (a removed handle places nothing again)."""
        if self._released:
            raise PlacementError(
                f"this {self._handle} was removed, and the model is no longer placed; "
                f"{self._engine}(model, ...) places it again")
        if _tracing_state() is not None or _is_exporting():  # See [Note: no capture ...]
            self._passed = False
            self.refuse_capture("torch.jit.trace" if _tracing_state() is not None
                                else "torch.export")
        # This runs at every call. Metadata reads, with torch function modes off: a mode (a
        # simulated device's) would otherwise see two calls per tensor, and has nothing to
        # change.
        if torch._C._is_torch_function_mode_enabled():
            with _no_modes():
                dtypes, devices = _metadata(self._tensors)
        else:
            dtypes, devices = _metadata(self._tensors)
        if _registrations[0] != self._seen:  # a module or tensor registered somewhere
            self._seen = _registrations[0]
            self._follow_tree()
        if any(map(_training, self._modules.values())):
            self._passed = False
            refuse_training(
                self._engine, self._modules.items(),
                f"model.train() after placing? A training forward writes buffers (BatchNorm's "
                f"running statistics) that a placed model would not keep, so this call did "
                f"not run. Call model.eval() again, or {self._handle}.remove() first to train",
                when=" now")
        if (dtypes != self._dtypes or devices != self._devices
                or not all(map(operator.is_, map(dict.get, self._registries, self._attrs),
                               self._registered))
                or (self._adopted and self._adopted_changed() is not None)):
            self._passed = False
            self._refuse()
        if self.on_new_data is not None:
            self.follow_new_data()
        self._passed = True

    def refuse_capture(self, what: str) -> NoReturn:
        """Raise the ``PlacementError`` saying that ``what`` (``torch.jit.script``, ...)
        does not take a placed model. See [Note: no capture of a placed model]."""
        unplaced = (": a TorchScript module cannot be placed itself" if "jit" in what else "")
        raise PlacementError(
            f"{what} does not support a model while {self._engine} holds it: the engine "
            f"places it through forward hooks and by swapping its tensors between calls, "
            f"which {what} does not follow (what it made would keep this placement, or fail "
            f"inside PyTorch), so nothing was captured. Capture the model before placing it, "
            f"or call {self._handle}.remove() first (the model is then exactly as before) and "
            f"capture it then; what {what} makes runs unplaced{unplaced}")

    def rename(self, engine: str, handle: str) -> None:
        """Speak of the model's holder as ``engine`` and of its handle as ``handle`` (a
        ``model=`` function owns this engine: its errors name that function)."""
        self._engine, self._handle = engine, handle

    def _follow_tree(self) -> None:
        """A module or tensor was registered somewhere since the last call: a tensor of the
        model's that is new (not one it had at placement, nor one put in the place of a
        placed one, which ``check`` refuses on its own) is taken where it runs as it is,
        else refused. See [Note: a module put into a placed model]."""
        now = {}
        for r in registrations(self._modules[""]):
            now[id(r.tensor)] = r.tensor
            if id(r.tensor) in self._known or (id(r.registry), r.attr) in self._slots:
                continue
            if r.tensor.device == self._computes_on:
                continue
            self._passed = False
            self._seen = -1  # looked at again next call, until remove()
            where = r.module_name or "the model"
            on = (f"; {self._engine} computes on {self._computes_on}"
                  if self._computes_on is not None else
                  "; the engine moves or converts the model's parts between devices or "
                  "dtypes, and this one it never saw")
            raise PlacementError(
                f"{r.kind} {r.name!r} ({r.tensor.dtype} on {r.tensor.device}) was put into "
                f"module {where!r} while {self._engine} holds the model{on}, so this call "
                f"did not run. Call {self._handle}.remove() first (it restores the placed "
                f"tensors and keeps what you put in), then place the model again: change it "
                f"before placing it")
        self._known = now  # the model as it is now, what it no longer holds let go

    def follow_new_data(self) -> None:
        """Tensors given other data since (``t.data = new``; ``check`` has refused another
        dtype or device by then, ``put_back`` has undone it) are handed to
        ``on_new_data``, which adopts it, and are expected to hold it from now on."""
        ptrs = _pointers(self._tensors)
        if ptrs == self._ptrs or ptrs is None or self._ptrs is None:
            return
        changed = [i for i, (a, b) in enumerate(zip(ptrs, self._ptrs, strict=True)) if a != b]
        self.on_new_data([self._names[i] for i in changed])
        for i in changed:
            self._data[self._names[i]] = self._tensors[i].data
        self._ptrs = _pointers(self._tensors)

    def _adopted_changed(self) -> int | None:
        for i, (dtype, device) in self._adopted.items():
            t = self._registered[i]
            if t is not None and (t.dtype is not dtype or t.get_device() != device):
                return i
        return None

    def adopt_replacements(self) -> None:
        """At the end of an outermost call: objects the forward itself registered in place of
        the engine's (a buffer re-registered, as dynamic RoPE does, or reassigned, as in
        ``self.steps = self.steps + 1``) are the model's own state, checked as they are from
        now on and kept by ``remove()``. After a refused call, nothing is adopted."""
        passed, self._passed = self._passed, False
        if passed and _registrations[0] != self._seen:  # what the forward put in: its own
            self._seen = _registrations[0]
            self._known = _by_id(self._modules[""])
        if not passed or all(map(operator.is_, map(dict.get, self._registries, self._attrs),
                   self._registered)):
            return
        for i, (registry, attr) in enumerate(zip(self._registries, self._attrs, strict=True)):
            now = registry.get(attr)
            if now is not self._registered[i]:
                self._registered[i] = now  # None: deleted, nothing left to check there
                if now is not None:
                    self._adopted[i] = (now.dtype, now.get_device())

    def _refuse(self) -> NoReturn:
        what = "a tensor changed"
        dropped = ""
        for registry, attr, t, label in zip(self._registries, self._attrs, self._registered,
                                            self._kinds, strict=True):
            if registry.get(attr) is not t:
                what = (f"{label} was replaced by another object (a dtype or device "
                        f"conversion, an assignment, or load_state_dict(..., assign=True))")
                dropped = (
                    "; remove() registers the original objects again, which drops whatever "
                    "was assigned in their place (weights loaded with assign=True too): to "
                    "load weights into a placed model use adaptive.load(model, checkpoint) "
                    "or load_state_dict(state_dict) without assign=True")
                break
        changed = self._adopted_changed()
        if changed is not None:
            t = self._registered[changed]
            what = f"{self._kinds[changed]} is now {t.dtype} on {t.device}"  # type: ignore[union-attr]
        for name, t, placed in zip(self._names, self._tensors, self._data.values(),
                                   strict=True):
            if t.dtype is not placed.dtype or t.get_device() != placed.get_device():
                what = (f"{name!r} is {t.dtype} on {t.device}, but {self._engine} placed it "
                        f"as {placed.dtype} on {placed.device}")
                break
        raise PlacementError(
            f"{what} while {self._engine} holds the model: model.half(), .float(), .to(), "
            f".cuda() and .cpu() are not followed by a placed model, nor is data of another "
            f"dtype or device given through .data (give new data the dtype and device the "
            f"tensor has between calls), so this call did not run. Call "
            f"{self._handle}.remove() first (it restores every tensor as it was "
            f"before placement), then convert the model and place it again{dropped}"
        )

    def put_back(self) -> None:
        """Register the original objects again and point every converted tensor back at
        the data it held at rest. Objects a forward registered are kept, in the dtype and
        device the object they replaced had before placement; others registered since (a
        conversion, ``load_state_dict(..., assign=True)``) are dropped, which is logged."""
        dropped = []
        for i, (registry, attr, t) in enumerate(zip(self._registries, self._attrs,
                                                    self._registered, strict=True)):
            if t is None:
                continue
            now = registry.get(attr)
            if now is not None and now is not t:
                dropped.append(self._kinds[i])
            if i in self._adopted:
                dtype, device = self._homes[i]
                want = dtype if t.is_floating_point() and dtype.is_floating_point else t.dtype
                if t.dtype != want or t.device != device:
                    with torch.no_grad():
                        moved = t.to(device=device, dtype=want)
                    t = (nn.Parameter(moved, requires_grad=t.requires_grad)
                         if isinstance(t, nn.Parameter) else moved)
            if registry.get(attr) is not t:
                registry[attr] = t
        if dropped:
            logger.warning(
                "%s: remove() registered the original objects again in place of %d that "
                "replaced them while the model was placed (first: %s), and dropped those: a "
                "conversion, an assignment or load_state_dict(..., assign=True) is not kept",
                self._engine, len(dropped), dropped[0])
        for t, data in zip(self._tensors, self._data.values(), strict=True):
            if (t.dtype is not data.dtype or t.get_device() != data.get_device()
                    or t.is_meta != data.is_meta):
                _point_at(t, data)

    def release(self) -> None:
        """Forget everything (at the end of ``remove()``): no checks, no data kept alive."""
        self._names, self._tensors, self._dtypes, self._devices = [], [], [], []
        self._registries, self._attrs, self._registered, self._kinds = [], [], [], []
        self._homes = []
        self._adopted, self._data, self._ptrs = {}, {}, []
        self._modules, self.on_new_data, self._released = {}, None, True
        self._known, self._slots = {}, set()


# See [Note: a module put into a placed model]: every module, parameter and buffer registered
# anywhere in the process bumps this count (torch's global registration hooks, run by
# ``Module.__setattr__``, ``add_module``, ``register_buffer``), so a call compares one
# integer and walks the model only after some registration. Deleting a module registers
# nothing, and is taken as it is.
_registrations = [0]


def _by_id(model: nn.Module) -> dict[int, torch.Tensor]:
    """Every tensor registered in ``model``, by id (see ``PlacementGuard._known``)."""
    return {id(r.tensor): r.tensor for r in registrations(model)}


def _registered(*args: Any) -> None:
    _registrations[0] += 1


for _register in (nn.modules.module.register_module_module_registration_hook,
                  nn.modules.module.register_module_parameter_registration_hook,
                  nn.modules.module.register_module_buffer_registration_hook):
    _register(_registered)


_tracing_state = torch._C._get_tracing_state  # not None under torch.jit.trace
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)  # torch 2.4 and later
_dtype_of = operator.attrgetter("dtype")
_no_modes = torch._C.DisableTorchFunction
_training = operator.attrgetter("training")
_device_of = torch.Tensor.get_device


_data_ptr = operator.methodcaller("data_ptr")


def _pointers(tensors: Sequence[torch.Tensor]) -> list[int] | None:
    """Each tensor's data pointer, asked as a user would (a tensor subclass, a simulated
    device's, answers through its ``__torch_function__``); None when one has none to give
    (then new data given through ``.data`` is not looked for)."""
    try:
        return list(map(_data_ptr, tensors))
    except RuntimeError:
        return None


def _metadata(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.dtype], list[int]]:
    """Dtypes and device indices: one pass per property in C (map), not a Python loop."""
    return list(map(_dtype_of, tensors)), list(map(_device_of, tensors))


def _point_at(t: torch.Tensor, data: torch.Tensor) -> None:
    """``t.data = data``, also across the meta device (which ``set_data`` cannot cross)."""
    with torch.no_grad():
        if t.is_meta == data.is_meta:
            t.data = data
            return
        new = (nn.Parameter(data, requires_grad=t.requires_grad)
               if isinstance(t, nn.Parameter) else data)
        torch.utils.swap_tensors(t, new)
