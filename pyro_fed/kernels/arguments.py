"""Checks of the kernels' arguments, with messages that say which argument, what was wrong and what to do."""

from __future__ import annotations

import math
import numbers
import os

import numpy as np
import torch

from .. import messages
from ..data.partition import integral


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive(name: str, value) -> float:
    """A finite positive number (a Python or NumPy number, or a one-element tensor)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if not _is_number(value) or not math.isfinite(value) or not value > 0:
        raise ValueError(f"{name} must be a finite positive number; got {value!r}.")
    return float(value)


def check_positive_int(name: str, value, none_means: str | None = None) -> int | None:
    """A positive integer of any integer type (a Python int, a NumPy integer, a 0-d integer tensor), as an
    ``int``; ``None`` too when ``none_means`` says what it means. Floats (``2.5``, and ``1e3`` too) and bools
    are refused, naming the argument and the value."""
    if value is None and none_means is not None:
        return None
    found = integral(value)
    if found is None or found < 1:
        alternative = f" or None ({none_means})" if none_means else ""
        hint = f" Pass int({name}) if it holds a whole number." if _is_number(value) and found is None else ""
        raise ValueError(f"{name} must be a positive integer{alternative}; got {value!r}.{hint}")
    return found


def check_probability(name: str, value, *, allow_zero: bool = False) -> float:
    low_ok = (lambda v: v >= 0) if allow_zero else (lambda v: v > 0)
    if not _is_number(value) or not (low_ok(value) and value <= 1):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name} must be a number in {interval}; got {value!r}.")
    return float(value)


#: the preconditioner's names: what the warm-up adapts
PRECONDITIONER_FORMS = ("adapt", "diagonal", "dense")


def check_preconditioner(value):
    """``None``, one of ``PRECONDITIONER_FORMS``, a tensor of positive finite numbers (a diagonal inverse
    mass) or a symmetric positive definite matrix (a dense one); its size is checked at set-up."""
    if value is None or (isinstance(value, str) and value in PRECONDITIONER_FORMS):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 1 and bool((value.isfinite() & (value > 0)).all()):
        return value.detach()
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == value.shape[1]:
        matrix = value.detach()
        if bool(matrix.isfinite().all()) and torch.allclose(matrix, matrix.T):
            eigenvalues = torch.linalg.eigvalsh(matrix.double())
            # positive definite up to the rounding of its dtype (an adapted matrix of condition ~1e8 in
            # float32 may show tiny negative eigenvalues): those are raised to a small positive scale
            rounding = 10 * len(matrix) * torch.finfo(matrix.dtype).eps * float(eigenvalues.abs().max())
            if float(eigenvalues.max()) > 0 and float(eigenvalues.min()) > -rounding:
                return matrix
        raise ValueError(
            "preconditioner: a matrix must be a dense inverse mass, symmetric positive definite (e.g. a "
            "posterior covariance estimate); this one is not symmetric, not finite or has eigenvalues <= 0."
        )
    raise ValueError(
        f"preconditioner must be None (adapted with an automatic step size), 'adapt' (adapted, diagonal or "
        f"dense), 'diagonal', 'dense', a 1-D tensor of positive finite numbers (the inverse mass of each "
        f"unconstrained coordinate) or a symmetric positive definite matrix; got {value!r}."
    )


def check_batch_size(value) -> int | float | str | None:
    """``None`` (automatic), ``"full"`` (full local data), a positive integer, or a fraction in ``(0, 1)``."""
    if value is None or value == "full":
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1:
        return int(value)
    if isinstance(value, float) and 0 < value < 1:
        return value
    raise ValueError(
        "batch_size must be a positive integer (points per client and iteration), a fraction in (0, 1) of "
        f"each client's data, 'full' (all of it) or None (chosen with an automatic step, else full); got "
        f"{value!r}."
    )


def check_batch_size_fits(batch_size, client_sizes: torch.Tensor) -> None:
    """A minibatch size given as a number of points must be a minibatch for some client: larger than every
    client's data is refused (it would be full local batches); larger than some clients' data, those clients
    use all theirs at every iteration (exact local gradients), with a warning saying so."""
    if not isinstance(batch_size, int):
        return
    largest, smallest = int(client_sizes.max()), int(client_sizes.min())
    if batch_size > largest:
        raise ValueError(
            f"batch_size={batch_size} is larger than every client's data (the largest client holds {largest} "
            f"points): no client would draw a minibatch. Pass batch_size=None for full local batches, or at "
            f"most {largest}."
        )
    capped = int((client_sizes < batch_size).sum())
    if capped:
        messages.warn(
            f"batch_size={batch_size} is larger than the data of {capped} of the {len(client_sizes)} "
            f"clients (the smallest holds {smallest} points): those use all their data at every iteration "
            f"(exact local gradients), the others minibatches of {batch_size}. A fraction (batch_size=0.1) "
            "draws the same share of every client's data instead.",
        )


def check_checkpoint(path, every) -> tuple[str | None, int | None]:
    """``checkpoint``: ``None`` or a file path (a string or ``os.PathLike``, not a directory) that can be
    written, and ``checkpoint_every``: ``None`` (the default interval) or a positive number of draws per
    chain, given only with a path.

    The path is checked here, at construction, rather than at the first write after the warm-up: its folder
    must be a folder this process may write in (``os.access``), or, when it does not exist yet (the first
    write creates it), its nearest existing parent must be one. A path under a file (``"notes.txt/run.pt"``)
    is refused."""
    if path is None:
        if every is not None:
            raise ValueError(
                f"checkpoint_every={every!r} without a checkpoint: pass checkpoint='run.pt' (a file path) "
                "too, or leave checkpoint_every out."
            )
        return None, None
    if (
        not isinstance(path, (str, os.PathLike))
        or not isinstance(os.fspath(path), str)
        or not os.fspath(path)
    ):
        raise ValueError(f"checkpoint must be a file path (a str or os.PathLike) or None; got {path!r}.")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"checkpoint={path!r} is a directory: give a file path in it, e.g. '{path}/run.pt'.")
    _check_writable_folder(path)
    return path, check_positive_int("checkpoint_every", every, "a tenth of the run's draws")


def _check_writable_folder(path: str) -> None:
    """The folder of the checkpoint ``path``, or its nearest existing parent when the folder is still to be
    created, is a folder this process may write in."""
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(
            f"checkpoint={path!r} lies under {existing!r}, which is a file, not a folder: no checkpoint "
            "can be written there. Give a path in a folder, e.g. 'run.pt' or 'checkpoints/run.pt'."
        )
    # os.access asks the kernel, which also answers for a read-only file system (for root too)
    if not os.access(existing, os.W_OK | os.X_OK):
        what = f"its folder {folder!r}"
        if existing != folder:
            what = f"{existing!r}, where its folder {folder!r} would be made,"
        raise ValueError(
            f"checkpoint={path!r}: {what} is not writable by this process (read-only, or another user's): "
            "the first checkpoint would fail after the warm-up. Give a path in a folder you can write to, or "
            "change the folder's permissions."
        )
