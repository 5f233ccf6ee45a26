"""Recorded initialisation: build a model on the meta device, then compute any one tensor's initial value on demand,
exactly as building the model for real would have.

[Note: recorded initialisation]
Building on the meta device costs no memory but also keeps no values, so a meta-built model has to be initialised
again, tensor by tensor, when it is sharded. Calling each module's ``reset_parameters()`` (what FSDP and our first
version did) loses everything the model's own code does beyond that: a custom norm's ``nn.Parameter(torch.ones(d))``
(no ``reset_parameters`` at all), ``nn.MultiheadAttention`` (its method is ``_reset_parameters``), a parent that
re-initialises its children (GPT-2's ``normal_(0, 0.02)``), buffers computed in ``__init__`` (rotary frequencies,
batch-norm statistics). And its random values differ from an unsharded run of the same seeded code.

So ``deferred_init`` records instead of forgetting. While the model is built, every ATen operation that touches a
meta tensor is logged with its arguments (meta tensors stay alive in the log, so a storage's identity is a stable
key), and so are the few calls that never reach ATen on meta: ``torch.tensor(...)`` (its value is kept as a CPU
constant) and the ``torch.nn.init`` functions that return early for meta tensors (``trunc_normal_``,
``orthogonal_``, ``dirac_``, ``sparse_``). Each random operation also runs once, for real, on a scratch tensor of the
same shape on the target device, so the generator advances exactly as in an unsharded build, and the generator state
before it is kept. ``materialize(t)`` then replays only the operations ``t``'s storage depends on (its writers and,
transitively, what they read, each up to the point it was read), in their original order, with each random
operation run from its recorded generator state: the result equals the unsharded build's value, bit for bit on the
same device type, one tensor at a time, on every rank and at every world size.

Ranks that were not seeded alike record different generator states; ``synchronize`` makes every rank use the states
of one source rank (DDP's broadcast from rank 0, without moving any tensor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mmap
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.init as nn_init
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["InitRecording", "deferred_init", "recording_for"]

_MAX_LIVE = 8  # recordings kept for engines to find (see recording_for); the oldest is forgotten first
_LIVE: list[InitRecording] = []
_ACTIVE = threading.local()  # the recording the patched nn.init functions report to


@dataclasses.dataclass
class _Op:
    """One recorded call: ``fn(*args, **kwargs)`` with meta tensors that replay substitutes."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[tuple[int, torch.Tensor]]  # (position among the flattened results, meta output) of new storages
    reads: tuple[int, ...]  # storage keys of every meta tensor argument
    writes: tuple[int, ...]  # storage keys it creates or mutates
    rng: tuple[torch.Generator, torch.Tensor] | None  # the generator and its state before the call


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def _alias(x: Any) -> Any:
    """A log-private alias of a meta tensor: the caller's object can later be re-pointed (``p.data = ...``) to
    another storage, an alias keeps the storage and geometry it had when the call was made."""
    return x.detach() if _is_meta(x) else x


_SCRATCH_MMAP_BYTES = 1 << 16


def _scratch_tensor(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A zero tensor of ``like``'s shape, strides and dtype on ``device``, for a random operation to run
    on and be thrown away. Large host ones are mapped straight from the OS and unmapped after: a run of model-sized
    blocks through glibc would raise its dynamic mmap threshold and leave freed heap behind, resident for the whole
    run, before the engine's host allocator is even installed."""
    extent = 1 + sum((n - 1) * st for n, st in zip(like.shape, like.stride(), strict=True)) if like.numel() else 0
    nbytes = extent * like.element_size()
    if device.type != "cpu" or nbytes < _SCRATCH_MMAP_BYTES:
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device).zero_()
    block = mmap.mmap(-1, nbytes)  # anonymous (zeros): returned to the OS when the last view of it is gone
    flat = torch.frombuffer(block, dtype=like.dtype, count=extent)
    return flat.as_strided(like.shape, like.stride())


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    if device.type == "cpu":
        return torch.default_generator
    raise ValueError(f"deferred_init: no default random generator known for device {device}")


class InitRecording:
    """How a meta-device model was built (see [Note: recorded initialisation]); ``materialize`` replays a tensor."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ops: list[_Op] = []
        self._writers: dict[int, list[int]] = {}
        self._created: dict[int, int] = {}  # storage key -> the op that created it
        self._synchronized: set[Any] = set()

    # ------------------------------------------------------------------------------------------------ recording
    def _record(self, op: _Op) -> None:
        index = len(self.ops)
        self.ops.append(op)
        for key in op.writes:
            self._writers.setdefault(key, []).append(index)
        for _, t in op.outputs:
            self._created.setdefault(_key(t), index)

    def _random_state(self, kwargs: dict[str, Any]) -> tuple[torch.Generator, torch.Tensor]:
        generator = kwargs.get("generator")
        if not isinstance(generator, torch.Generator):
            generator = _default_generator(self.device)
        return generator, generator.get_state()

    def _scratch(self, x: Any) -> Any:
        if _is_meta(x):
            return _scratch_tensor(x, self.device)
        if isinstance(x, torch.device) and x.type == "meta":
            return self.device
        return x

    def _real(self, x: Any) -> Any:
        if _is_meta(x):
            value = self.materialize(x)
            if value is None:
                raise ValueError(
                    "deferred_init: a random operation reads the values of a meta tensor that was not built inside "
                    "deferred_init(); build it inside, or draw it on a real device"
                )
            return value
        return self._scratch(x)

    def record_aten(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        inputs = [x for x in tree_flatten((args, kwargs))[0] if _is_meta(x)]
        flat_out = tree_flatten(out)[0]
        outputs = [x for x in flat_out if _is_meta(x)]
        if not inputs and not outputs:
            return
        schema = func._schema
        mutated = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                mutated += [x for x in tree_flatten(value)[0] if _is_meta(x)]
        known_before = {_key(x) for x in inputs}
        fresh = [
            (i, x)
            for i, x in enumerate(flat_out)
            if _is_meta(x) and _key(x) not in known_before and _key(x) not in self._created
        ]
        rng = None
        if torch.Tag.nondeterministic_seeded in func.tags or any(a.name == "generator" for a in schema.arguments):
            rng = self._random_state(kwargs)
            try:  # advance the generator as a real build would
                func(*tree_map(self._scratch, args), **tree_map(self._scratch, kwargs))
            except Exception:  # it reads its inputs' values (multinomial of all-zero weights): draw from the real ones
                rng[0].set_state(rng[1])
                func(*tree_map(self._real, args), **tree_map(self._real, kwargs))
        op = _Op(
            func,
            tree_map(_alias, args),
            tree_map(_alias, kwargs),
            [(i, _alias(x)) for i, x in fresh],
            tuple(dict.fromkeys(_key(x) for x in inputs)),
            tuple(dict.fromkeys([_key(x) for x in mutated] + [_key(x) for _, x in fresh])),
            rng,
        )
        self._record(op)  # the meta tensors stay alive in op.args and op.outputs: keys stay unique

    def record_call(
        self, fn: Callable[..., Any], tensor: torch.Tensor, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> None:
        """A ``torch.nn.init`` function that returns early for meta tensors: run it on a scratch tensor (for the
        generator) and replay it on the real one."""
        rng = self._random_state(kw)
        fn(self._scratch(tensor), *args, **kw)
        key = _key(tensor)
        self._record(_Op(fn, (_alias(tensor), *args), dict(kw), [], (key,), (key,), rng))

    def record_constant(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        """``meta`` (from ``torch.tensor(...)`` and friends) holds ``value`` (a CPU tensor)."""
        self._record(_Op(_constant, (value,), {}, [(0, _alias(meta))], (), (_key(meta),), None))

    # ------------------------------------------------------------------------------------------------ replaying
    def knows(self, t: torch.Tensor) -> bool:
        return t.is_meta and _key(t) in self._writers

    def materialize(self, t: torch.Tensor) -> torch.Tensor | None:
        """The value ``t`` (a meta tensor built under this recording) would hold in an unsharded build, on
        ``self.device``; None when its construction was not (entirely) recorded."""
        if not self.knows(t):
            return None
        needed: set[int] = set()
        upto: dict[int, int] = {}
        stack = [(_key(t), len(self.ops))]
        while stack:
            key, before = stack.pop()
            if upto.get(key, -1) >= before:
                continue
            upto[key] = before
            if key not in self._created:
                return None  # a meta tensor made outside the recording
            for j in self._writers.get(key, ()):
                if j >= before:
                    break
                if j not in needed:
                    needed.add(j)
                    stack += [(other, j) for other in (*self.ops[j].reads, *self.ops[j].writes)]
        real: dict[int, torch.UntypedStorage] = {}
        with torch.no_grad():
            for j in sorted(needed):
                self._replay(self.ops[j], real)
            return self._view(real, t)

    def _view(self, real: dict[int, torch.UntypedStorage], m: torch.Tensor) -> torch.Tensor:
        out = torch.empty(0, dtype=m.dtype, device=self.device)
        return out.set_(real[_key(m)], m.storage_offset(), m.shape, m.stride())

    def _replay(self, op: _Op, real: dict[int, torch.UntypedStorage]) -> None:
        def swap(x: Any) -> Any:
            if _is_meta(x):
                return self._view(real, x) if _key(x) in real else x
            if isinstance(x, torch.device) and x.type == "meta":
                return self.device
            return x

        args, kwargs = tree_map(swap, op.args), tree_map(swap, op.kwargs)
        if any(_is_meta(x) for x in tree_flatten((args, kwargs))[0]):
            raise AssertionError(f"deferred_init: replaying {op.fn} before its inputs exist")
        if op.rng is None:
            out = op.fn(*args, **kwargs)
        else:
            generator, state = op.rng
            saved = generator.get_state()
            generator.set_state(state)
            try:
                out = op.fn(*args, **kwargs)
            finally:
                generator.set_state(saved)
        results = tree_flatten(out)[0]
        for position, m in op.outputs:
            real[_key(m)] = _adopt(results[position], m, self.device)

    # ------------------------------------------------------------------------------------------------ ranks
    def synchronize(self, process_group: dist.ProcessGroup | None, global_src: int) -> None:
        """Makes every rank of ``process_group`` replay with the generator states recorded on ``global_src`` (ranks
        that were not seeded alike recorded different ones). Collective; once per group."""
        if dist.get_world_size(process_group) <= 1 or process_group in self._synchronized:
            return
        self._synchronized.add(process_group)
        states = [op.rng[1] for op in self.ops if op.rng is not None]
        digest = hashlib.blake2b(digest_size=16)
        for s in states:
            digest.update(s.numpy().tobytes())
        digests: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(digests, digest.hexdigest(), group=process_group)
        if len(set(digests)) == 1:
            return
        payload = [states]
        dist.broadcast_object_list(payload, src=global_src, group=process_group)
        chosen = iter(payload[0])
        for op in self.ops:
            if op.rng is not None:
                op.rng = (op.rng[0], next(chosen))

    def materialize_module(self, module: torch.nn.Module) -> int:
        """Replaces, in place, every meta parameter and buffer of ``module`` that this recording built with its real
        value (a parameter shared by several modules stays one parameter). For what must see the whole unsharded
        model before ZeRO shards it (tensor parallelism slices full weights): it holds the full model in memory.

        Returns:
            How many tensors were materialised (meta tensors built outside the recording stay on meta).
        """
        done: dict[int, torch.Tensor] = {}
        for mod in module.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in list(table.items()):
                    if t is None or not t.is_meta:
                        continue
                    if id(t) not in done:
                        value = self.materialize(t)
                        if value is None:
                            continue
                        value = value.clone()
                        done[id(t)] = (
                            torch.nn.Parameter(value, requires_grad=t.requires_grad)
                            if isinstance(t, torch.nn.Parameter)
                            else value
                        )
                    table[name] = done[id(t)]  # type: ignore[assignment]
        return len(done)

    def discard(self) -> None:
        """Drops the log (and the meta tensors and constants it keeps alive)."""
        self.ops, self._writers, self._created = [], {}, {}
        if self in _LIVE:
            _LIVE.remove(self)


def _constant(value: torch.Tensor) -> torch.Tensor:
    return value.clone()


def _adopt(r: torch.Tensor, m: torch.Tensor, device: torch.device) -> torch.UntypedStorage:
    """A real storage laid out like ``m``'s, holding ``r``'s values."""
    storage = r.untyped_storage()
    if (
        r.stride() == m.stride()
        and r.storage_offset() == m.storage_offset()
        and storage.nbytes() == m.untyped_storage().nbytes()
        and r.device == device
    ):
        return storage
    fresh = torch.empty(m.untyped_storage().nbytes(), dtype=torch.uint8, device=device).untyped_storage()
    view = torch.empty(0, dtype=m.dtype, device=device).set_(fresh, m.storage_offset(), m.shape, m.stride())
    view.copy_(r)
    return fresh


# ---------------------------------------------------------------------------------------------------- capture
class _Recorder(TorchDispatchMode):
    def __init__(self, recording: InitRecording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.recording.record_aten(func, args, kwargs, out)
        return out


_CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray}


def _is_device_probe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return bool(args) and isinstance(args[0], (list, tuple)) and not args[0] and "device" not in kwargs


class _Constants(TorchFunctionMode):
    """``torch.tensor(1.5)`` on the meta device never reaches ATen with its value: keep the value as a constant."""

    def __init__(self, recording: InitRecording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.tensor and _is_device_probe(args, kwargs):
            # [Note: the device probe]
            # ``torch.tensor([]).device`` is how libraries ask where tensors are being built; Hugging Face's
            # ``init_weights`` skips initialisation when the answer is meta (it expects weights to be loaded next), so
            # ``AutoModelForCausalLM.from_config`` would keep nn.Linear's defaults instead of its own init, unlike the
            # same code under DDP. An empty tensor holds no values: answering with the real device costs nothing and
            # lets the library initialise as in an unsharded build (recorded like any other init).
            return func(*args, **{**kwargs, "device": self.recording.device})
        out = func(*args, **kwargs)
        if func in _CONSTRUCTORS and _is_meta(out) and not any(_is_meta(x) for x in tree_flatten((args, kwargs))[0]):
            value = func(*args, **{**kwargs, "device": "cpu"})
            self.recording.record_constant(out, value)
        return out


def _patched(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_fn(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recording = getattr(_ACTIVE, "recording", None)
        if recording is not None and _is_meta(tensor):
            recording.record_call(original, tensor, args, kwargs)
            return tensor
        return original(tensor, *args, **kwargs)

    init_fn.__wrapped__ = original  # type: ignore[attr-defined]
    return init_fn


# trunc_normal_ reaches its meta early-return through this module global; the others return early themselves
_EARLY_RETURNING = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")


@contextlib.contextmanager
def _patched_init_functions(recording: InitRecording) -> Iterator[None]:
    previous = getattr(_ACTIVE, "recording", None)
    originals = {name: getattr(nn_init, name) for name in _EARLY_RETURNING}
    _ACTIVE.recording = recording
    for name, fn in originals.items():
        setattr(nn_init, name, _patched(getattr(fn, "__wrapped__", fn)))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(nn_init, name, fn)
        _ACTIVE.recording = previous


@contextlib.contextmanager
def deferred_init(device: torch.device | str | None = None) -> Iterator[InitRecording]:
    """Builds modules on the meta device and records how, so that the ZeRO engine can give every rank exactly the
    initial values an unsharded build would have, one tensor at a time (see [Note: recorded initialisation]).

    ``zstack_zero3`` wraps ``configure_model`` in it; use it directly with the engine::

        with deferred_init():
            model = MyModel()            # no parameter memory; any init code, seeded as usual
        engine = DeepSpeedZeroOptimizer_Stage3(model, optimizer, device=torch.device("cpu"))

    Args:
        device: where replayed values are computed and random operations are drawn (the device the engine shards
            onto; default CPU). A CUDA build draws from that device's generator, as ``torch.device("cuda")`` would.

    Yields:
        The recording (the engine finds it by itself; ``discard()`` frees it early).
    """
    target = torch.device(device) if device is not None else torch.device("cpu")
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    active = getattr(_ACTIVE, "recording", None)
    if active is not None:  # nested: the enclosing recording already sees everything (recording twice would draw
        with torch.device("meta"):  # every random tensor twice)
            yield active
        return
    recording = InitRecording(target)
    with torch.device("meta"), _Constants(recording), _Recorder(recording), _patched_init_functions(recording):
        yield recording
    if recording.ops:
        _LIVE.append(recording)
        del _LIVE[:-_MAX_LIVE]


def recording_for(tensors: list[torch.Tensor]) -> InitRecording | None:
    """The most recent live recording that built any of ``tensors`` (meta tensors), else None."""
    for recording in reversed(_LIVE):
        if any(recording.knows(t) for t in tensors):
            return recording
    return None
