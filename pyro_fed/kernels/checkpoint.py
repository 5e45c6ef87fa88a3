"""Checkpoints of a run, and resuming from them bitwise.

A federated kernel given ``checkpoint=path`` (see :class:`~pyro_fed.FederatedKernel`) writes, after chunks
of its iterations, everything its run needs to go on: the algorithm's state, what the warm-up chose
(:class:`~pyro_fed.algorithms.adaptation.Adaptation`), the chains' initial points, the state of every random
generator, the iterations computed, the draws and statistics so far and the network's counters, with a
*fingerprint* of the run's configuration. A later ``setup`` of a kernel with the same path finds the file,
checks its fingerprint against its own and restores the run instead of starting one: the warm-up is not
run again, and the iterations that remain are computed from the same state with the same randomness, in the
same chunks, so that the run's draws are those of the uninterrupted run, bit for bit.

The file holds tensors only (``torch.load(path, weights_only=True)`` reads it): a flat dictionary whose
``"meta"`` entry is UTF-8 JSON bytes (a ``uint8`` tensor) of the numbers, names and the fingerprint, and
whose other entries are CPU tensors:

- ``state.<i>``: the algorithm's state, ``positions`` (the chains' initial points ``[C, d]``) and
  ``inverse_mass`` (the iterations done and the run's two seeds are in ``meta``);
- ``adaptation.<field>``: the adaptation's tensors (its numbers are in ``meta``);
- ``rng.tensors``, ``rng.host``, ``rng.block_numbers`` and ``rng.blocks``: the run's generators (its
  clients' blocks included)
  (:meth:`~pyro_fed.engine.randomness.Randomness.state`);
- ``network.<counter>``: ``uploaded_bits``, ``downloaded_bits`` and ``rounds`` per chain (the bytes this
  process sent, a number, are in ``meta``);
- ``buffer.<name>``: the draws and their statistics (:meth:`~pyro_fed.engine.draws.DrawBuffer.state`);
- ``checksum``: the SHA-256 of all the others (:func:`checksum`), 32 bytes: a file whose contents changed
  after it was written (a flipped bit on a disk, an edit) is refused as damaged, not served.

The functions here are pure but for :func:`save` (which writes the file) and :func:`restore_run` (which
refills the objects it is given); :class:`~pyro_fed.FederatedKernel` calls them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import numbers
import os
import tempfile
from typing import NamedTuple

import numpy as np
import torch
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from ..algorithms.adaptation import Adaptation

#: the layout of the file: a checkpoint of another layout is refused (4: with a ``checksum``)
FORMAT = 4
#: tensors up to this many bytes are hashed whole in the fingerprint; larger ones by their float64 sum and
#: ``SAMPLED_VALUES`` values spread over them (a cheap check, not a proof, that the data are the same)
HASHED_BYTES = 2**26
SAMPLED_VALUES = 1024
#: the network's counters, per chain
COUNTERS = ("uploaded_bits", "downloaded_bits", "rounds")
#: constructor arguments that do not change a run's draws: not part of the fingerprint
NOT_SETTINGS = ("self", "checkpoint", "checkpoint_every")
#: the suffix of the checkpoint before the last, kept beside it
PREVIOUS = ".previous"


class Start(NamedTuple):
    """Where a run's chains start, kept for its checkpoints."""

    positions: torch.Tensor  #: the chains' initial points, ``[C, d]`` (flat, unconstrained)
    inverse_mass: torch.Tensor  #: the preconditioner the iterations use, ``[d]`` or ``[d, d]``
    seeds: tuple[int, int]  #: the run's seed and the warm-up's, drawn from the global torch RNG


# ----------------------------------------------------------------------------------- encoding
def encode(value) -> torch.Tensor:
    """A JSON-able value as UTF-8 JSON bytes in a ``uint8`` tensor (floats are written so that they read
    back exactly)."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def decode(tensor: torch.Tensor):
    """The value :func:`encode` wrote."""
    return json.loads(bytes(tensor.numpy()).decode())


def checksum(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The SHA-256 of a checkpoint's tensors, as 32 ``uint8``: of each entry but ``checksum`` in the order
    of their names, its name, dtype, shape and bytes."""
    hashed = hashlib.sha256()
    for name in sorted(tensors):
        if name == "checksum":
            continue
        tensor = tensors[name].detach().cpu().contiguous()
        hashed.update(f"{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        hashed.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return torch.frombuffer(bytearray(hashed.digest()), dtype=torch.uint8)


def digest(tensor: torch.Tensor) -> str:
    """A short hash of a tensor's content: of all its bytes up to ``HASHED_BYTES``, else of its float64 sum
    and ``SAMPLED_VALUES`` values spread over it."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.numel() * flat.element_size() > HASHED_BYTES:
        picked = torch.linspace(0, flat.numel() - 1, SAMPLED_VALUES, device=flat.device).long()
        flat = torch.cat([flat.double().sum().reshape(1), flat[picked].double()])
    data = flat.contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def describe(value):
    """A JSON-able description of a setting or a model argument, equal for equal values: numbers, strings
    and ``None`` as they are, tensors by shape, dtype and :func:`digest`, containers element by element,
    functions by their qualified name (a ``functools.partial`` with its arguments), other objects by
    their type."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, np.ndarray):
        with contextlib.suppress(TypeError):
            value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')} #{digest(value)}"
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, functools.partial):
        return {
            "partial": describe(value.func),
            "args": describe(value.args),
            "keywords": describe(value.keywords),
        }
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return f"{type(value).__module__}.{type(value).__qualname__}"


# ----------------------------------------------------------------------------------- fingerprint
def kernel_settings(kernel_type: type, args: tuple, kwargs: dict) -> dict:
    """A kernel's constructor arguments ``args``, ``kwargs`` by name, with every default its classes'
    ``__init__`` declare (the most derived class's default wins), those passed through ``**kwargs``
    included: equal for two kernels built alike, whether a default was written out or not."""
    settings: dict = {}
    classes = [c for c in reversed(kernel_type.__mro__) if issubclass(c, MCMCKernel) and c is not MCMCKernel]
    for cls in classes:
        if "__init__" in cls.__dict__:
            for p in inspect.signature(cls.__dict__["__init__"]).parameters.values():
                if p.default is not p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    settings[p.name] = p.default
    signature = inspect.signature(kernel_type.__init__)
    bound = signature.bind(None, *args, **kwargs)
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind == inspect.Parameter.VAR_KEYWORD:
            settings.update(value)
        elif signature.parameters[name].kind == inspect.Parameter.VAR_POSITIONAL:
            settings[name] = list(value)
        else:
            settings[name] = value
    return {name: value for name, value in settings.items() if name not in NOT_SETTINGS}


def run_settings(kernel, warmup_steps: int, *, clients: bool = True) -> dict:
    """The kernel's class and constructor arguments (its settings, the model by name, and unless not
    ``clients`` the clients), the number of chains, ``num_samples`` and ``warmup_steps``: what every
    process holding some of the clients must be given alike (where each passes its own clients). A
    dictionary of JSON values."""
    constructor_args, constructor_kwargs = getattr(kernel, "_arguments", ((), {}))
    settings = kernel_settings(type(kernel), constructor_args, constructor_kwargs)
    found = {"kernel": describe(type(kernel))}
    found.update({name: describe(value) for name, value in settings.items() if clients or name != "clients"})
    found.update(
        num_chains=kernel.plan.num_chains, num_samples=kernel.plan.num_samples, warmup_steps=int(warmup_steps)
    )
    return found


def fingerprint(kernel, warmup_steps: int, args: tuple, kwargs: dict) -> dict:
    """What must be equal for a run to resume another: :func:`run_settings`, the user's initial values,
    the model's arguments (shapes, dtypes, content hashes), the clients' sizes and the data rows of the
    clients held here, the dtype and the device type. A dictionary of JSON values; read from a kernel after
    its potential is built (nothing is changed)."""
    pot = kernel.potential
    found = run_settings(kernel, warmup_steps)
    found.update(
        initial_params=describe(kernel.plan.initial_params),
        user_initial_params=describe(kernel._user_initial_params),
    )
    found.update({f"model argument {i}": describe(a) for i, a in enumerate(args)})
    found.update({f"model argument {k}": describe(kwargs[k]) for k in sorted(kwargs)})
    indices = [ix.cpu() for ix in pot.client_indices]
    found.update(
        client_sizes=pot.all_client_sizes.tolist(),
        clients_held_here=describe([len(ix) for ix in indices] + [torch.cat(indices) if indices else None]),
        dtype=str(pot.dtype).removeprefix("torch."),
        device=pot.device.type,
        dim=pot.dim,
    )
    return found


def differences(saved: dict, current: dict) -> list[str]:
    """The fields of two fingerprints that differ, in ``current``'s order (then those only ``saved`` has)."""
    names = list(current) + [name for name in saved if name not in current]
    return [
        name
        for name in names
        if json.dumps(saved.get(name), sort_keys=True) != json.dumps(current.get(name), sort_keys=True)
    ]


def mismatch(path: str, saved: dict, current: dict, fields: list[str]) -> str:
    """The error message for a checkpoint written by another configuration, naming what differs."""

    def show(found: dict) -> str:
        return ", ".join(
            f"{name}={json.dumps(found[name]) if name in found else '(not set)'}" for name in fields
        )

    return (
        f"the checkpoint at {path} was written by a run with {show(saved)}; this one has {show(current)}. "
        "A checkpoint resumes only the run that wrote it: delete it, or pass another checkpoint path."
    )


# ----------------------------------------------------------------------------------- the file
def capture(
    *, fingerprint: dict, runner, start: Start, adaptation: Adaptation | None
) -> dict[str, torch.Tensor]:
    """A run's checkpoint, CPU tensors by name (see the module's documentation): its fingerprint, its
    ``runner``'s (:class:`~pyro_fed.kernels.chunks.ChunkRunner`) algorithm state after the iterations it
    computed, generators, draws so far and network counters, where it started and what the warm-up chose."""
    state, computed, buffer, network = runner.state, runner.computed, runner.buffer, runner.network
    tensors: dict[str, torch.Tensor] = {}
    chosen = None
    if adaptation is not None:
        chosen = {}
        for name, value in adaptation._asdict().items():
            if isinstance(value, torch.Tensor):
                tensors[f"adaptation.{name}"] = value.detach().cpu().clone()
                chosen[name] = {"tensor": True}
            else:
                chosen[name] = value.item() if isinstance(value, np.generic) else value
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "computed": int(computed),
        "seeds": [int(s) for s in start.seeds],
        "state": len(state),
        "adaptation": chosen,
        "draws_dtype": None if buffer.dtype is None else str(buffer.dtype).removeprefix("torch."),
        "sent_bytes": int(network.sent_bytes),
    }
    head = {
        "meta": encode(meta),
        "positions": start.positions.detach().cpu().clone(),
        "inverse_mass": start.inverse_mass.detach().cpu().clone(),
    }
    head.update({f"state.{i}": t.detach().cpu().clone() for i, t in enumerate(state)})
    head.update(tensors)
    head.update({f"rng.{name}": value for name, value in runner.rng.state().items()})
    head.update({f"network.{name}": torch.from_numpy(getattr(network, name).copy()) for name in COUNTERS})
    head.update({f"buffer.{name}": value for name, value in buffer.state().items()})
    head["checksum"] = checksum(head)
    return head


def save(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write a checkpoint atomically: to a temporary file in the same directory (created if needed), then
    renamed to ``path``, whose last checkpoint becomes ``path + PREVIOUS``: the two files always hold the
    last two whole checkpoints (holders of clients in several processes may stop between their writes, one
    a checkpoint ahead of another: they resume from the last they all have)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(tensors, file)
            file.flush()
            os.fsync(file.fileno())
        if os.path.exists(path):
            os.replace(path, path + PREVIOUS)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def load(path: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (read with ``weights_only=True``, onto the CPU), its ``meta`` decoded."""
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(
            f"the checkpoint at {path} could not be read ({type(error).__name__}: {error}): delete it, or "
            "pass another checkpoint path."
        ) from error
    if (
        not isinstance(tensors, dict)
        or "meta" not in tensors
        or not all(isinstance(value, torch.Tensor) for value in tensors.values())
    ):
        raise ValueError(f"{path} is not a pyro_fed checkpoint: delete it, or pass another checkpoint path.")
    damaged = ValueError(
        f"the checkpoint at {path} is damaged: its contents changed after it was written (its checksum "
        "does not match them). Delete it to start afresh (or restore it from a copy)."
    )
    stored = tensors.get("checksum")
    if stored is not None and not torch.equal(stored, checksum(tensors)):
        raise damaged
    try:
        meta = decode(tensors["meta"])
    except (ValueError, RuntimeError, TypeError) as error:  # UnicodeDecodeError is a ValueError
        raise ValueError(
            f"the checkpoint at {path} could not be read (its description is not valid JSON: {error}): "
            "delete it, or pass another checkpoint path."
        ) from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(
            f"the checkpoint at {path} has format {found!r}; this pyro_fed reads format "
            f"{FORMAT}: delete it, or pass another checkpoint path."
        )
    if stored is None:  # this format is always written with its checksum
        raise damaged
    return {**tensors, "meta": meta}


def load_matching(path: str, current: dict, network) -> dict | None:
    """The checkpoint at ``path`` when there is one (``None`` otherwise), checked against this run's
    fingerprint ``current``: a ``ValueError`` names the fields that differ. Where clients are held in
    several processes each holder reads its own file, and all of them agree: all resume or none does, from
    checkpoints of the same iteration."""
    if not os.path.exists(path) and os.path.exists(path + PREVIOUS):  # stopped between the two renames
        os.replace(path + PREVIOUS, path)
    found = os.path.exists(path)
    if network.agree(found) and network.agree(not found):
        raise ValueError(
            f"checkpoint: {'this' if found else 'another'} holder of clients has its checkpoint ({path} "
            "here) and some other has none: they cannot resume together. Delete them all, or restore the "
            "missing."
        )
    if not found:
        return None
    saved, error, fields = None, None, []
    try:
        saved = load(path)
        fields = differences(saved["meta"]["fingerprint"], current)
    except ValueError as unreadable:  # raised once every holder knows, so that none waits for this one
        error = unreadable
    if network.agree(error is not None or bool(fields)):
        if error is not None:
            raise error
        if fields:
            raise ValueError(mismatch(path, saved["meta"]["fingerprint"], current, fields))
        raise ValueError(
            "checkpoint: another holder's checkpoint is unreadable or was written by another run than "
            f"{path}."
        )
    # the last checkpoint every holder has: its own last, or the one before
    candidates = {saved["meta"]["computed"]: saved}
    if os.path.exists(path + PREVIOUS):
        with contextlib.suppress(ValueError):
            older = load(path + PREVIOUS)
            if not differences(older["meta"]["fingerprint"], current):
                candidates[older["meta"]["computed"]] = older
    for computed in network.share(sorted(candidates, reverse=True)):
        if not network.agree(computed not in candidates):
            return candidates[computed]
    raise ValueError(
        f"checkpoint: the holders' checkpoints were written after different iterations ({sorted(candidates)} "
        f"in {path} and the one before); they cannot resume together. Delete them all to start afresh."
    )


# ----------------------------------------------------------------------------------- resuming
def start(saved: dict, device: torch.device) -> tuple[Start, Adaptation | None]:
    """Where the checkpointed run started, and what its warm-up chose, on ``device``."""
    meta = saved["meta"]
    chosen = None
    if meta["adaptation"] is not None:
        fields = {
            name: saved[f"adaptation.{name}"].to(device) if isinstance(value, dict) else value
            for name, value in meta["adaptation"].items()
        }
        chosen = Adaptation(**fields)
    begun = Start(saved["positions"].to(device), saved["inverse_mass"].to(device), tuple(meta["seeds"]))
    return begun, chosen


def algorithm_state(saved: dict, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The algorithm's state the checkpoint holds, on ``device``."""
    return tuple(saved[f"state.{i}"].to(device) for i in range(saved["meta"]["state"]))


def restore_run(saved: dict, runner, device) -> None:
    """Refill a freshly built run (its ``runner``, with its generators, empty buffer and network) with the
    checkpoint's iterations, generator states, draws and counters."""
    meta = saved["meta"]
    runner.computed = int(meta["computed"])
    runner.rng.set_state(
        {key[len("rng.") :]: value for key, value in saved.items() if key.startswith("rng.")}
    )
    for name in COUNTERS:
        setattr(runner.network, name, saved[f"network.{name}"].numpy().copy())
    # the bytes sent before the checkpoint, beside those this run's set-up sent to resume
    runner.network.sent_bytes += meta["sent_bytes"]
    prefix = "buffer."
    contents = {key[len(prefix) :]: value for key, value in saved.items() if key.startswith(prefix)}
    dtype = getattr(torch, meta["draws_dtype"]) if meta["draws_dtype"] else None
    runner.buffer.load_state(contents, dtype, device)
