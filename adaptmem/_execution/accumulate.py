"""Gradient accumulation for ``@adaptive.batch(accumulate=...)``: a training step that runs
out of memory is retried with smaller micro-batches, and its result does not depend on the
memory found.

[Note: a retried training step counts its gradients once]
A training step written as micro-batches (``adaptive.microbatches``) accumulates into each
parameter's ``.grad`` with every ``backward``. When memory runs out part way (in the forward
of the third micro-batch, or in a backward that already added the last layers' gradients),
the failed attempt has added to ``.grad`` already; a retry from there would count those
samples twice. So a guarded call takes a snapshot of the gradients when it starts and puts
every ``.grad`` back exactly as it was whenever an attempt raises: ``None`` stays (becomes
again) ``None``, and a gradient that existed (accumulated by earlier calls, or zeroed with
``set_to_none=False``) gets its values back bitwise, in the same tensor object. The snapshot
costs nothing when no gradient exists at the start (the usual ``zero_grad()``); otherwise
the values are copied to host memory, so the device holds no second copy while the step runs.

Buffers that forward updates (BatchNorm's running statistics, its batch counter) are the
same trap: a failed attempt's forward has moved them. When ``accumulate`` is a module, every
buffer of it is copied to the host when a call starts and put back when an attempt fails
(buffers are small next to parameters in most models; a model with large constant buffers
whose forward updates none can pass ``model.parameters()`` instead, and no buffer is
copied). Which buffers a forward will update cannot be known before it runs, and learning
it from earlier calls is unsound (a model switched from eval to train mode starts updating
its running statistics), so all are copied. What the restore cannot undo is the micro-batch
size itself: BatchNorm in training mode normalises each micro-batch with its own
statistics, so its outputs, gradients and running statistics depend on the micro-batch
size, as in any gradient accumulation. Models with LayerNorm / GroupNorm, or BatchNorm in
eval mode, give the full batch's gradients up to floating-point summation order.

Generators and coroutines are refused: their work runs after the call returns, out of the
snapshot's reach.

[Note: a batch shorter than its size]
``@adaptive.batch`` does not know how many items a call has: toma's contract passes a size
and the function splits its data. A training step split with ``adaptive.microbatches`` does
tell: the attempt that runs is the current ``Attempt`` (``_common/attempts.py``, a context
variable, so threads and tasks keep their own), and ``microbatches(batchsize, ...)`` files
the batch's length under the size it was asked to split by. Where the batch is shorter than
the size the decorator passed, the attempt really ran the batch's length (one micro-batch of
all of it): a failure is filed at that length, so the retry halves from there rather than
running the same single micro-batch again at every size down to the batch's length, and a
success tells only what a short step's would (``SizeRecord.after_short_success``), so it
does not claim the larger size fits. A step that splits its batch itself is unchanged: the
size passed is taken as the size run.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from .._common.attempts import Attempt, current_attempt, enter_attempt, leave_attempt
from .._common.callables import lazy_body
from .._common.devices import whole_number
from .._common.tree import tensors_in

__all__ = ["Accumulation", "Guarded", "check_accumulate", "refuse_accumulate", "microbatches"]


def refuse_accumulate(value: Any, kind: str) -> None:
    """``accumulate=`` given to ``adaptive.range`` / ``adaptive.chunked``: a TypeError."""
    if value is not None:
        raise TypeError(
            f"adaptive.{kind} does not take accumulate=: its finished steps are never redone "
            f"and each covers new elements, so there is no batch to accumulate. For a "
            f"training step whose batch may be split, use @adaptive.batch(initial_batchsize="
            f"..., accumulate=model) with adaptive.microbatches"
        )


def check_accumulate(value: Any, decorator: str) -> Accumulation | None:
    """``accumulate=`` as given to ``decorator``: None, a module, a parameter or an iterable
    of parameters (tensors that require gradients); anything else is a TypeError here."""
    if value is None:
        return None
    if isinstance(value, nn.Module):
        return Accumulation(value, ())
    if isinstance(value, torch.Tensor):
        params: list[torch.Tensor] = [value]
    elif isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise TypeError(_expected(decorator, value))
    else:
        params = list(value)
        if not params:
            raise ValueError(
                f"{decorator}(accumulate=...) got an empty collection of parameters: pass the "
                f"model (accumulate=model) or its parameters (accumulate=model.parameters()); "
                f"a generator that was consumed already is empty too"
            )
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            where = f" as item {i} of the {type(value).__name__}" if p is not value else ""
            raise TypeError(_expected(decorator, p, where))
    # All of them, frozen ones too: which require gradients is read at each call (a part
    # unfrozen later, as gradual unfreezing does, is put back like the rest).
    return Accumulation(None, tuple(params))


def _expected(decorator: str, got: Any, where: str = "") -> str:
    return (
        f"{decorator}(accumulate=...) takes the model being trained (an nn.Module), a "
        f"parameter, or an iterable of parameters, whose .grad a failed attempt must not "
        f"leave changed; got {type(got).__name__} {got!r:.80}{where}. Write "
        f"accumulate=model"
    )


class Accumulation:
    """What ``accumulate=`` guards: a module's parameters and buffers, or given parameters."""

    def __init__(self, module: nn.Module | None, params: tuple[torch.Tensor, ...]) -> None:
        self.module = module
        self.params = params

    def refuse_lazy(self, func: Any) -> None:
        """A generator or async function runs after the call returns: out of reach. Seen
        through ``staticmethod``/``classmethod`` and a callable object's ``__call__``; what
        only shows when called is refused then (``refuse_lazy_result``)."""
        inner = lazy_body(func)
        if inner is not None:
            raise TypeError(self._lazy_message(getattr(func, "__qualname__", None)
                                               or getattr(inner, "__qualname__", func)))

    def refuse_lazy_result(self, result: Any, name: str) -> None:
        """The call gave a generator or coroutine (a wrapper hid it at decoration): none of
        its work ran, so nothing is put back; it is closed and refused."""
        if isinstance(result, (types.GeneratorType, types.CoroutineType)):
            result.close()
        raise TypeError(self._lazy_message(name, type(result).__name__))

    @staticmethod
    def _lazy_message(name: Any, returned: str = "") -> str:
        what = (f"returned a {returned} (a generator or async function behind a wrapper, "
                f"or adaptive.microbatches(...) returned as it is), whose work runs as it is "
                f"read. Write the step as a plain function that does the work, iterating "
                f"microbatches inside it (for x in adaptive.microbatches(...): ...)"
                if returned else "is a generator or async function, whose work runs later. "
                "Write the training step as a plain function")
        return (f"adaptive.batch(accumulate=...) puts gradients back when an attempt fails, "
                f"which it can do only while the step runs inside the call; {name!r} {what}")

    def guard(self, func: Callable[..., Any]) -> Guarded:
        """``func`` for one call: the first attempt takes the snapshot, a failed attempt puts
        gradients and buffers back. See [Note: a retried training step counts its gradients
        once]."""
        return Guarded(self, func)

    def parameters(self) -> Iterator[torch.Tensor]:
        """The tensors that require gradients now (frozen ones gather nothing), a lazy
        module's placeholders included."""
        params = self.params if self.module is None else self.module.parameters()
        return (p for p in params if p.requires_grad)


class Guarded:
    """A training step for one call of ``@adaptive.batch(accumulate=...)``: each attempt puts
    gradients and buffers back when it raises, and learns the length of the batch it split
    (see [Note: a batch shorter than its size]); an attempt that succeeds after failed ones
    undoes what they made spill handles change (see [Note: a failed attempt's escalation]
    in ``_spilling/_spill.py``)."""

    __slots__ = ("_accumulation", "_func", "_snapshot", "_call", "_failed")

    def __init__(self, accumulation: Accumulation, func: Callable[..., Any]) -> None:
        self._accumulation = accumulation
        self._func = func
        self._snapshot: _Snapshot | None = None
        self._call = Attempt()
        self._failed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._snapshot is None:
            self._snapshot = _Snapshot(self._accumulation, (args, kwargs))
        call = self._call
        call.split = {}
        token = enter_attempt(call)
        try:
            result = self._func(*args, **kwargs)
        except BaseException:  # Ctrl-C too: a rerun must not count samples twice
            self._failed = True
            self._snapshot.restore()
            raise
        finally:
            leave_attempt(token)
        if self._failed:
            while call.undo:
                call.undo.pop()()
        return result

    def ran(self, size: int) -> int:
        """The size the last attempt really ran when it was passed ``size``: the length of
        the batch it split by ``size`` where that is shorter, else ``size``."""
        items = self._call.split.get(size)
        return size if items is None else min(size, items)


class _Snapshot:
    """The gradients (and buffers) of an ``Accumulation`` when a call started."""

    def __init__(self, accumulation: Accumulation, arguments: Any = ()) -> None:
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        # The leaves among the step's arguments gather gradients too (an input whose
        # gradient is wanted: adversarial training, saliency): a failed attempt's are undone.
        seen: set[int] = set()
        leaves = (t for t in tensors_in(arguments) if t.requires_grad and t.is_leaf)
        for p in itertools.chain(accumulation.parameters(), leaves):
            if id(p) in seen:
                continue
            seen.add(id(p))
            grad = p.grad  # None for a lazy placeholder, which a failed attempt may make
            self.grads.append((p, grad, None if grad is None else _host_copy(grad)))
        module = accumulation.module
        # By owner and name: a forward may assign a new tensor (``self.count = self.count + 1``).
        self.buffers = [] if module is None else [
            (owner, name, b, _host_copy(b)) for owner in module.modules()
            for name, b in owner._buffers.items() if b is not None and not is_lazy(b)]
        # A lazy module (``nn.LazyBatchNorm1d``) makes its buffers at its first forward:
        # there is nothing to copy yet. If a failed attempt made them, the state it wrote
        # (running statistics) is put back to the fresh state a first forward starts from.
        self.lazy = [] if module is None else [
            owner for owner in module.modules()
            if any(is_lazy(t) for t in (*owner._buffers.values(), *owner._parameters.values()))]

    def restore(self) -> None:
        with torch.no_grad():
            for p, grad, values in self.grads:
                if grad is None:
                    p.grad = None
                    continue
                assert values is not None  # taken with grad
                if p.grad is not grad:
                    p.grad = grad  # autograd may have replaced it; the caller's object comes back
                grad.copy_(values)
            for owner, name, buffer, values in self.buffers:
                if owner._buffers.get(name) is not buffer:
                    owner._buffers[name] = buffer
                buffer.copy_(values)
            for owner in self.lazy:
                made = not any(is_lazy(b) for b in owner._buffers.values())
                reset = getattr(owner, "reset_running_stats", None)
                if made and callable(reset):
                    reset()


def is_lazy(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a lazy module's placeholder, which holds no values yet."""
    return isinstance(t, (UninitializedBuffer, UninitializedParameter))


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    # A copy on the host keeps the device free for the step; on the CPU it is a clone.
    return tensor.detach().to("cpu", copy=True)


def microbatches(batchsize: int, *tensors: torch.Tensor | Mapping[str, Any],
                 dim: int = 0) -> Iterator[tuple[Any, ...]]:
    """Split ``tensors`` into micro-batches of ``batchsize``, each with its share of the
    whole: yields ``(slice_1, ..., slice_n, weight)`` with ``weight = len(slice) /
    len(whole)``.

    Scale a mean-reduced loss by ``weight`` and the gradients summed over the micro-batches
    equal the full batch's (up to floating-point summation order). Slices are views along
    ``dim``; the last micro-batch may be smaller. An argument may also be a dict of tensors
    (a tokenizer's output, a Hugging Face batch): each micro-batch gets a dict of the same
    keys, every tensor sliced (in nested dicts too), other values passed as they are, but a
    list or tuple that may hold one item per sample (as long as the batch, or holding
    tensors) is refused: it cannot be told from one every sample shares. The weight counts samples:
    a loss averaged over tokens (a language model's, with padding) needs each micro-batch's
    token count over the whole's instead.

    Args:
        batchsize: the micro-batch size (what ``@adaptive.batch`` passes), 1 or more.
        *tensors: one or more tensors, or dicts of them, all of the same length along
            ``dim``.
        dim: the batch dimension (default 0; negative counts from the end).

    Returns:
        An iterator of tuples: the slices in the order given, then the weight (a float).

    Raises:
        TypeError: no tensors, something that is no tensor or dict of them, a list or tuple
            in a dict that may be per sample, or a batch size that is not an int.
        ValueError: a batch size below 1, tensors whose lengths along ``dim`` differ, or
            an empty batch (length 0).

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> x, y = torch.arange(5.0), torch.arange(5)
        >>> [(a.tolist(), b.tolist(), w) for a, b, w in adaptive.microbatches(2, x, y)]
        [([0.0, 1.0], [0, 1], 0.4), ([2.0, 3.0], [2, 3], 0.4), ([4.0], [4], 0.2)]
        >>> batch = {"input_ids": torch.ones(3, 4), "labels": torch.zeros(3)}
        >>> [(len(b["input_ids"]), w) for b, w in adaptive.microbatches(2, batch)]
        [(2, 0.6666666666666666), (1, 0.3333333333333333)]
    """
    size = whole_number(batchsize)  # NumPy and torch integers too
    if size is None:
        raise TypeError(f"microbatches takes the batch size first, an int; got "
                        f"{type(batchsize).__name__} {batchsize!r:.80}")
    if size < 1:
        raise ValueError(f"microbatches needs a batch size of 1 or more, got {size}")
    if not tensors:
        raise TypeError("microbatches needs one or more tensors to split: "
                        "microbatches(batchsize, inputs, targets)")
    dim = _dimension(dim)
    lengths: dict[str, int] = {}
    sequences: dict[str, Sequence[Any]] = {}
    for i, arg in enumerate(tensors):
        where = f"argument {i + 1}"
        if isinstance(arg, Mapping):
            found = dict(_tensors_of(arg, where, sequences))
            if not found:
                raise TypeError(f"microbatches splits tensors; {where} is a "
                                f"{type(arg).__name__} that holds none")
        elif isinstance(arg, torch.Tensor):
            found = {where: arg}
        else:
            raise TypeError(f"microbatches splits tensors or dicts of them; {where} is "
                            f"{type(arg).__name__} {arg!r:.80}")
        for name, t in found.items():
            if not -t.dim() <= dim < t.dim():
                raise ValueError(f"dim={dim} is out of range for {name} of shape "
                                 f"{tuple(t.shape)}")
            lengths[name] = t.shape[dim]
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"microbatches needs tensors of the same length along dim={dim} (the batch "
            f"dimension), got {', '.join(f'{n}: {k}' for n, k in lengths.items())}"
        )
    total = next(iter(lengths.values()))
    for name, seq in sequences.items():  # per-sample lists cannot be told from shared ones
        if len(seq) == total or any(isinstance(x, torch.Tensor) for x in seq):
            raise TypeError(
                f"microbatches slices the tensors of a dict (nested dicts too) and passes "
                f"other values whole to every micro-batch; {name} is a {type(seq).__name__} "
                f"of {len(seq)} item(s){' holding tensors' if len(seq) != total else ''}: "
                f"it may hold one item per sample (the batch has {total}) or something every "
                f"sample shares, which microbatches cannot tell apart. Take it out of the dict "
                f"and slice it yourself (each micro-batch covers its slice's length of "
                f"samples, from where the last one ended)")
    if total == 0:
        raise ValueError(
            f"microbatches got an empty batch (length 0 along dim={dim}): a step over it "
            f"would compute no loss and leave the gradients as they are. Skip empty batches "
            f"before the step")
    attempt = current_attempt()
    if attempt is not None:  # see [Note: a batch shorter than its size]
        attempt.split[size] = max(total, attempt.split.get(size, 0))
    return _split(size, tensors, dim, total)


def _tensors_of(arg: Mapping[Any, Any], where: str,
                sequences: dict[str, Sequence[Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of ``arg`` and the mappings inside it; lists and
    tuples met on the way go to ``sequences``, by name."""
    for k, v in arg.items():
        name = f"{where}[{k!r}]"
        if isinstance(v, torch.Tensor):
            yield name, v
        elif isinstance(v, Mapping):
            yield from _tensors_of(v, name, sequences)
        elif isinstance(v, (list, tuple)):
            sequences[name] = v


def _dimension(dim: Any) -> int:
    """``dim`` as an int (NumPy integers too); TypeError for anything else, bools included."""
    index = whole_number(dim)
    if index is not None:
        return index
    raise TypeError(f"microbatches takes dim= as an int (the batch dimension, 0 unless the "
                    f"batch is along another), got {type(dim).__name__} {dim!r:.80}")


def _split(batchsize: int, args: tuple[Any, ...], dim: int,
           total: int) -> Iterator[tuple[Any, ...]]:
    def piece(arg: Any, start: int, n: int) -> Any:
        if isinstance(arg, torch.Tensor):
            return arg.narrow(dim, start, n)
        if isinstance(arg, Mapping):
            return {k: piece(v, start, n) for k, v in arg.items()}
        return arg

    for start in range(0, total, batchsize):
        n = min(batchsize, total - start)
        yield (*(piece(a, start, n) for a in args), n / total)
