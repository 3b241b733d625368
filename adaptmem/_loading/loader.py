"""Memory-efficient loading: every checkpoint tensor read once, straight to its final place.

``load`` works in three steps. It plans (which model tensor each checkpoint key fills, and
where that tensor ends up), checks (missing and unexpected keys, shapes, files) and refuses
before anything changes, then reads tensor by tensor: into the existing tensor when one is
already in the right place, else into a new tensor made on the target device. New tensors are
swapped into the model only once all of them were read, so a failed read leaves the model as
it was. Peak memory is the final footprint plus one staging buffer of the largest tensor
(used only for a dtype conversion or a device copy).

A placement handle (``adaptive.page``/``chunk``/``split``, or a user's own object) given as
``device=`` says where each tensor's value goes through the ``LoadTargets`` protocol
(``_engines/base.py``): ``load_targets()`` is called once per load, before any read, and the
checkpoint tensor is read once for all the tensors it lists. A name it does not have is an
error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

import torch
from torch import nn
from torch.autograd.graph import increment_version
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import TorchDispatchMode

from .._common.claims import holders, owner_of
from .._common.devices import default_device, format_bytes, resolve_device
from .._common.errors import LoadError, add_note
from .._common.oom import is_oom
from .._common.reporting import report
from .._engines.base import Engine, LoadTargets
from .._engines.stats import LoadStats
from .._planning import HiddenWeightsError, ModuleSizes, Plan, module_sizes, split_label
from .checkpoints import Checkpoint, Entry, Reader, copy_to, is_extra_state_key, open_checkpoint

__all__ = ["load", "empty_model"]

M = TypeVar("M", bound=nn.Module)  # the model's own type, kept by load and empty_model

logger = logging.getLogger("adaptmem")


# [Note: one patch for every empty_model]
# Parameters are sent to meta from inside `nn.Module.register_parameter`, the one place every
# parameter passes through, so that function is patched while a factory runs. Patching it
# per call was not thread-safe: with two calls at once, the second saved the first's patch
# as "the original" and, ending last, put it back for good (every module built afterwards
# in the process got meta parameters). So one patch serves every call running: the first
# installs it, the last removes it (a count under a lock), and it acts only in the threads
# that are inside `empty_model` (a thread-local depth), so modules other threads build
# meanwhile keep real parameters. The dispatch mode that skips initialisation and
# `inference_mode` are thread-local already.
_patch_lock = threading.Lock()
_patch_users = 0
_patches: list[tuple[Any, Any]] = []  # (original, patch) while installed
_building = threading.local()  # .depth: empty_model calls this thread is inside


def _register_on_meta(original: Any) -> Any:
    """``nn.Module.register_parameter`` that sends parameters to meta in threads inside
    ``empty_model`` (See [Note: one patch for every empty_model])."""

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        # Lazy modules' UninitializedParameter holds no memory and builds itself later.
        if (getattr(_building, "depth", 0) and param is not None
                and param.device.type != "meta"
                and not isinstance(param, nn.UninitializedParameter)):
            module._parameters[name] = _reparameter(param, param.to("meta"))

    return register_parameter


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Send every parameter this thread registers inside the block to the meta device.

    Buffers stay real: constructors compute non-persistent buffers (rotary ``inv_freq``,
    ``position_ids``, causal masks) that no checkpoint holds, and once made on meta their
    values are lost. accelerate's ``init_empty_weights(include_buffers=False)`` does the same.
    """
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            original = nn.Module.register_parameter
            patch = _register_on_meta(original)
            nn.Module.register_parameter = patch  # type: ignore[method-assign]
            _patches.append((original, patch))
        _patch_users += 1
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        # Ordinary tensors even when called in inference mode: placement refuses
        # inference tensors (they track no versions).
        with torch.inference_mode(False), _SkipWritesToMeta():
            yield
    finally:
        _building.depth -= 1
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                original, patch = _patches.pop()
                # Another library's patch made on top of ours stays, ours inert under it.
                if nn.Module.register_parameter is patch:
                    nn.Module.register_parameter = original  # type: ignore[method-assign]


def _reparameter(old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter over ``data`` of ``old``'s class (without calling its constructor, which
    may want more arguments), ``requires_grad`` and attributes (``no_decay``, ...), as an
    in-place ``load_state_dict`` would leave them."""
    if type(data) is torch.Tensor:
        new = torch.Tensor._make_subclass(type(old), data, old.requires_grad)
    else:  # a tensor subclass (a simulated device's): Parameter's own path for those
        try:
            new = type(old)(data, requires_grad=old.requires_grad)
        except TypeError:
            new = nn.Parameter(data, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    return new  # type: ignore[no-any-return]


class _SkipWritesToMeta(TorchDispatchMode):
    """In-place writes to meta tensors return at once, doing nothing.

    What they would compute has no values to land in, yet torch runs them: ``normal_``,
    ``uniform_``, ``trunc_normal_``'s five steps, ... through Python reference kernels, which
    made weight initialisation (``reset_parameters``, ``torch.nn.init``, Hugging Face's
    ``_init_weights``) most of ``empty_model``'s time. Metadata changes (``resize_``,
    ``squeeze_``, ``as_strided_``: tagged ``inplace_view``) still run, and so does every op
    on a real tensor: buffers get their constructor values.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ so that torch.compile skips it, and that
        # wrapper imports torch._dynamo on its first call: about 1.1 s of a first empty_model
        # on the 2-core VM where torch._dynamo is not imported yet (plain torch models;
        # torchvision and transformers import it), for a mode that only returns early.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if args and isinstance(args[0], torch.Tensor) and args[0].is_meta and _writes_values(func):
            return args[0]
        return func(*args, **(kwargs or {}))


_INPLACE = getattr(torch.Tag, "inplace", None)  # torch 2.12 and later
_WRITES: dict[Any, bool] = {}


def _writes_values(func: Any) -> bool:
    """Whether ``func`` writes values into its first argument, in place: tagged ``inplace``
    (torch 2.12+), else its schema marks that argument, a tensor, written (``Tensor(a!)
    self``). On torch 2.14 the two agree but for optimizer steps that take lists (no
    initialiser calls them) and a few untagged ops that also only write values (``copy_``
    overloads, ``index_put_``). Metadata changes (tagged ``inplace_view``) are not value
    writes."""
    writes = _WRITES.get(func)
    if writes is None:
        if torch.Tag.inplace_view in func.tags:
            writes = False
        elif _INPLACE is not None:
            writes = _INPLACE in func.tags
        else:
            arguments = func._schema.arguments
            alias = arguments[0].alias_info if arguments else None
            writes = (alias is not None and alias.is_write
                      and isinstance(arguments[0].type, torch.TensorType))
        _WRITES[func] = writes
    return writes


def empty_model(factory: Callable[[], M]) -> M:
    """Build ``factory()`` with its parameters on the meta device, so they cost no memory.

    Buffers are built for real on the CPU: they are small, and constructors compute the
    non-persistent ones (rotary ``inv_freq``, ``position_ids``) that no checkpoint holds.
    Parameters are moved to meta as they are registered, so at most one parameter is ever
    held. Weight initialisation is skipped: the constructor runs as written, but every
    in-place write to a meta tensor (``reset_parameters``, ``torch.nn.init``, Hugging Face's
    ``_init_weights``) returns at once without computing anything, while ops on real
    tensors (the buffers) run normally. The checkpoint fills the parameters; one it does not
    hold (``strict=False``) is left uninitialised by ``load``, with a warning naming it.
    Pass the result to ``adaptive.load`` or ``adaptive.plan``. Thread-safe: several calls
    may run at once, and modules other threads build meanwhile keep real parameters.

    Args:
        factory: a zero-argument callable returning an ``nn.Module`` (a class, a lambda).

    Returns:
        The module, every parameter on the meta device, buffers on the CPU.

    Raises:
        TypeError: ``factory`` is not callable or does not return an ``nn.Module``.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> net = adaptive.empty_model(lambda: torch.nn.Linear(4096, 4096))
        >>> net.weight.device
        device(type='meta')
    """
    if isinstance(factory, nn.Module) or not callable(factory):
        raise TypeError(
            f"factory must be a zero-argument callable that builds the model (a class or a "
            f"lambda), got {type(factory).__name__}; to load into a built model pass it to "
            f"adaptive.load directly"
        )
    try:
        with _parameters_on_meta():
            model = factory()
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" in str(exc):  # the constructor read a weight's values (orthogonal's .item())
            add_note(exc, "adaptmem: the factory ran under adaptive.empty_model, which puts "
                     "parameters on the meta device (no values), and its constructor reads them. "
                     "Build the model yourself and pass it to adaptive.load (filled in place), "
                     "or use model.load_state_dict")
        raise
    if not isinstance(model, nn.Module):
        raise TypeError(f"factory {factory!r} returned {type(model).__name__}, not an nn.Module")
    return model


@dataclass
class _Dest:
    """Where one distinct model tensor goes: copied into ``into``, or a new tensor made on
    ``device`` (pinned host memory when ``pinned``) with ``dtype``. ``own``: ``into`` is the
    model's own CPU tensor, already in place and alone on its storage (not a handle's
    copies), which ``copy=False`` may map instead."""

    name: str
    current: torch.Tensor
    dtype: torch.dtype
    device: torch.device | None = None
    pinned: bool = False
    into: list[torch.Tensor] = field(default_factory=list)
    own: bool = False

    def empty(self) -> torch.Tensor:
        """A new tensor for this destination, in the model tensor's memory format (as
        ``Module.to`` keeps it: a channels-last convolution weight stays channels last)."""
        assert self.device is not None
        return torch.empty(self.current.shape, dtype=self.dtype, device=self.device,
                           pin_memory=self.pinned, memory_format=_memory_format(self.current))


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    """The memory format ``t``'s strides follow: channels last (2d or 3d) where they say so,
    else contiguous (what a new tensor takes when ``t``'s strides name no format)."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(
            memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(
            memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _placements(sizes: ModuleSizes, device: Any, making: bool) -> Callable[[str], Any]:
    """A function: canonical tensor name -> list of tensors to copy into, or (device, pinned,
    dtype floating tensors take there or None); ``making``: the model has meta tensors."""
    if isinstance(device, LoadTargets):
        targets = device.load_targets()
        if not isinstance(targets, Mapping):
            raise TypeError(f"{type(device).__name__}.load_targets() must return a dict of "
                            f"tensor name -> list of tensors, got {type(targets).__name__}")
        unknown = sorted(set(targets) - set(sizes.tensors))
        if unknown:
            raise LoadError(f"{type(device).__name__} places tensors this model does not have: "
                            f"{', '.join(unknown[:5])}; it manages a different model")
        return lambda name: list(targets.get(name) or ())
    if isinstance(device, Plan):
        where = {t: u.placement for u in device.units for t in (*u.tensors, *u.borrowed)}
        unplanned = [n for n in sizes.tensors if n not in where]
        if unplanned:
            raise LoadError(f"the plan does not place {', '.join(unplanned[:5])}"
                            f"{' ...' if len(unplanned) > 5 else ''}; make it from this model")
        _check_plan_sizes(device, sizes, where)
        pin = torch.cuda.is_available()
        resolved: dict[str, tuple[torch.device, bool, torch.dtype | None]] = {}
        for place in set(where.values()):
            if place == "paged":
                resolved[place] = (torch.device("cpu"), pin, None)
            else:
                resolved[place] = _plan_target(device, place)
        return lambda name: resolved[where[name]]
    if device is None:
        # A model with meta tensors (a factory, or built on meta) is being made: all of it
        # goes to default_device(), its real buffers too, so that it runs where it lands.
        # A model without them stays where it is, each tensor on its device.
        if making:
            dev = default_device()
            return lambda name: (dev, False, None)
        return lambda name: (None, False, None)
    dev = resolve_device(device)
    return lambda name: (dev, False, None)


def _check_plan_sizes(plan: Plan, sizes: ModuleSizes, where: Mapping[str, str]) -> None:
    """Refuse a plan made for another model: one naming tensors this model lacks, or whose
    units' bytes are not what this model's tensors take there (a device would receive more
    than the plan gave it)."""
    how = ("make the plan from this model: adaptive.plan(adaptive.empty_model(factory), "
           "devices=...)")
    extra = [n for n in where if n not in sizes.tensors]
    if extra:
        raise LoadError(f"the plan places {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}"
                        f", which this model does not have: it was made for another model; "
                        f"{how}")
    for unit in plan.units:
        dtype = None if unit.placement == "paged" else plan.dtype_of(unit.placement)
        actual = sizes.bytes_of(unit.tensors, dtype)
        if actual != unit.nbytes:
            raise LoadError(
                f"the plan sized unit {unit.module or '(the whole model)'!r} at "
                f"{format_bytes(unit.nbytes)} on {unit.placement}, but this model's tensors "
                f"there take {format_bytes(actual)}: it was made for a model of other shapes "
                f"or dtypes; {how}")


def _plan_target(plan: Plan, label: str) -> tuple[torch.device, bool, torch.dtype | None]:
    """(device, pinned, dtype) of a plan's placement ``label`` (``"cuda:0"``,
    ``"cpu@bfloat16"``): the dtype is the one the plan sized that device's units in."""
    name, _ = split_label(label)
    return resolve_device(name, f"plan placement {label!r}"), False, plan.dtype_of(label)


# Typed by the model given (a module, or a factory's), and by return_stats.
@overload
def load(model_or_factory: M, checkpoint: str | os.PathLike[str], *, device: Any = None,
         strict: bool = True, dtype: torch.dtype | None = None, copy: bool = True,
         return_stats: Literal[False] = False, key: str | None = None) -> M: ...
@overload
def load(model_or_factory: Callable[[], M], checkpoint: str | os.PathLike[str], *,
         device: Any = None, strict: bool = True, dtype: torch.dtype | None = None,
         copy: bool = True, return_stats: Literal[False] = False, key: str | None = None,
         ) -> M: ...
@overload
def load(model_or_factory: M, checkpoint: str | os.PathLike[str], *, device: Any = None,
         strict: bool = True, dtype: torch.dtype | None = None, copy: bool = True,
         return_stats: Literal[True], key: str | None = None) -> tuple[M, LoadStats]: ...
@overload
def load(model_or_factory: Callable[[], M], checkpoint: str | os.PathLike[str], *,
         device: Any = None, strict: bool = True, dtype: torch.dtype | None = None,
         copy: bool = True, return_stats: Literal[True], key: str | None = None,
         ) -> tuple[M, LoadStats]: ...
@overload
def load(model_or_factory: nn.Module | Callable[[], nn.Module],
         checkpoint: str | os.PathLike[str], *, device: Any = None, strict: bool = True,
         dtype: torch.dtype | None = None, copy: bool = True, return_stats: bool = False,
         key: str | None = None) -> nn.Module | tuple[nn.Module, LoadStats]: ...
def load(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    checkpoint: str | os.PathLike[str],
    *,
    device: Any = None,
    strict: bool = True,
    dtype: torch.dtype | None = None,
    copy: bool = True,
    return_stats: bool = False,
    key: str | None = None,
) -> Any:
    """Load ``checkpoint`` into a model, each tensor read once and put straight where it
    stays, so peak memory is the final footprint plus about one tensor.

    Formats: a ``torch.save``d state dict (only its pickle is read up front; tensors are
    read one at a time, never the whole file at once; or a training checkpoint holding it
    under ``state_dict``, ``model_state_dict``, ``model`` or ``module``, or under the entry
    ``key`` names), a ``.safetensors`` file, a sharded
    checkpoint with an ``*.index.json`` (Hugging Face layout, either format; pass the index
    or its directory), or a directory of checkpoint files, e.g. one file per tensor (a
    ``torch.save``d bare tensor is named by its file name without the suffix; when a
    directory holds both ``.safetensors`` and ``torch.save`` files, only the former are read;
    a directory with ``model.safetensors`` or ``pytorch_model.bin``, as Hugging Face saves a
    model or a Trainer checkpoint, reads that file only).

    Tied weights are read once and stay tied. Buffers load too; non-persistent buffers (in
    no checkpoint) keep the values the model's constructor gave them, which is why a factory
    is built with ``empty_model`` (parameters on meta, buffers real). A model tensor already
    in its final place (same device and dtype) is filled in place and keeps its identity; a
    meta tensor is replaced by a new one on the target device (same ``Parameter`` type and
    ``requires_grad``); a real tensor on another device has its ``.data`` swapped. New
    tensors keep the model tensor's memory format (a channels-last weight stays channels
    last, as ``Module.to`` keeps it). Without ``dtype``, each tensor keeps the model's dtype
    (as ``load_state_dict`` does), or takes the dtype its placement has in a ``Plan`` made
    with one, converting what the checkpoint stores (dtype, layout) on the way; writes
    happen outside autograd and bump version counters as ``copy_`` would.

    Zero-copy: with ``copy=False``, CPU tensors that need no conversion are not read at all
    but stay backed by a private copy-on-write mapping of the checkpoint file: loading is
    instant, pages are read on first use and are shared with the page cache, writes stay in
    this process, and the file must not be truncated or replaced while the model lives. A
    built model's own CPU tensors are mapped too: their ``.data`` is swapped (the
    ``Parameter`` objects stay) and the memory they held is freed; those sharing a
    storage, pinned ones and inference tensors are filled in place instead.
    Checkpoint tensors whose bytes overlap (saved tied, or as views of one storage) that the
    model keeps apart are read instead, so that they do not share memory. The default
    ``copy=True`` reads them into ordinary memory.

    Args:
        model_or_factory: an ``nn.Module`` (built normally or on the meta device), or a
            zero-argument factory, built with ``empty_model`` so its parameters cost nothing.
        checkpoint: path to a file, an ``*.index.json``, or a directory.
        device: where tensors go. A device (``"cuda:0"``, ``"cpu"``); ``None``: a model
            with meta tensors (a factory, or built on meta) goes whole, buffers included,
            to the current accelerator, else the CPU; a model without them stays where it
            is, each tensor on its device. Or a ``Plan`` from ``adaptive.plan``: each tensor goes to its unit's
            placement, paged units to pinned host memory (plain CPU memory without CUDA). Or
            a placement handle (``adaptive.page``/``chunk``/``split``): each checkpoint tensor
            is copied in place into every copy the handle keeps (host and device). A model
            such a handle holds (or one held for a ``model=`` function) loads through it
            when no ``device``, ``dtype`` or ``copy=False`` is given; with them it is a
            ``LoadError`` before any read. A handle loads only the model it holds.
        strict: missing and unexpected keys are errors (shape mismatches always are). With
            ``strict=False`` a missing tensor keeps its value in a built model; in a model
            built on meta or from a factory it is left uninitialised (``empty_model`` skips
            initialisation), logged as a warning naming it and listed in ``missing_keys``.
        dtype: floating tensors (parameters and buffers) are converted to this on the way;
            integer and bool tensors keep theirs. Not with a placement handle, whose copies
            already have their dtype, nor other than the dtype a ``Plan`` was made with.
        copy: False keeps CPU tensors backed by the checkpoint file (see above).
        return_stats: also return a ``LoadStats`` (files, tensors, bytes read, bytes per
            device, bytes mapped, missing/unexpected keys, seconds).
        key: the entry of a ``torch.save``d dict that holds the state dict (``"ema"``,
            ``"net"``, ``"g_ema"``), where the file holds another beside it or under a name
            not looked for by default. Only for a single ``torch.save`` file.

    Returns:
        The model, or ``(model, stats)`` with ``return_stats=True``.

    Raises:
        LoadError: missing keys, unexpected keys (strict) and shape mismatches, reported
            together in ``load_state_dict``'s wording; a checkpoint that is missing, not a
            checkpoint, truncated or with a corrupt header or layout (tensor data carries no
            checksum: a flipped byte in it loads silently, as with ``torch.load``), or a
            missing shard (the message names the file); a non-persistent buffer on meta
            that no checkpoint can fill; a lazy module not run yet (``nn.LazyLinear``: its
            shapes are unknown); the model is unchanged. Running out of memory while the
            load makes tensors leaves it unchanged too. Also a checkpoint tensor that cannot
            be copied into its target (naming both), a file that fails or changes while it
            is read, or an interrupt (``KeyboardInterrupt``): a built model's tensors filled
            in place before it keep their new values.
        TypeError / ValueError: an argument of the wrong kind or value (named in the message),
            such as ``strict``, ``copy`` or ``return_stats`` that is not a bool.

    Example:
        >>> import torch, tempfile, os
        >>> from adaptmem import adaptive
        >>> path = os.path.join(tempfile.mkdtemp(), "net.pt")
        >>> torch.save(torch.nn.Linear(8, 2).state_dict(), path)
        >>> net = adaptive.load(lambda: torch.nn.Linear(8, 2), path, device="cpu")
        >>> net.weight.device
        device(type='cpu')
    """
    start = time.perf_counter()
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float16, got {dtype!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating dtype; it converts floating tensors")
    if isinstance(device, LoadTargets) and dtype is not None:
        raise ValueError(f"dtype cannot be combined with device={type(device).__name__}: its "
                         f"copies already have their dtype; set it when creating the handle")
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a path (str or os.PathLike), got "
                        f"{type(checkpoint).__name__}")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key must be the name of an entry of the checkpoint's dict (a str), "
                        f"got {type(key).__name__} {key!r:.80}")
    for flag, value in (("strict", strict), ("copy", copy), ("return_stats", return_stats)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be True or False, got {value!r}")
    if isinstance(device, Plan) and dtype is not None:
        planned = {device.dtype_of(u.placement) for u in device.units
                   if u.placement != "paged"} - {None}
        if planned - {dtype}:
            raise ValueError(
                f"dtype={dtype} conflicts with the plan, which sized its units in "
                f"{', '.join(sorted(str(d) for d in planned))}; leave dtype out to load "
                f"each tensor in its placement's dtype, or make the plan with dtype={dtype}")
    if isinstance(model_or_factory, nn.Module):
        model = model_or_factory
    elif callable(model_or_factory):
        if isinstance(device, LoadTargets):
            raise TypeError("a placement handle manages a built model: pass that model, not a "
                            "factory, together with device=handle")
        model = empty_model(model_or_factory)
    else:
        raise TypeError(f"model_or_factory must be an nn.Module or a zero-argument factory, "
                        f"got {type(model_or_factory).__name__}")

    device = _through_holder(model, device, dtype, copy)
    try:
        sizes = module_sizes(model)
    except HiddenWeightsError as exc:  # packed (quantized) weights
        raise LoadError(f"{exc}. To load this model's checkpoint, use "
                        f"model.load_state_dict(torch.load(path))") from None
    except ValueError as exc:  # a lazy module's tensor, whose shape is not known yet
        raise LoadError(f"{exc}. adaptive.load needs every tensor's shape before it reads; it "
                        f"does not size lazy modules from the checkpoint as load_state_dict "
                        f"does") from None
    ckpt = open_checkpoint(checkpoint, key)
    dests, sources, stats, restores = _plan_load(model, sizes, ckpt, device, strict, dtype,
                                                 model is not model_or_factory)
    # Model tensors are written in place (a built model, a handle's copies): outside
    # autograd, or a leaf that requires grad refuses every converting copy. New tensors are
    # ordinary ones even when the caller is in inference mode (placement refuses inference
    # tensors, which track no versions); an inference tensor is written in inference mode.
    with torch.inference_mode(False), torch.no_grad():
        # Everything new is made before the model changes (tensors filled in place are
        # written by the reads): an allocation that fails (out of memory on the device)
        # leaves the model as it was.
        unloaded = _unloaded(model, dests, sources, stats)
        with Reader(files=len(ckpt.files), identities=ckpt.identities) as reader:
            pending = _read_all(reader, ckpt, dests, sources, copy, stats)
            _commit(model, sizes, {**pending, **unloaded})
            _restore_extra_states(reader, ckpt, restores)
    stats.seconds = time.perf_counter() - start
    # Shown while the model lives, returned or not: see [Note: one place for statistics].
    report(model, f"load ({_label(stats.files)})", stats)
    logger.info(
        "adaptmem.load: %d tensors, %s read, %s mapped from %d file(s) in %.2fs (%s)",
        stats.tensors, format_bytes(stats.bytes_read), format_bytes(stats.bytes_mapped),
        len(stats.files), stats.seconds,
        ", ".join(f"{d} {format_bytes(n)}" for d, n in stats.bytes_by_device.items()),
    )
    return (model, stats) if return_stats else model


# [Note: loading a placed model] An engine (``Pager``, ``Chunker``, ``Splitter``, or one a
# ``model=`` function made) keeps copies of the tensors it holds: host masters, device
# copies, originals in another dtype kept for ``remove()``. A load into the model's own
# tensors alone would miss them or leave them stale (a bfloat16 chunk kept the checkpoint at
# bfloat16 precision), and one that swaps or maps tensors (``dtype=``, ``copy=False``, a
# device) would leave the engine holding the old ones. So a plain load of a model that
# engines hold, or of one holding placed parts, goes through every engine concerned
# (``load_targets``), tensors no engine holds in place; anything else is refused before any
# read, and a handle passed as ``device=`` loads only the model it holds.
def _through_holder(model: nn.Module, device: Any, dtype: torch.dtype | None,
                    copy: bool) -> Any:
    """Where a load of ``model`` goes when engines hold it or parts of it (See [Note: loading
    a placed model]). Returns the ``device`` to load with."""
    if isinstance(device, Engine):
        root = device.held_model
        if root is model:
            return device
        if root is None:
            raise LoadError(
                f"device={type(device).__name__} holds no model now (it was removed, and its "
                f"model is as it was before); load without device=, or place the model again "
                f"and pass the new handle")
        relation = ("is part of the model it holds" if any(m is model for m in root.modules())
                    else "holds part of this model" if any(m is root for m in model.modules())
                    else "holds a different model")
        raise LoadError(
            f"device={type(device).__name__} {relation}, and a handle loads only the model it "
            f"was made for: pass that model with device={type(device).__name__}, or load this "
            f"one without device= (every engine holding part of it then gets its values)")
    held = holders(model)
    for handle in list(held):
        owner = owner_of(handle)
        if owner is not None and owner.release_if_abandoned():  # its function was collected
            held.remove(handle)
    if not held:
        return device
    if device is None and dtype is None and copy:
        if len(held) == 1 and held[0].held_model is model:
            return held[0]
        return _HeldParts(model, held)
    first = held[0]
    owner = owner_of(first)
    given = ", ".join(f for f, on in (("device=", device is not None),
                                      ("dtype=", dtype is not None), ("copy=False", not copy))
                      if on)
    fix = (owner.fix() if owner is not None else
           f"call {getattr(first, 'handle_name', 'handle')}.remove() first")
    part = "this model" if first.held_model is model else "a model that shares modules with it"
    raise LoadError(
        f"{part} is held by {getattr(first, 'made_by', type(first).__name__)} (a "
        f"{type(first).__name__}): a load with {given} would swap or map tensors under it and "
        f"miss the copies it keeps. Load without them (each value then goes into every copy "
        f"the {type(first).__name__} keeps, in its dtype), or {fix} and load the model alone")


class _HeldParts:
    """The ``LoadTargets`` of the engines holding parts of a model (a paged submodule) or a
    model it is part of, by the model's own tensor names; tensors no engine holds are
    filled in place."""

    def __init__(self, model: nn.Module, handles: list[Engine]) -> None:
        self.model = model
        self.handles = handles

    def load_targets(self) -> dict[str, list[torch.Tensor]]:
        sizes = module_sizes(self.model)
        by_id = {id(t): name for name, t in _current_tensors(self.model, sizes).items()}
        out: dict[str, list[torch.Tensor]] = {}
        for handle in self.handles:
            root = handle.held_model
            assert root is not None
            theirs = _current_tensors(root, module_sizes(root))
            for name, targets in handle.load_targets().items():
                ours = by_id.get(id(theirs.get(name)))
                if ours is not None:  # None: a tensor of the larger model outside this one
                    out[ours] = list(targets)
        return out


def _plan_load(
    model: nn.Module, sizes: ModuleSizes, ckpt: Checkpoint, device: Any, strict: bool,
    dtype: torch.dtype | None, built: bool = False,
) -> tuple[dict[str, _Dest], dict[str, Entry], LoadStats, dict[str, nn.Module]]:
    """Match keys, decide every destination, and raise before anything is modified. Also
    the modules that get extra state from the checkpoint (See [Note: extra state]).
    ``built``: the model was built here from a factory (``empty_model``)."""
    tensors = _current_tensors(model, sizes)
    by_id = {id(t): name for name, t in tensors.items()}
    # A state-dict hook may hand out new tensors (cast, say): their keys still name them.
    by_key = {qualified: name for name, info in sizes.tensors.items()
              for qualified in (name, *info.aliases)}
    keys: dict[str, list[str]] = {}  # canonical name -> its state-dict keys
    for key, value in model.state_dict(keep_vars=True).items():
        name = (by_id.get(id(value)) or by_key.get(key)) if isinstance(value, torch.Tensor) \
            else None
        if name is not None:
            keys.setdefault(name, []).append(key)
    absent: list[list[str]] = []  # the keys of each tensor the checkpoint lacks
    mismatched: list[str] = []
    sources: dict[str, Entry] = {}
    for name, names in keys.items():
        present = [k for k in names if k in ckpt.entries]
        if not present:
            absent.append(names)
            continue
        shape = tuple(tensors[name].shape)
        for k in present:
            if ckpt.entries[k].shape != shape:
                mismatched.append(
                    f"size mismatch for {k}: copying a param with shape "
                    f"{torch.Size(ckpt.entries[k].shape)} from checkpoint, the shape in current "
                    f"model is {torch.Size(shape)}."
                )
        sources[name] = ckpt.entries[present[-1]]  # load_state_dict ends with the last
    # BatchNorm's own loading gives a checkpoint from before num_batches_tracked (state-dict
    # version 1) the counter it lacks: the module's value stays, as load_state_dict keeps it
    # (one built on meta starts at 0: _unloaded).
    absent = [g for g in absent if not all(_is_batch_counter(model, k) for k in g)]
    missing = [k for g in absent for k in g]
    # See [Note: extra state]
    restores = _extra_states(model)
    no_extra = [k for k in restores if k not in ckpt.entries and k not in ckpt.extra_states]
    expected = {k for names in keys.values() for k in names} | set(restores)
    unexpected = [k for k in (*ckpt.entries, *ckpt.extra_states) if k not in expected]
    unreadable = [k for k in restores if _holds_unread(ckpt.extra_states.get(k))]
    errors = []
    if strict and missing:
        errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
    if strict and unexpected:
        errors.append("Unexpected key(s) in state_dict: "
                      + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    errors.extend(mismatched)
    if strict and missing and unexpected:
        errors.extend(_prefix_hint(absent, unexpected))
    if strict and unreadable:
        errors.append(
            "extra state holding tensors inside another object (" + ", ".join(unreadable)
            + "), which adaptive.load cannot read: load with model.load_state_dict, or pass "
            "strict=False to load the rest without it. ")
    # Parameters the model's state dict leaves out (a hook dropping frozen weights) are left
    # uninitialised like missing ones (_settle_unloaded warns); buffers would lose values.
    lost = [n for n in tensors if n not in keys and tensors[n].device.type == "meta"
            and sizes.tensors[n].kind != "parameter"]
    if lost and built:  # empty_model keeps buffers real: the constructor made these on meta
        errors.append(
            "non-persistent buffer(s) that the factory's constructor made on the meta "
            "device, which no checkpoint holds: " + ", ".join(lost) + ". The constructor "
            "made them from parameters, which adaptive.empty_model puts on meta "
            "(torch.ones_like(self.linear.weight), say): make them from sizes instead "
            "(torch.ones(self.linear.weight.shape)), or build the model yourself and use "
            "model.load_state_dict."
        )
    elif lost:
        errors.append(
            "non-persistent buffer(s) on the meta device, which no checkpoint holds: "
            + ", ".join(lost) + ". Their values were lost when the model was built on meta; "
            "pass the factory (or build with adaptive.empty_model), which keeps buffers real."
        )
    own_code = _own_loading(model)
    if errors and own_code and (missing or unexpected):
        errors.append(
            "These modules load their state with code of their own (_load_from_state_dict, "
            "load hooks or extra state), which adaptive.load does not run and which may "
            "rename or drop keys of older checkpoints: " + ", ".join(own_code[:8])
            + (" ..." if len(own_code) > 8 else "") + ". Load with model.load_state_dict, or "
            "pass strict=False if the keys above may be ignored.")
    if errors:
        raise LoadError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t"
                        + "\n\t".join(errors))
    if unreadable:
        logger.warning("adaptmem.load: extra state holding tensors inside another object is "
                       "not restored: %s. Load with model.load_state_dict to restore it",
                       ", ".join(unreadable))
    if no_extra:  # a warning: a safetensors file cannot hold it; the module keeps its own
        logger.warning("adaptmem.load: the checkpoint has no extra state for %s; those modules "
                       "keep theirs (load_state_dict, with strict=True, would refuse it)",
                       ", ".join(no_extra))
    restores = {k: m for k, m in restores.items() if k not in no_extra and k not in unreadable}
    ignored = [k for k in unexpected if is_extra_state_key(k)]
    if ignored:
        logger.warning("adaptmem.load: extra state of modules that take none (no "
                       "set_extra_state) is ignored: %s", ", ".join(ignored))

    place = _placements(sizes, device, any(t.device.type == "meta" for t in tensors.values()))
    handle = isinstance(device, LoadTargets)
    shared = _shared_storages(tensors.values())
    dests: dict[str, _Dest] = {}
    for name, current in tensors.items():
        want = dtype if dtype is not None and current.is_floating_point() else current.dtype
        dest = _Dest(name, current, want)
        if handle:
            dest.into = place(name)
            if not dest.into and current.device.type != "meta":
                dest.into = [current]
            if not dest.into and name in sources:
                raise LoadError(f"{type(device).__name__} gives no place for {name!r} and the "
                                f"model's own tensor is on meta")
        else:
            target, pinned, planned = place(name)
            if planned is not None and dtype is None and current.is_floating_point():
                want = dest.dtype = planned  # the dtype the plan sized this tensor's unit in
            target = current.device if target is None and current.device.type != "meta" else (
                target or default_device())
            if (current.device == target and current.dtype == want
                    and (not pinned or current.is_pinned())):
                # A storage another model tensor uses too stays: it is filled in place.
                dest.into = [current]
                dest.own = (current.device.type == "cpu"
                            and current.untyped_storage().data_ptr() not in shared)
            else:
                dest.device, dest.pinned = target, pinned
        for t in dest.into:
            if t.numel() != current.numel():
                raise LoadError(f"{name!r}: a target holds {t.numel()} elements, the model "
                                f"tensor {current.numel()}; the handle does not match the model")
        dests[name] = dest
    stats = LoadStats(files=list(ckpt.files), format=ckpt.format,
                      missing_keys=missing + no_extra, unexpected_keys=unexpected)
    return dests, sources, stats, restores


def _prefix_hint(missing: list[list[str]], unexpected: list[str]) -> list[str]:
    """When every missing tensor is in the checkpoint under one prefix (saved from a
    ``DistributedDataParallel``, ``torch.compile`` or Lightning wrapper: ``module.``,
    ``_orig_mod.``, ``model.``), or the other way round, say so and how to load it.
    ``missing``: the keys of each missing tensor (a tied one has several: one found is
    enough, as loading it fills the others)."""
    if not missing:
        return []
    have = set(unexpected)
    # The checkpoint's keys are the missing ones under a prefix...
    prefixes = sorted({k[:-len(m)] for m in missing[0] for k in unexpected
                       if k.endswith("." + m)}, key=len)
    prefix = next((p for p in prefixes
                   if all(any(p + m in have for m in group) for group in missing)), None)
    if prefix:
        return [f"Every missing key is in the checkpoint with the prefix {prefix!r} (saved from "
                f"a DistributedDataParallel, DataParallel, torch.compile or Lightning wrapper?): "
                f"save the state dict without it ({{k.removeprefix({prefix!r}): v for k, v in "
                f"state_dict.items()}}), or load into the wrapper that adds it."]
    # ... or the missing ones are the checkpoint's under a prefix.
    prefixes = sorted({m[:-len(k)] for m in missing[0] for k in unexpected
                       if m.endswith("." + k)}, key=len)
    prefix = next((p for p in prefixes
                   if all(any(m.startswith(p) and m[len(p):] in have for m in group)
                          for group in missing)), None)
    if prefix:
        return [f"Every key of the checkpoint is the model's without the prefix {prefix!r}: "
                f"load into the submodule {prefix[:-1]!r} itself "
                f"(model.get_submodule({prefix[:-1]!r})), or save the state dict with it."]
    return []


# [Note: extra state] A module that overrides ``get_extra_state`` / ``set_extra_state``
# (Transformer Engine's FP8 layers, torchao, a user's scale or step counter) has its extra
# state in ``state_dict()`` under ``<module>._extra_state``: any picklable object, a dict of
# numbers as often as a tensor. ``load_state_dict`` hands it to ``set_extra_state`` after
# the module's own tensors, and counts the key as unexpected (strict) where the checkpoint
# has some and the module takes none; so does ``adaptive.load``, after every tensor is in
# place. Where the module takes extra state and the checkpoint has none, load_state_dict
# refuses a strict load; ``adaptive.load`` warns, and the module keeps its state: a
# safetensors file cannot hold extra state that is not a tensor, so a strict load of one
# into a model of FP8 or quantised layers could never succeed. A tensor is read
# from the file like any other (into new CPU memory: the module decides where it goes); an
# object is taken from the pickle as it is, except one holding tensors, whose data the
# meta-device read of the pickle did not load: that is refused (strict) or left out with a
# warning.
def _extra_states(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that take extra state (override ``set_extra_state``, as ``load_state_dict``
    asks), by the key their state has in a state dict."""
    return {(f"{name}._extra_state" if name else "_extra_state"): module
            for name, module in model.named_modules(remove_duplicate=False)
            if type(module).set_extra_state is not nn.Module.set_extra_state}


def _holds_unread(value: object) -> bool:
    """Whether an extra state object holds a tensor whose data was not read (on meta)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_meta:
                return True
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return False


def _restore_extra_states(reader: Reader, ckpt: Checkpoint,
                          restores: dict[str, nn.Module]) -> None:
    """Hand each module its extra state from the checkpoint, in module order (See [Note:
    extra state])."""
    for key, module in restores.items():
        entry = ckpt.entries.get(key)
        if entry is None:
            value = ckpt.extra_states[key]
        elif entry.tensor is not None:
            value = entry.tensor.clone()
        else:
            value = torch.empty(entry.shape, dtype=entry.dtype)
            reader.copy_into(entry, [value])
        module.set_extra_state(value)


def _is_norm(model: nn.Module, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name), _NormBase)
    except AttributeError:
        return False


def _own_loading(model: nn.Module) -> list[str]:
    """Modules (``name (Class)``) whose state loads through code of their own: an override
    of ``_load_from_state_dict`` (BatchNorm's, which only fills an old checkpoint's missing
    ``num_batches_tracked``, aside), or load-state-dict hooks."""
    plain = (nn.Module._load_from_state_dict, _NormBase._load_from_state_dict)
    found = []
    for name, module in model.named_modules():
        cls = type(module)
        if (cls._load_from_state_dict not in plain or module._load_state_dict_pre_hooks
                or module._load_state_dict_post_hooks):
            found.append(f"{name} ({cls.__name__})" if name else f"the model ({cls.__name__})")
    return found


def _label(files: list[str]) -> str:
    first = os.path.basename(str(files[0])) if files else "no file"
    return first if len(files) < 2 else f"{first} and {len(files) - 1} more"


def _current_tensors(model: nn.Module, sizes: ModuleSizes) -> dict[str, torch.Tensor]:
    out = {}
    for name, info in sizes.tensors.items():
        module = model.get_submodule(info.module)
        registry = module._parameters if info.kind == "parameter" else module._buffers
        out[name] = registry[info.attr]
    return out  # type: ignore[return-value]


def _read_all(
    reader: Reader, ckpt: Checkpoint, dests: dict[str, _Dest], sources: dict[str, Entry],
    copy: bool, stats: LoadStats,
) -> dict[str, torch.Tensor]:
    """Read every source once, in file order; return the new tensors to swap in."""
    order = sorted(sources, key=lambda n: (sources[n].file, sources[n].offset or 0))
    # Before the first write: a file that cannot be opened leaves the model as it was.
    reader.check_files(list(dict.fromkeys(sources[n].file for n in order
                                          if sources[n].tensor is None)))
    shared = _overlapping(sources, order) if not copy else set()
    pending: dict[str, torch.Tensor] = {}
    targets: dict[str, list[torch.Tensor]] = {}
    for name in order:  # every destination first, so that their pages can be faulted ahead
        new, into = _guarded(_targets, reader, sources[name], dests[name],
                             copy or name in shared)
        if new is not None:
            pending[name] = new
        targets[name] = into
    # Only tensors made here: a built model's tensors were written by its constructor.
    reader.fault_ahead([t for name in order if not dests[name].into for t in targets[name]])
    for name in order:
        entry, into = sources[name], targets[name]
        if into:
            _guarded(_read_one, reader, entry, dests[name], into)
        for t in into or [pending[name]]:
            _count(stats, t)
        stats.tensors += 1
        if into:
            stats.bytes_read += entry.nbytes
        else:
            stats.bytes_mapped += entry.nbytes
    reader.wait()
    stats.bytes_direct = reader.bytes_direct
    return pending


def _overlapping(sources: dict[str, Entry], order: list[str]) -> set[str]:
    """Model tensors whose checkpoint bytes overlap another model tensor's (entries saved
    as views of one storage, or from a model tied where this one is not). ``copy=False``
    reads them instead of mapping them: two mappings of the same bytes would be one memory,
    tying tensors the model keeps apart."""
    shared: set[str] = set()
    reach: dict[str, tuple[int, str]] = {}  # file -> (furthest byte end so far, its tensor)
    spans = [n for n in order if sources[n].tensor is None and sources[n].offset is not None
             and sources[n].numel]
    for name in sorted(spans, key=lambda n: (sources[n].file, sources[n].start)):
        entry = sources[name]
        first = entry.start
        end = first + entry.span * entry.dtype.itemsize
        last_end, last = reach.get(entry.file, (-1, ""))
        if first < last_end:
            shared.update((name, last))
        if end > last_end:
            reach[entry.file] = (end, name)
    return shared


def _guarded(step: Callable[..., Any], reader: Reader, entry: Entry, dest: _Dest,
             *args: Any) -> Any:
    """``step(reader, entry, dest, *args)``, its failures as a LoadError naming the tensor."""
    try:
        return step(reader, entry, dest, *args)
    except RuntimeError as exc:
        if isinstance(exc, LoadError) or is_oom(exc):
            raise
        where = (", ".join(f"{t.dtype} on {t.device}" for t in dest.into) if dest.into
                 else f"{dest.dtype} on {dest.device}")
        raise LoadError(
            f"cannot put checkpoint tensor {entry.key!r} ({entry.dtype}, shape "
            f"{list(entry.shape)}, in {entry.file!r}) into {dest.name!r} ({where}): {exc}"
        ) from exc


def _targets(reader: Reader, entry: Entry, dest: _Dest,
             copy: bool) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """(the new tensor to swap in or None, the tensors to write ``entry`` into); a mapped
    tensor needs no writing. With ``copy=False`` a built model's own CPU tensor is mapped
    too (its ``.data`` is swapped at the commit) where no conversion is needed."""
    if not copy and _mappable(reader, entry, dest):
        mapped = reader.mapped(entry)
        if mapped is not None:  # else a file that cannot be mapped: read as copy=True
            return mapped, []
    if dest.into:
        return None, dest.into
    assert dest.device is not None
    if (dest.device.type == "cpu" and not dest.pinned and dest.dtype == entry.dtype
            and _memory_format(dest.current) is torch.contiguous_format):
        new = reader.empty_for(entry)  # See [Note: reading past the page cache]
    else:
        new = dest.empty()
    return new, [new]


def _shared_storages(tensors: Any) -> set[int]:
    """The addresses of the CPU storages (the only ones mapped) that more than one distinct
    model tensor uses: views of one flattened parameter, a buffer that views a weight."""
    seen: set[int] = set()
    shared: set[int] = set()
    for t in tensors:
        if t.device.type == "cpu" and t.untyped_storage().nbytes():
            address = t.untyped_storage().data_ptr()
            (shared if address in seen else seen).add(address)
    return shared


def _whole_and_plain(t: torch.Tensor) -> bool:
    """Whether a built model's own tensor (one no other model tensor shares a storage with:
    ``_shared_storages``) may have its ``.data`` swapped for a mapping: it is the whole of
    its storage, contiguous, not pinned, and not an inference tensor (one whose ``.data``
    is swapped outside inference mode loses its version counter)."""
    return bool(t.is_contiguous() and t.storage_offset() == 0 and not t.is_inference()
                and t.untyped_storage().nbytes() == t.numel() * t.element_size()
                and not t.is_pinned())


def _mappable(reader: Reader, entry: Entry, dest: _Dest) -> bool:
    """Whether ``entry`` can back ``dest`` as it is stored: ordinary CPU memory, no dtype
    or memory-format conversion, bytes the file holds as the tensor lays them out. Tensors
    to write into (``dest.into``) are mapped only when they are the model's own (a handle's
    copies have no ``device``)."""
    device = dest.current.device if dest.own else dest.device
    return (device is not None and device.type == "cpu" and not dest.pinned
            and (not dest.own or _whole_and_plain(dest.current)) and dest.dtype == entry.dtype
            and _memory_format(dest.current) is torch.contiguous_format
            and reader.may_map(entry))


def _read_one(reader: Reader, entry: Entry, dest: _Dest, into: list[torch.Tensor]) -> None:
    """Read one source into every tensor of ``into``."""
    direct = next((t for t in into if reader.can_read_into(entry, t)), None)
    if direct is None:
        reader.copy_into(entry, into)
        return
    # One target: read on the reader threads (Reader.wait before the swap); several: the
    # others are copied from the first once it is read.
    reader.read_into(entry, direct, wait=len(into) > 1)
    if dest.into:
        increment_version(direct)  # written through its pointer: say so, as copy_ would
    for t in into:
        if t is not direct:
            copy_to(t, direct.reshape(t.shape) if direct.shape != t.shape else direct)


def _count(stats: LoadStats, t: torch.Tensor) -> None:
    key = "cpu (pinned)" if t.device.type == "cpu" and t.is_pinned() else str(t.device)
    stats.bytes_by_device[key] = stats.bytes_by_device.get(key, 0) + t.numel() * t.element_size()


def _registrations(model: nn.Module, sizes: ModuleSizes, name: str) -> list[tuple[dict, str]]:
    """Every (registry, attr) that holds tensor ``name``: its own and its tied aliases."""
    info = sizes.tensors[name]
    out = []
    for full in (name, *info.aliases):
        path, _, attr = full.rpartition(".")
        module = model.get_submodule(path)
        registry = module._parameters if attr in module._parameters else module._buffers
        out.append((registry, attr))
    return out


def _commit(model: nn.Module, sizes: ModuleSizes, pending: dict[str, torch.Tensor]) -> None:
    """Swap the new tensors in: ``.data`` for real tensors (identity kept), a new object on
    every tied registration for meta ones."""
    for name, new in pending.items():
        regs = _registrations(model, sizes, name)
        old = regs[0][0][regs[0][1]]
        if old.device.type != "meta":
            old.data = new
            continue
        replacement = _reparameter(old, new) if isinstance(old, nn.Parameter) else new
        for registry, attr in regs:
            registry[attr] = replacement


def _unloaded(model: nn.Module, dests: dict[str, _Dest], sources: dict[str, Entry],
              stats: LoadStats) -> dict[str, torch.Tensor]:
    """New tensors for those no checkpoint filled (non-persistent buffers; missing keys when
    not strict), to swap in with the rest: moved to their target like the rest; a meta one
    (missing, not strict) is left empty, except a norm layer's ``num_batches_tracked``,
    which starts at 0 as its constructor (and ``load_state_dict``) gives it."""
    left = {}
    empty = []
    for name, dest in dests.items():
        if name in sources or dest.device is None:
            continue
        current = dest.current
        if current.device.type != "meta":
            moved = current.to(device=dest.device, dtype=dest.dtype)
            left[name] = moved.pin_memory() if dest.pinned else moved
        elif _is_batch_counter(model, name):
            left[name] = dest.empty().zero_()
        else:
            empty.append(name)
            left[name] = dest.empty()
        _count(stats, left[name])
    if empty:
        logger.warning(
            "adaptmem.load: %s in no checkpoint and built on meta, so %s uninitialised memory "
            "(empty_model skips initialisation; like Module.to_empty): %s. Initialise %s "
            "yourself (for example the owning module's reset_parameters()), or load with "
            "strict=True to have missing keys refused", "1 tensor is" if len(empty) == 1
            else f"{len(empty)} tensors are", "it holds" if len(empty) == 1 else "they hold",
            ", ".join(empty), "it" if len(empty) == 1 else "them")
    return left


def _is_batch_counter(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is a norm layer's ``num_batches_tracked``."""
    owner, _, attr = name.rpartition(".")
    return attr == "num_batches_tracked" and _is_norm(model, owner)
