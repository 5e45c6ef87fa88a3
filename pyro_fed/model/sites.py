"""Reading a Pyro model's sites: the data plate, the global latent sites and the observed sites.

pyro_fed splits the likelihood of a model across clients along one plate, the *data plate* of ``N``
points. The sites of the model fall in three classes:

- the global latent sites :math:`\\theta`, continuous and outside the data plate: the sampled parameters;
- the global observed sites (and factors) outside the plate, which count with the prior :math:`U^0`;
- the likelihood sites, observed inside the plate, whose log-densities are summed per datum into
  :math:`-U^i_j(\\theta)` for datum ``j`` of client ``i``.

Every evaluation runs the model on a subsample of the data: a model that reads its data through the plate's
indices (``pyro.subsample``, ``with pyro.plate(...) as idx: y[idx]``) gets the subsample's indices injected
into the plate; a model written for NUTS, which reads its data at full size, is run on the subsample's rows
of its data arguments (:mod:`pyro_fed.model.rows`). :class:`ModelSites` finds which, and checks it, once,
with clear errors, when it reads the model.

The data are checked once, when the model is read, and a failure says which argument is the likely
cause: a NumPy array, a dtype or a device other than the latent values', a tensor read through the plate
whose length is not the plate's (:func:`diagnose_arguments`); observed values outside their distribution's
support are refused, naming the site, the values and their data indices
(:meth:`ModelSites.check_observed_support`). A ``pyro.param`` is a constant of the potential (its value,
detached), as in Pyro's MCMC; a data plate declared with ``subsample_size`` equal to its size is a full
plate; observed entries masked out (``obs_mask``, ``poutine.mask``) contribute nothing, even where they
hold NaN.

Validation is switched off while the model runs inside pyro_fed's evaluations: its checks of argument and
sample values branch on tensor values, which :func:`torch.func.vmap` and tracing cannot do. Distributions
that the model builds while it runs follow Pyro's global switch; distributions built beforehand (the
priors of a :class:`~pyro.nn.PyroModule`, a prior created at import time) carry their own flag, so each
sample site gets a copy of its distribution with validation off (:func:`without_validation`).

**Reference:** Plassier et al., *Federated Averaging Langevin Dynamics: Toward a unified theory and new
algorithms*, AISTATS 2023, Section 2.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Iterator

import numpy as np
import pyro
import torch
from pyro import poutine
from pyro.distributions import MaskedDistribution
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import SubsampleMessenger
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample
from torch.distributions import biject_to, constraints

from .rows import DataRows, model_signature

#: half-width of the box of the unconstrained space where a site that cannot be sampled starts (Stan's and
#: Pyro's :func:`~pyro.infer.autoguide.initialization.init_to_uniform` default)
INITIAL_RADIUS = 2.0


def without_validation(fn: torch.distributions.Distribution) -> torch.distributions.Distribution:
    """``fn`` with ``_validate_args`` off, itself and in the distributions it wraps (``base_dist`` of
    :class:`~torch.distributions.Independent`, ``ExpandedDistribution``, ``MaskedDistribution``..., the
    components of a mixture): shallow copies where needed, ``fn`` itself when its own flags are already off.
    The user's objects are never modified."""
    wrapped = {
        key: without_validation(value)
        for key, value in vars(fn).items()
        if isinstance(value, torch.distributions.Distribution)
    }
    changed = {key: value for key, value in wrapped.items() if value is not vars(fn)[key]}
    # a distribution built without validate_args follows the global switch at each call: its copy gets its own
    # flag, so that its log_prob does not validate even outside pyro.validation_enabled(False)
    if vars(fn).get("_validate_args", True) is False and not changed:
        return fn
    fn = copy.copy(fn)
    vars(fn).update(changed)
    # after the update: Pyro's Independent passes its flag on to its base_dist, which must be the copy
    fn._validate_args = False
    return fn


def unconstrained_uniform(site: dict, radius: float = INITIAL_RADIUS) -> torch.Tensor:
    """An initial value for the sample ``site`` that does not sample its distribution: uniform in
    :math:`(-r, r)` on the unconstrained space of its support, mapped back (Stan's default initialisation).
    For an improper prior (:class:`~pyro.distributions.ImproperUniform`, a flat prior on its support), which
    cannot be sampled; in the default dtype and device, as the parameters of a prior written with Python
    numbers (``dist.Normal(0.0, 1.0)``)."""
    fn = site["fn"]
    transform = biject_to(fn.support)
    shape = transform.inv.forward_shape(fn.batch_shape + fn.event_shape)
    return transform((torch.rand(shape) * 2 - 1) * radius).detach()


def sampling_free(init_strategy: Callable) -> Callable:
    """``init_strategy``, with :func:`unconstrained_uniform` for the sites whose distribution cannot be
    sampled (Pyro's strategies, ``init_to_median`` or ``init_to_uniform``, all sample the prior first: an
    improper flat prior raises ``NotImplementedError`` there). A site the strategy gives a value keeps it."""

    def strategy(site: dict) -> torch.Tensor:
        try:
            return init_strategy(site)
        except NotImplementedError:
            return unconstrained_uniform(site)

    return strategy


class _WithoutValidation(Messenger):
    """Replaces each sample site's distribution by :func:`without_validation` of it."""

    def _pyro_sample(self, msg) -> None:
        if isinstance(msg["fn"], torch.distributions.Distribution):
            msg["fn"] = without_validation(msg["fn"])


class _FixMissing(Messenger):
    """Gives the missing entries of an ``obs_mask`` site (``{name}_unobserved``) a fixed value: they are
    marginalised out (left out of the potential), so no randomness is drawn for them."""

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names

    def _pyro_sample(self, msg) -> None:
        if msg["name"] in self.names:
            try:  # on the distribution's device and dtype
                like = msg["fn"].mean
            except NotImplementedError:
                like = torch.zeros(())
            msg["value"] = torch.zeros(msg["fn"].shape(), dtype=like.dtype, device=like.device)
            msg["is_observed"] = True


class _ParamsAsConstants(Messenger):
    """Gives every ``pyro.param`` (and PyroModule parameter) a constant value, ``{name: value}`` (read once,
    detached), as Pyro's MCMC, which samples the latent sites only, treats it. Read from the parameter store
    inside :func:`torch.func.grad`, the value would be computed there from its unconstrained leaf, whose
    graph ``detach`` cannot cut at that level: every gradient and draw would require gradients."""

    def __init__(self, values: dict[str, torch.Tensor]):
        super().__init__()
        self.values = values

    def _pyro_param(self, msg) -> None:
        if msg["name"] in self.values and msg["value"] is None:
            msg["value"] = self.values[msg["name"]]

    def _pyro_post_param(self, msg) -> None:  # a parameter the first run did not read
        if isinstance(msg["value"], torch.Tensor) and msg["value"].requires_grad:
            msg["value"] = msg["value"].detach()


class _FillMasked(Messenger):
    """Writes a finite placeholder into the masked-out entries of the observed sites ``placeholders`` (a
    datum's value in the support, ``{site: [*event_shape]}``): their log-density is masked out of the
    potential, but a NaN there would still reach the gradient (the derivative of ``where(mask, log_prob,
    0)`` is 0 there, and ``0 * NaN`` is NaN)."""

    def __init__(self, placeholders: dict[str, torch.Tensor]):
        super().__init__()
        self.placeholders = placeholders

    def _pyro_sample(self, msg) -> None:
        placeholder = self.placeholders.get(msg["name"])
        if placeholder is None or not msg["is_observed"] or not isinstance(msg["mask"], torch.Tensor):
            return
        value, event_dim = msg["value"], len(placeholder.shape)
        mask = msg["mask"].reshape(msg["mask"].shape + (1,) * event_dim)
        filled = torch.where(mask, value, placeholder.to(value.dtype))
        if filled.shape == value.shape:
            msg["value"] = filled


@contextlib.contextmanager
def full_size_plate(name: str) -> Iterator[None]:
    """While the model runs: the plate ``name``, if declared with ``subsample_size`` equal to its size (a full
    plate, as Pyro's own MCMC runs it), takes the subsample pyro_fed injects, of any size. Pyro would refuse
    it as a subsample of another size than declared."""
    original = SubsampleMessenger.__dict__["_subsample"]

    def subsample(plate, size=None, subsample_size=None, subsample=None, use_cuda=None, device=None):
        if plate == name and size is not None and subsample_size == size:
            subsample_size = None
        return original.__func__(plate, size, subsample_size, subsample, use_cuda, device)

    SubsampleMessenger._subsample = staticmethod(subsample)
    try:
        yield
    finally:
        SubsampleMessenger._subsample = original


class _PlateReached(Exception):
    """Raised by :class:`_StopAtPlate` where the model enters its data plate."""


class _StopAtPlate(Messenger):
    """Stops the model where it enters the data plate ``plate`` (raises :class:`_PlateReached`)."""

    def __init__(self, plate: str):
        super().__init__()
        self.plate = plate

    def _pyro_sample(self, msg) -> None:
        if site_is_subsample(msg) and msg["name"] == self.plate:
            raise _PlateReached


class _SubsampleShapes(Messenger):
    """Records the ``pyro.subsample(data, event_dim=...)`` reads whose data do not have the plate's size
    along its dimension (Pyro checks this only with validation on, which ``MCMC`` switches off): the data
    would be read short (an index error) or in part (a silent truncation)."""

    def __init__(self):
        super().__init__()
        #: ``(data, event_dim, plate frame)`` of each such read
        self.problems: list[tuple] = []

    def _pyro_post_subsample(self, msg) -> None:
        data, event_dim = msg["value"], msg["kwargs"].get("event_dim")
        if event_dim is None and len(msg["args"]) > 1:
            event_dim = msg["args"][1]
        if not isinstance(data, torch.Tensor) or not isinstance(event_dim, int):
            return
        for frame in msg["cond_indep_stack"]:
            size = frame.full_size if frame.full_size is not None else frame.size
            if frame.dim is None or size is None or size < 0:
                continue
            dim = frame.dim - event_dim
            if data.dim() >= -dim and data.shape[dim] not in (1, size):
                self.problems.append((data, event_dim, frame, size))


# ------------------------------------------------------------------ the data's form
#: how torch's error messages name each dtype (ScalarType names, C++ type names, Python names)
_DTYPE_WORDS = {
    torch.float16: ("Half", "float16"),
    torch.bfloat16: ("BFloat16", "bfloat16"),
    torch.float32: ("Float", "float32", "float"),
    torch.float64: ("Double", "float64", "double"),
    torch.int64: ("Long", "int64", "long"),
    torch.int32: ("Int", "int32", "int"),
    torch.int16: ("Short", "int16", "short"),
    torch.int8: ("Char", "int8"),
    torch.uint8: ("Byte", "uint8"),
    torch.bool: ("Bool", "bool"),
}


def _names_dtype(text: str, dtype: torch.dtype) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){word}(?![A-Za-z0-9_])", text) for word in _DTYPE_WORDS[dtype])


def named_arguments(model: Callable, args: tuple, kwargs: dict) -> list[tuple[str, object]]:
    """The model's arguments with the names of its signature (``argument 0``... where it has none), and the
    items of the lists, tuples and dicts among them (``data['x']``)."""
    try:
        named = list(model_signature(model).bind(*args, **kwargs).arguments.items())
    except (TypeError, ValueError):
        named = [(f"argument {i}", arg) for i, arg in enumerate(args)] + list(kwargs.items())
    items = []
    for name, value in named:
        items.append((name, value))
        if isinstance(value, list | tuple) and not _numbers(value):
            items += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            items += [(f"{name}[{k!r}]", v) for k, v in value.items()]
    return items


def _numbers(value) -> bool:
    """Whether ``value`` is a non-empty list or tuple of Python numbers, or of such lists: data written as
    lists, where the model needs a tensor."""
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and all(isinstance(v, int | float | bool) or _numbers(v) for v in value)
    )


def diagnose_arguments(
    error: Exception,
    arguments: list[tuple[str, object]],
    dtype: torch.dtype,
    device: torch.device,
    plate_sizes: dict[str, int],
) -> list[str]:
    """What in the model's ``arguments`` (:func:`named_arguments`) the failure ``error`` of a run of the
    model points to, one sentence per argument with its fix: only what the error itself names — a NumPy
    array (the error speaks of ``ndarray``), data written as lists (it speaks of lists or indices), a dtype
    other than the latent values' ``dtype`` (the error speaks of dtypes and names the argument's), a device
    other than ``device`` (the error speaks of devices), a tensor shorter than a plate of ``plate_sizes``
    (an index out of bounds for a dimension of the argument's length)."""
    text = f"{type(error).__name__}: {error}"
    causes = []
    for name, value in arguments:
        if isinstance(value, np.ndarray) and re.search("ndarray|numpy", text):
            fix = f"torch.as_tensor({name}" + (f", dtype={dtype})" if value.dtype.kind == "f" else ")")
            causes.append(f"{name} is a numpy.ndarray ({value.dtype}): pass {fix}")
        if _numbers(value) and re.search("index|list|tuple", text):
            # e.g. a list indexed by the plate's index tensor: "only integer tensors ... to an index"
            causes.append(f"{name} is a {type(value).__name__}: pass torch.as_tensor({name})")
        if not isinstance(value, torch.Tensor):
            continue
        if value.dtype != dtype and re.search("dtype|scalar type", text) and _names_dtype(text, value.dtype):
            fix = f"{name}.to({dtype})"
            if value.dtype in (torch.float32, torch.float64):
                fix += f", or build the priors in {value.dtype}"
            causes.append(f"{name} has dtype {value.dtype}, the model's latent values {dtype}: pass {fix}")
        if value.device != device and "device" in text:
            causes.append(
                f"{name} is on device {value.device}, the model's latent values on {device}: pass "
                f"{name}.to({str(device)!r})"
            )
        match = re.search(r"out of bounds for dimension -?\d+ with size (\d+)", text)
        short = match and int(match[1])
        for plate, size in plate_sizes.items():
            if match and short < size and short in value.shape and size not in value.shape:
                causes.append(
                    f"{name} has {short} entries (shape {tuple(value.shape)}) where plate {plate!r} has "
                    f"{size} data: give every argument read through the plate one entry per datum"
                )
    return list(dict.fromkeys(causes))


def error_reason(error: Exception) -> str:
    """The first line of ``error``'s message (its type where it has none)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _first_line(error: Exception) -> str:
    """``error``'s type and :func:`error_reason`."""
    return f"{type(error).__name__}: {error_reason(error)}" if str(error).strip() else type(error).__name__


def _static(constraint: constraints.Constraint) -> bool:
    """Whether ``constraint`` holds no tensor (a support that the latent values cannot move, e.g.
    ``boolean``, ``integer_interval(0, 2)``, ``positive``)."""
    for value in vars(constraint).values():
        if isinstance(value, torch.Tensor):
            return False
        if isinstance(value, constraints.Constraint) and not _static(value):
            return False
    return True


def _layers(fn) -> list:
    """``fn`` and the distributions it wraps (``Independent``, masks, expansions), outermost first."""
    layers = [fn]
    while type(layers[-1]).__name__ in ("Independent", "MaskedDistribution", "ExpandedDistribution"):
        layers.append(layers[-1].base_dist)
    return layers


def _distribution_name(fn) -> str:
    return type(_layers(fn)[-1]).__name__


def is_deterministic_record(site: dict) -> bool:
    """A sample site that records a value computed from others: a ``pyro.deterministic`` site, or the value a
    reparametrizer computes in place of the site it replaced (:class:`~pyro.infer.reparam.LocScaleReparam`'s
    non-centred ``a`` from ``a_decentered``). Pyro marks both observed, with a distribution masked off
    entirely: they carry no density. (A latent site whose prior is masked off is a random variable with a
    flat prior.)"""
    fn = site.get("fn")
    return (
        site["type"] == "sample"
        and not site_is_subsample(site)
        and bool(
            site["infer"].get("_deterministic")
            or (site["is_observed"] and isinstance(fn, MaskedDistribution) and fn._mask is False)
        )
    )


def is_random_variable(site: dict) -> bool:
    """A sample site that is a random variable of the model: not a plate's subsample site, and not a
    deterministic record (:func:`is_deterministic_record`)."""
    return site["type"] == "sample" and not site_is_subsample(site) and not is_deterministic_record(site)


def find_data_plate(trace: Trace, plate: str | None) -> str:
    """The name of the plate holding the observed sites (``plate`` if given, checked)."""
    candidates = []
    for site in trace.nodes.values():
        if is_random_variable(site) and site["is_observed"]:
            for frame in site["cond_indep_stack"]:
                if frame.vectorized and frame.name not in candidates:
                    candidates.append(frame.name)
    if plate is not None:
        if plate not in candidates:
            raise ValueError(
                f"plate={plate!r}: the model has no plate of that name containing observed sites "
                f"(plates with observed sites: {candidates}). Pass the name of the data plate."
            )
        return plate
    if not candidates:
        raise ValueError(
            "The model has no plate containing observed sites: pyro_fed splits the likelihood plate "
            "across clients. Declare the data as `with pyro.plate('data', N): pyro.sample(..., obs=...)`."
        )
    if len(candidates) > 1:
        raise ValueError(
            f"The model has several plates containing observed sites: {candidates}. "
            "Say which one is the data plate to split across clients with plate='name'."
        )
    return candidates[0]


def _log_density(node: dict, scale: float = 1.0) -> torch.Tensor:
    return scale_and_mask(node["fn"].log_prob(node["value"]), node["scale"] * scale, node["mask"])


class ModelSites:
    """A model's sites, read (and checked) from one run of the model under ``init_strategy``.

    :param model: a Pyro model whose likelihood is a plate over data (declared at full size).
    :param tuple model_args: positional arguments of the model.
    :param dict model_kwargs: keyword arguments of the model.
    :param str plate: name of the data plate; found automatically when exactly one plate holds observed
        sites.
    :param init_strategy: a Pyro init strategy giving the initial latent values.

    Attributes: ``plate``, ``plate_dim`` (its dimension), ``num_data`` (``N``), ``latent_names`` (the
    global latent sites, in the model's order), ``global_observed``, ``likelihood_sites`` and
    ``initial_trace`` (the run of the model under ``init_strategy``).
    """

    def __init__(
        self,
        model: Callable,
        model_args: tuple,
        model_kwargs: dict,
        *,
        plate: str | None,
        init_strategy: Callable,
    ):
        self.model = model
        self.model_args = model_args
        self.model_kwargs = model_kwargs
        self.init_strategy = init_strategy
        self.initial_trace = trace = self.draw_initial_trace()
        #: the values of the model's ``pyro.param`` sites, constants of the potential (as in Pyro's MCMC)
        self.params = {
            name: site["value"].detach() for name, site in trace.nodes.items() if site["type"] == "param"
        }
        self.plate = find_data_plate(trace, plate)
        plate_fn = trace.nodes[self.plate]["fn"]
        self.num_data = int(plate_fn.size)
        #: whether the data plate is declared with ``subsample_size`` equal to its size (a full plate)
        self.full_size_subsample = plate_fn.subsample_size == self.num_data
        if plate_fn.subsample_size is not None and plate_fn.subsample_size < self.num_data:
            raise ValueError(
                f"The data plate {self.plate!r} is declared with subsample_size: pyro_fed chooses each "
                "client's minibatch itself. Declare the plate at full size, without subsample_size, and "
                "read the data through the plate's indices (pyro.subsample or `as idx`)."
            )
        self._classify(trace)
        #: for the likelihood sites whose masked-out observed entries are not finite: a datum's observed
        #: value written there while the model runs (see ``_FillMasked``)
        self.placeholders = self._placeholders()
        #: the model's data arguments, for a model that reads its data at full size (a model written for
        #: NUTS): each evaluation runs it on their rows (:mod:`pyro_fed.model.rows`); ``None`` for a model
        #: that reads them through the plate's indices, which are injected into the plate
        self.rows: DataRows | None = None
        #: in the rows form, the latent sites with one entry per datum along an axis (``{site: axis}``: a
        #: per-datum effect sized from the data, as eight schools' ``theta_trans``): each evaluation reads
        #: their rows, and the prior comes from :meth:`prior_trace`
        self.row_latents: dict[str, int] = {}
        self._find_how_data_are_read()

    def draw_initial_trace(self) -> Trace:
        """A fresh run of the model with its latent values drawn by the init strategy."""
        shapes = _SubsampleShapes()
        tracer = poutine.trace(InitMessenger(sampling_free(self.init_strategy))(shapes(self.model)))
        try:
            trace = tracer.get_trace(*self.model_args, **self.model_kwargs)
        except Exception as error:
            self._check_subsample_shapes(shapes.problems, error)
            # a PyroModule's weights first read inside a plate get its batch shape: the model then fails
            # in its own layers; say why, with the fix
            inside = [
                name
                for name, site in tracer.msngr.trace.nodes.items()
                if site["type"] == "sample" and not site["is_observed"] and site["cond_indep_stack"]
            ]
            if any("." in name for name in inside):
                site_plate = next(
                    f.name for n in inside for f in tracer.msngr.trace.nodes[n]["cond_indep_stack"]
                )
                raise ValueError(
                    f"The model failed ({type(error).__name__}: {error}) after sampling {inside} inside the "
                    f"plate {site_plate!r}." + _module_hint(site_plate)
                ) from error
            self._diagnose(error, tracer.msngr.trace, "when first run")
            raise
        self._check_subsample_shapes(shapes.problems)
        return trace

    def _check_subsample_shapes(self, problems: list[tuple], error: Exception | None = None) -> None:
        """Refuse the ``pyro.subsample`` reads of data whose length is not their plate's, naming the
        argument (see ``_SubsampleShapes``)."""
        if not problems:
            return
        data, event_dim, frame, size = problems[0]
        names = [n for n, v in named_arguments(self.model, self.model_args, self.model_kwargs) if v is data]
        what = names[0] if names else "a tensor"
        dim = frame.dim - event_dim
        # another event_dim that puts a dimension of the plate's size under the plate: the likely slip, in a
        # plate nested in another (its reads counted from the inner plate's dimension)
        fits = [
            e
            for e in range(data.dim())
            if e != event_dim and frame.dim - e >= -data.dim() and data.shape[frame.dim - e] == size
        ]
        other = f", or read it with event_dim={fits[0]} (its dimension {frame.dim - fits[0]})" if fits else ""
        raise ValueError(
            f"pyro.subsample(..., event_dim={event_dim}) in plate {frame.name!r} of {size} data reads {what} "
            f"of shape {tuple(data.shape)}, with {data.shape[dim]} entries along the plate's dimension "
            f"({dim}): give {what} one entry per datum of the plate ({size}){other}, or declare the plate "
            "with the data's length."
        ) from error

    def _diagnose(self, error: Exception, trace: Trace, when: str) -> None:
        """Raise a ``ValueError`` naming the arguments that the failure ``error`` of the model (its partial
        ``trace``) points to (:func:`diagnose_arguments`), if any."""
        latent = [
            site["value"]
            for site in trace.nodes.values()
            if is_random_variable(site) and not site["is_observed"] and torch.is_tensor(site["value"])
        ]
        dtype = latent[0].dtype if latent else torch.get_default_dtype()
        device = latent[0].device if latent else torch.zeros(()).device
        plate_sizes = {
            name: int(site["fn"].size) for name, site in trace.nodes.items() if site_is_subsample(site)
        }
        arguments = named_arguments(self.model, self.model_args, self.model_kwargs)
        causes = diagnose_arguments(error, arguments, dtype, device, plate_sizes)
        if causes:
            raise ValueError(
                f"The model failed {when} ({_first_line(error)}). The likely cause, in its arguments: "
                + "; ".join(causes)
                + "."
            ) from error

    def _classify(self, trace: Trace) -> None:
        #: the deterministic records outside the data plate (:func:`is_deterministic_record`): functions of
        #: the global latent sites, for the posterior's output
        self.deterministic_names: list[str] = []
        self.latent_names: list[str] = []
        self.global_observed: list[str] = []
        self.likelihood_sites: list[str] = []
        #: the missing entries of ``obs_mask`` sites: latent per datum, marginalised out by leaving them out
        self.missing_sites: set[str] = set()
        for name, site in trace.nodes.items():
            in_plate = any(f.name == self.plate for f in site.get("cond_indep_stack", ()))
            if is_deterministic_record(site) and not in_plate:
                self.deterministic_names.append(name)
            if not is_random_variable(site):
                continue
            if site["is_observed"]:
                (self.likelihood_sites if in_plate else self.global_observed).append(name)
                if in_plate:
                    self.plate_dim = next(f.dim for f in site["cond_indep_stack"] if f.name == self.plate)
                continue
            base = name.removesuffix("_unobserved")
            if in_plate and base != name and f"{base}_observed" in trace.nodes and base in trace.nodes:
                # pyro.sample(base, ..., obs_mask=...): its missing entries carry no information on the
                # global parameters; leaving them out of the potential integrates them out exactly
                self.missing_sites.add(name)
                continue
            if in_plate:
                raise ValueError(
                    f"Site {name!r} is a latent variable inside the data plate {self.plate!r}: pyro_fed "
                    "samples global parameters only. Move it out of the plate, or marginalise it."
                    + (_module_hint(self.plate) if "." in name else "")
                )
            if site["fn"].support.is_discrete or site["infer"].get("enumerate"):
                raise ValueError(
                    f"Site {name!r} is a discrete latent variable: Langevin samplers need continuous "
                    "parameters. Marginalise it out of the model (or observe it)."
                )
            self.latent_names.append(name)
        if not self.latent_names:
            raise ValueError("The model has no continuous global latent site to sample.")

    def _find_how_data_are_read(self) -> None:
        """Through the plate's indices (tried first: such a model keeps its evaluations as they were), else
        by the rows of the model's data arguments (:mod:`pyro_fed.model.rows`), checked against the
        full-size run; refused, naming the site, the plate and the two ways out, where neither holds."""
        for name in self.likelihood_sites:
            value = self.initial_trace.nodes[name]["value"]
            if not torch.is_tensor(value):  # Pyro records what it was given (a NumPy array, a list)
                kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
                error = TypeError(f"observed site {name!r} has a value of type {kind}, not a tensor")
                self._diagnose(error, self.initial_trace, f"at its observed site {name!r}")
                raise ValueError(
                    f"Observed site {name!r} has a value of type {kind}: pass the model's data as torch "
                    "tensors (`torch.as_tensor(data)`)."
                ) from error
        try:
            self._check_model_reads_plate_indices()
            return
        except ValueError:
            rows = DataRows(self.model, self.model_args, self.model_kwargs, self.num_data)
            if not rows:  # no argument holds a row per datum: nothing else to try
                raise
        self.rows = rows
        self._check_rows()

    def _check_model_reads_plate_indices(self) -> None:
        n = min(2, self.num_data - 1) if self.num_data > 1 else 1
        values = {name: self.initial_trace.nodes[name]["value"] for name in self.latent_names}
        indices = torch.arange(n, device=values[self.latent_names[0]].device)
        self._trial_run(values, indices, f"a subsample of {n} indices of plate {self.plate!r}")

    def _trial_run(self, values: dict[str, torch.Tensor], indices: torch.Tensor, on: str) -> Trace:
        """The model run at the latent ``values`` on the data ``indices`` (described by ``on``), its failure
        refused with its likely cause and the ways out, and its likelihood sites checked to follow them."""
        try:
            trace = self.run(values, indices)
        except Exception as error:
            self._diagnose(error, self.initial_trace, f"when run on {on}")
            raise ValueError(
                f"The model failed when run on {on} ({_first_line(error)}). {self._ways_out(error)}"
            ) from error
        self._check_follows_plate(trace, len(indices))
        return trace

    def _check_follows_plate(self, trace: Trace, n: int) -> None:
        """Refuse a likelihood site of ``trace`` (a run on ``n`` data) whose distribution or value does not
        have ``n`` entries along the data plate's dimension."""
        for name in self.likelihood_sites:
            fn, value = trace.nodes[name]["fn"], trace.nodes[name]["value"]
            value_batch = value.shape[: value.dim() - len(fn.event_shape)]
            if not all(
                len(s) >= -self.plate_dim and s[self.plate_dim] == n for s in (fn.batch_shape, value_batch)
            ):
                raise ValueError(
                    f"Observed site {name!r} does not follow the data of plate {self.plate!r}: run on {n} of "
                    f"them its distribution has batch shape {tuple(fn.batch_shape)} and its value shape "
                    f"{tuple(value.shape)}. {self._ways_out(site=name)}"
                )

    def _ways_out(self, error: Exception | None = None, site: str | None = None) -> str:
        """What a model must do for its data to be split, naming ``site`` or the site that ``error`` names."""
        named = re.search(r"at site (\S+)", str(error)) if error is not None else None
        site = site or (named[1] if named else None)
        plate = repr(self.plate)
        where = f"site {site!r} in plate {plate} reads" if site else f"the sites of plate {plate} read"
        return (
            f"pyro_fed gives each client its part of the data, and {where} data it cannot split. Pass "
            "the data to the model as arguments, one row per datum (`mcmc.run(x, y)`, as for NUTS), or read "
            f"them through the plate's indices: `pyro.subsample(data, event_dim=...)` or `with "
            f"pyro.plate({self.plate!r}, N) as idx: ... data[idx]`. Data that reach the model another way (a "
            "closure or a module global at full size) cannot be split."
        )

    def _check_rows(self) -> None:
        """Check the rows form (:mod:`pyro_fed.model.rows`) on a few data, in another order than theirs: the
        run on their rows must give every likelihood site the log-densities that the full-size run gives
        those data, and every other site the same shape and density. Equal to the rounding of reductions
        over fewer rows: a relative ``1e-4`` in float32, ``1e-8`` in float64."""
        ends = torch.tensor([self.num_data - 1, self.num_data // 2, 0])
        values = {name: self.initial_trace.nodes[name]["value"] for name in self.latent_names}
        indices = torch.unique_consecutive(ends).to(values[self.latent_names[0]].device)
        n, arguments = len(indices), ", ".join(self.rows.names)
        axes = self._latent_axes_on_rows(values, indices)
        sized = [name for name, axis in axes.items() if axis is None]
        if sized:
            raise ValueError(
                f"Site {sized[0]!r} outside plate {self.plate!r} changes shape when the model is run on "
                f"{n} rows of its data arguments ({arguments}), and not as a parameter per data point "
                "would: a parameter sized from the data is another parameter on each client's part. Size "
                "it from the whole data (pass the number of data points or groups to the model)."
            )
        self.row_latents = dict(axes)
        prior = self.prior_trace(values) if self.row_latents else None
        declared = self.latent_names + self.global_observed
        late = [name for name in declared if prior is not None and name not in prior.nodes]
        if late:
            raise ValueError(
                f"Site {late[0]!r} comes after plate {self.plate!r}, in a model with a parameter per data "
                f"point ({', '.join(self.row_latents)}), whose prior pyro_fed reads from the sites before "
                "the plate: declare the global sites before the plate."
            )
        trace = self._trial_run(values, indices, f"{n} rows of its data arguments ({arguments})")
        latent = next(iter(values.values()))
        tolerance = 1e-4 if latent.dtype == torch.float32 else 1e-8
        for name in self.latent_names + self.global_observed:
            full, part = self.initial_trace.nodes[name], (trace if prior is None else prior).nodes[name]
            if not _close(_log_density(part).sum(), _log_density(full).sum(), tolerance):
                raise ValueError(
                    f"The density of site {name!r} outside plate {self.plate!r} changes when the model is "
                    f"run on {n} rows of its data arguments ({arguments}): a prior computed from the data "
                    "(a scale from y.std()) would be another prior on each client's part. Compute it from "
                    "the whole data beforehand and pass it to the model."
                )
        for name in self.likelihood_sites:
            full = self._per_datum(self.pointwise_log_prob(self.initial_trace, name))[indices.cpu()]
            part = self._per_datum(self.pointwise_log_prob(trace, name))
            if not _close(part, full.to(part.device), tolerance):
                raise ValueError(
                    f"Observed site {name!r} in plate {self.plate!r} gives other log-densities when the "
                    f"model is run on {n} rows of its data arguments ({arguments}) than at full size for "
                    f"the same data. {self._ways_out(site=name)}"
                )

    def _latent_axes_on_rows(self, values: dict[str, torch.Tensor], indices: torch.Tensor) -> dict:
        """The latent sites whose distribution has another shape when the model runs on the rows ``indices``
        of its data arguments, at the latent ``values`` (the run goes as far as it can: a site's distribution
        is recorded before the model computes with its value): ``{site: axis}``, the axis along which it has
        one entry per datum (``N`` entries at full size, ``len(indices)`` on the rows), or ``None`` where its
        shape changes otherwise."""
        args, kwargs, data = self._evaluation_inputs(values, indices)
        tracer = self._tracer(self.model, data)
        with pyro.validation_enabled(False), self._full_size(), contextlib.suppress(Exception):
            tracer.get_trace(*args, **kwargs)
        nodes, axes = tracer.msngr.trace.nodes, {}
        for name in self.latent_names:
            if name not in nodes:
                continue
            full, part = self.initial_trace.nodes[name]["fn"].shape(), nodes[name]["fn"].shape()
            changed = [a for a in range(len(full)) if len(part) == len(full) and full[a] != part[a]]
            if full != part:
                per_datum = (self.num_data, len(indices))
                fits = len(changed) == 1 and (full[changed[0]], part[changed[0]]) == per_datum
                axes[name] = changed[0] if fits else None
        return axes

    def _per_datum(self, log_prob: torch.Tensor) -> torch.Tensor:
        """A site's log-densities in the layout of its batch shape, summed per datum of the plate."""
        log_prob = log_prob.movedim(self.plate_dim, 0)
        return log_prob.reshape(log_prob.shape[0], -1).sum(-1)

    def _masks(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The observed value of the likelihood site ``name`` in the initial run (all data, in data order)
        and which of its batch entries are observed, ``[*batch_shape]`` bool (``poutine.mask``, ``obs_mask``
        and a ``MaskedDistribution`` combined)."""
        node = self.initial_trace.nodes[name]
        fn, value = node["fn"], node["value"]
        observed = torch.ones(fn.batch_shape, dtype=torch.bool, device=value.device)
        masks = [node["mask"]] + [
            layer._mask for layer in _layers(fn) if isinstance(layer, MaskedDistribution)
        ]
        for mask in masks:
            if mask is not None:
                observed = observed & torch.as_tensor(mask, device=value.device)
        return value, observed

    def _placeholders(self) -> dict[str, torch.Tensor]:
        """For each likelihood site whose masked-out observed entries are not all finite, the value of its
        first observed datum (a value in its support), ``[*event_shape]``."""
        placeholders = {}
        for name in self.likelihood_sites:
            event_dim = len(self.initial_trace.nodes[name]["fn"].event_shape)
            try:
                value, observed = self._masks(name)
            except RuntimeError:  # masks that do not broadcast to the batch shape: left as they are
                continue
            if observed.all() or value.shape[: value.dim() - event_dim] != observed.shape:
                continue
            finite = value.isfinite().reshape(*observed.shape, -1).all(-1)
            if bool((finite | observed).all()) or not bool((observed & finite).any()):
                continue
            datum = (observed & finite).flatten().nonzero()[0, 0]
            placeholders[name] = value.reshape(-1, *value.shape[value.dim() - event_dim :])[datum].detach()
        return placeholders

    def check_observed_support(self, owner: torch.Tensor | None = None) -> None:
        """Refuse observed values of the likelihood sites outside their distribution's support (a
        ``Bernoulli`` label 2), naming the site, the values, their data indices and the clients that hold
        them: the evaluations run with validation off (see the module's docstring), which would take them
        in silence. One vectorised check of the initial run's data; masked-out entries and NaN (refused by
        ``FederatedPotential.check_initial_points``, with the fix) are left
        out, as are supports that depend on the latent values (``Uniform(0, theta)``: not the data's fault).

        :param owner: ``[N]`` the client holding each datum (-1: not held here, not checked).
        """
        for name in self.likelihood_sites:
            fn = self.initial_trace.nodes[name]["fn"]
            event_dim = len(fn.event_shape)
            try:  # a support that cannot be checked, or values that do not broadcast (a factor): not checked
                support = fn.support
                if not _static(support) or fn.event_shape.numel() == 0:
                    continue
                value, observed = self._masks(name)
                nan = value.isnan().reshape(*value.shape[: value.dim() - event_dim], -1).any(-1)
                bad = ~support.check(value) & observed & ~nan
            except (NotImplementedError, RuntimeError, TypeError, ValueError):
                continue
            axis = bad.dim() + self.plate_dim
            if axis < 0 or bad.shape[axis] != self.num_data:
                continue
            if owner is not None:
                held = (owner >= 0).reshape((-1,) + (1,) * (-1 - self.plate_dim))
                bad = bad & held.to(bad.device)
            if not bool(bad.any()):
                continue
            positions = bad.nonzero()
            values = torch.broadcast_to(value, bad.shape + value.shape[value.dim() - event_dim :])
            shown = []
            for position in positions[:5].tolist():
                index = position[axis]
                client = "" if owner is None else f" (client {int(owner[index])})"
                shown.append(f"{values[tuple(position)].tolist()} at data index {index}{client}")
            more = f" and {len(positions) - 5} more" if len(positions) > 5 else ""
            raise ValueError(
                f"Observed site {name!r} has {len(positions)} value(s) outside the support of "
                f"{_distribution_name(fn)} ({str(support).removesuffix('()')}): {', '.join(shown)}{more}. "
                "pyro_fed evaluates the model with validation off, so they would count as they are: correct "
                "these data, or leave them out (obs_mask)."
            )

    # ------------------------------------------------------------ evaluation
    def run(self, values: dict[str, torch.Tensor], indices: torch.Tensor, *, observed: bool = True) -> Trace:
        """Trace the model at the constrained latent ``values``, with ``indices`` as the data plate's
        subsample, validation off (see the module's docstring).

        :param bool observed: ``False`` to sample the observed sites afresh (posterior predictive).
        """
        model = self.model if observed else poutine.uncondition(self.model)
        args, kwargs, data = self._evaluation_inputs(values, indices)
        with pyro.validation_enabled(False), self._full_size():
            return self._tracer(model, data).get_trace(*args, **kwargs)

    def _evaluation_inputs(self, values: dict[str, torch.Tensor], indices: torch.Tensor) -> tuple:
        """The model's arguments and the values to condition it on for a run at ``values`` on the data
        ``indices``: the indices injected into the plate; or, in the rows form, the rows of the data
        arguments and of the per-datum parameters at ``indices``, and the plate's positions ``0..n-1``."""
        args, kwargs = self.model_args, self.model_kwargs
        if self.rows is not None:
            args, kwargs = self.rows.select(args, kwargs, indices)
            rows = {name: values[name].index_select(axis, indices) for name, axis in self.row_latents.items()}
            values = {**values, **rows}
            indices = torch.arange(indices.shape[-1], device=indices.device)
        return args, kwargs, {**values, self.plate: indices}

    def _tracer(self, model: Callable, data: dict[str, torch.Tensor]) -> poutine.trace_messenger.TraceHandler:
        """A tracer of ``model`` conditioned on ``data``, with the messengers every evaluation runs under."""
        conditioned = poutine.condition(model, data=data)
        model = _FillMasked(self.placeholders)(_FixMissing(self.missing_sites)(conditioned))
        return poutine.trace(_ParamsAsConstants(self.params)(_WithoutValidation()(model)))

    def _full_size(self) -> contextlib.AbstractContextManager:
        return full_size_plate(self.plate) if self.full_size_subsample else contextlib.nullcontext()

    def prior_trace(self, values: dict[str, torch.Tensor]) -> Trace:
        """The model at the latent ``values`` with all its data, traced up to the data plate (the sites
        before it: the prior of the per-datum parameters too, without the likelihood's cost)."""
        tracer = self._tracer(_StopAtPlate(self.plate)(self.model), values)
        with pyro.validation_enabled(False), self._full_size(), contextlib.suppress(_PlateReached):
            tracer.get_trace(*self.model_args, **self.model_kwargs)
        return tracer.msngr.trace

    def global_log_density(self, trace: Trace, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of the log-densities of the global sites, latent and observed, at the latent ``values``:
        :math:`-U^0` but the log-det-Jacobian. Read from ``trace`` (a run of the model on a subsample),
        or, where the model has per-datum parameters that such a run reads in part (``row_latents``), from
        :meth:`prior_trace`."""
        if self.row_latents:
            trace = self.prior_trace(values)
        return sum(_log_density(trace.nodes[name]).sum() for name in self.latent_names + self.global_observed)

    def plate_axis(self, name: str) -> int | None:
        """The axis of the data plate in the observed value of site ``name`` (``None`` if the value is
        broadcast along it)."""
        node = self.initial_trace.nodes[name]
        axis = node["value"].dim() - len(node["fn"].event_shape) + self.plate_dim
        return axis if axis >= 0 and node["value"].shape[axis] == self.num_data else None

    def observed_mask(self, name: str) -> torch.Tensor | None:
        """For a likelihood site masked along the data plate only (``obs_mask``, ``poutine.mask`` with a
        per-datum mask): which of the ``N`` data it observes, ``[N]`` bool; ``None`` when nothing is masked
        or the mask varies within a datum."""
        node, axis = self.initial_trace.nodes[name], self.plate_axis(name)
        mask = node["mask"]
        if not isinstance(mask, torch.Tensor) or axis is None:
            return None
        mask = mask.expand(node["fn"].batch_shape).movedim(self.plate_dim, 0).reshape(self.num_data, -1)
        if not bool((mask == mask[:, :1]).all()) or bool(mask.all()):
            return None
        return mask[:, 0]

    def pointwise_log_prob(self, trace: Trace, name: str) -> torch.Tensor:
        """The plain ``log_prob`` of the likelihood site ``name`` (masked entries 0, no ``poutine.scale``
        factor), in the layout of the site's batch shape: ArviZ's convention for the log-likelihood."""
        node = trace.nodes[name]
        log_prob = scale_and_mask(node["fn"].log_prob(node["value"]), 1.0, node["mask"])
        return log_prob.expand(node["fn"].batch_shape)

    def datum_log_prob(self, trace: Trace, name: str, num_indices: int) -> torch.Tensor:
        """Log-density of the likelihood site ``name`` per datum of the subsample, ``[num_indices]``, with
        the site's own scale (``poutine.scale`` is part of the potential) but without the plate's
        ``N / num_indices`` (weights are the caller's)."""
        node = trace.nodes[name]
        # the plate scales by its declared size over |S| (N, or |S| for a plate sized from the rows of the
        # data arguments): undone here, the client weights N_i / n_i are applied by the caller
        lp = _log_density(node, num_indices / trace.nodes[self.plate]["fn"].size)
        lp = lp.expand(node["fn"].batch_shape).movedim(self.plate_dim, 0)
        return lp.reshape(num_indices, -1).sum(-1)


def _close(value: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    """Whether ``value`` equals ``expected`` to a relative ``tolerance`` of the larger entry's size."""
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    return value.shape == expected.shape and torch.allclose(
        value, expected.to(value.dtype), rtol=tolerance, atol=tolerance * max(scale, 1.0), equal_nan=True
    )


def _module_hint(plate: str) -> str:
    return (
        " A PyroModule samples a PyroSample weight where it is first read: read the weights before the "
        "plate, e.g. `weights = (self.linear.weight, self.linear.bias)` on the line before "
        f"`with pyro.plate({plate!r}, N):` (later reads in the plate reuse them)."
    )
