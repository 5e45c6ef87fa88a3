r"""Evaluation metrics of the federated Bayesian sampling papers.

**Predictive metrics** (FALD paper, Section 5, Tables 2 and 3). :func:`predictive_probabilities` gives the
posterior predictive class probabilities :math:`\hat p(c | x) = \frac1K \sum_k p(c | x, \theta_k)` of a
classifier on a test set; from them ``[N, C]`` and the test labels ``[N]``:

- :func:`accuracy`, :func:`expected_calibration_error`, :func:`brier_score`, :func:`negative_log_likelihood`;
- against the predictive of a reference sampler (e.g. long-run HMC): :func:`agreement` (same predicted
  class) and :func:`total_variation`.

**HPD level** (QLSD paper, Section 5). Given draws :math:`\theta_1, \dots, \theta_K` of a posterior
:math:`\pi \propto e^{-U}`, the HPD region of level :math:`1 - \alpha` is :math:`\{\theta : U(\theta) \le
\eta_\alpha\}` with :math:`\eta_\alpha` the :math:`(1 - \alpha)` quantile of :math:`U(\theta)` under
:math:`\pi`; its estimate is the empirical quantile of :math:`U(\theta_k)` (:func:`draw_potentials`,
:func:`hpd_level`), and two samplers are compared by the relative error
:math:`|\eta_\alpha - \eta_\alpha^{ref}| / |\eta_\alpha^{ref}|` (:func:`relative_hpd_error`).

**Wasserstein-2 distance** (D-ULA paper, Section 5) between the draws and reference draws:
:func:`wasserstein2`.

Draws are given as ``{site: [K, ...]}`` (``mcmc.get_samples()``) or as ArviZ data (the ``posterior`` group
of an :class:`arviz.InferenceData` or of the :class:`xarray.DataTree` of ArviZ 1.x; chains are stacked).

**References:**

- Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a unified theory and new
  algorithms*, AISTATS 2023, Section 5.
- Vono, Plassier, Durmus, Dieuleveut, Moulines, *QLSD: Quantised Langevin stochastic dynamics for Bayesian
  federated learning*, AISTATS 2022, Section 5.
- Parayil, Bai, George, Gurram, *Decentralized Langevin dynamics for Bayesian learning*, NeurIPS 2020,
  Section 5.
- Guo, Pleiss, Sun, Weinberger, *On calibration of modern neural networks*, ICML 2017, Section 2 (ECE).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.runtime import NonlocalExit
from pyro.poutine.util import site_is_factor, site_is_subsample

from ..model.potential import FederatedPotential
from ..model.predictive import map_draw_chunks

if TYPE_CHECKING:
    import arviz as az
    import xarray as xr

    Draws = Mapping[str, torch.Tensor] | az.InferenceData | xr.DataTree


def _posterior_draws(
    samples: Draws, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """``{site: [K, ...]}`` from a dict of draws or from ArviZ data (chains stacked, chain-major), with the
    floating-point draws moved to ``dtype`` and ``device`` (those of the model they are fed to: ArviZ stores
    numpy arrays, often float64, on the CPU)."""
    posterior = getattr(samples, "posterior", None)
    if posterior is not None:  # InferenceData, or the DataTree of ArviZ 1.x: duck-typed, no arviz import
        arrays = {
            name: var.transpose("chain", "draw", ...).to_numpy() for name, var in posterior.data_vars.items()
        }
        samples = {name: a.reshape(-1, *a.shape[2:]) for name, a in arrays.items()}
    elif not isinstance(samples, Mapping):
        raise TypeError(
            "samples must be a dict {site: [K, ...]} (as mcmc.get_samples() gives) or ArviZ data with a "
            f"posterior group; got {type(samples).__name__}."
        )
    draws = {name: torch.as_tensor(value) for name, value in samples.items()}
    if not draws:
        raise ValueError("samples holds no draws: it has no site.")
    shapes = {name: tuple(v.shape) for name, v in draws.items()}
    if any(len(s) == 0 for s in shapes.values()) or len({s[0] for s in shapes.values()}) != 1:
        raise ValueError(
            f"every site of samples needs the same leading number of draws K; got shapes {shapes}. "
            "Pass draws as {site: [K, ...]} (mcmc.get_samples() without group_by_chain)."
        )
    return {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v for k, v in draws.items()}


def _as_draw_matrix(samples: torch.Tensor | np.ndarray | Draws) -> torch.Tensor:
    """``[K, d]`` float64 on the CPU: a tensor ``[K]`` (d = 1) or ``[K, ...]`` flattened per draw, or every
    site of a dict / ArviZ posterior flattened and concatenated in sorted order of the site names."""
    if isinstance(samples, (torch.Tensor, np.ndarray)):
        draws = {"": torch.as_tensor(samples).to(device="cpu", dtype=torch.float64)}
        if draws[""].dim() == 0:
            raise ValueError("draws need a leading dimension K of draws; got a scalar.")
    else:
        draws = _posterior_draws(samples, torch.float64, "cpu")
    num_draws = next(iter(draws.values())).shape[0]
    return torch.cat([draws[name].reshape(num_draws, -1).double() for name in sorted(draws)], 1)


def draw_potentials(potential: FederatedPotential, samples: Draws) -> torch.Tensor:
    r""":math:`U(\theta_k)` of every draw: the full-data potential, prior and Jacobian included, in the
    unconstrained space where the samplers run.

    :param potential: the model's :class:`~pyro_fed.FederatedPotential` (``kernel.potential`` after a run).
    :param samples: constrained draws ``{site: [K, ...]}``, as ``mcmc.get_samples()`` gives them, or ArviZ
        data whose ``posterior`` group holds them.
    :returns: ``[K]``.
    """
    transforms = potential.transforms
    draws = _posterior_draws(samples, potential.dtype, potential.device)
    unconstrained = {name: transforms[name](value) for name, value in draws.items() if name in transforms}
    return potential.total_potentials(potential.flatten(unconstrained))


def hpd_level(potentials: torch.Tensor, alpha: float = 0.05) -> float:
    r""":math:`\eta_\alpha`: the empirical :math:`(1 - \alpha)` quantile of the draws' potentials ``[K]``."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1); got {alpha!r}.")
    return float(torch.quantile(potentials.double(), 1 - alpha))


def relative_hpd_error(level: float, reference: float) -> float:
    r""":math:`|\eta_\alpha - \eta_\alpha^{ref}| / |\eta_\alpha^{ref}|`."""
    return abs(level - reference) / abs(reference)


# ---------------------------------------------------------------------------------------------------------
# posterior predictive class probabilities


def _test_site(model: Callable, draw: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> str:
    """The one sample site of the model without draws: the observed site, unobserved on the test set."""
    # this run samples the test site: fork the RNG so that the metric leaves the global random stream alone
    with torch.random.fork_rng(), torch.no_grad():
        trace = poutine.trace(poutine.condition(model, draw)).get_trace(*args, **kwargs)
    candidates = [
        name
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and name not in draw
        and not site_is_subsample(site)
        and not site_is_factor(site)
        and not site["infer"].get("_deterministic")
    ]
    if len(candidates) != 1:
        raise ValueError(
            f"site=None needs exactly one sample site of the model without draws (the observed site); "
            f"found {candidates} (draws are given for {sorted(draw)}). Pass site='name' of the observed "
            "site, and draws for every latent site."
        )
    return candidates[0]


_WRAPPERS = (torch.distributions.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)


def _class_probabilities(fn: torch.distributions.Distribution, site: str) -> torch.Tensor:
    """``[N, C]``: the class probabilities of a Bernoulli, Categorical or OneHotCategorical site, whose
    elements (batch and event, flattened in row-major order) are the test points."""
    shape = fn.shape()  # the site's shape, before unwrapping its `.to_event`, `.mask`, `.expand` wrappers
    while isinstance(fn, _WRAPPERS):
        fn = fn.base_dist
    if isinstance(fn, torch.distributions.Bernoulli):
        if "logits" in vars(fn):  # built from logits: sigmoid(-l) keeps the precision 1 - sigmoid(l) loses
            probs = torch.stack([torch.sigmoid(-fn.logits), torch.sigmoid(fn.logits)], -1)
        else:
            probs = torch.stack([1 - fn.probs, fn.probs], -1)
        probs = probs.expand(*shape, 2)
    elif isinstance(fn, torch.distributions.Categorical):
        probs = fn.probs.expand(*shape, fn.probs.shape[-1])
    elif isinstance(fn, torch.distributions.OneHotCategorical):
        probs = fn.probs.expand(shape)
    else:
        raise TypeError(
            f"site {site!r} has a {type(fn).__name__} distribution; predictive_probabilities needs a "
            "Bernoulli, Categorical or OneHotCategorical observed site."
        )
    return probs.reshape(-1, probs.shape[-1])


def predictive_probabilities(
    model: Callable,
    samples: Draws,
    *args,
    site: str | None = None,
    chunk_size: int | None = None,
    **kwargs,
) -> torch.Tensor:
    r"""Posterior predictive class probabilities of a classifier on test inputs,

    .. math:: \hat p(c | x_n) = \frac1K \sum_{k=1}^K p(c | x_n, \theta_k),

    the quantity that the predictive metrics of the FALD paper (Section 5) score.

    The model runs conditioned on each draw (vectorised over draws with :func:`torch.func.vmap`, draw by
    draw for models vmap cannot run) and stops at the observed site, whose distribution gives
    :math:`p(\cdot | x_n, \theta_k)`: ``Bernoulli`` (columns :math:`1 - p, p`), ``Categorical`` or
    ``OneHotCategorical``, possibly inside ``.to_event``, ``.mask`` or ``.expand``. The global random
    stream is left as it was.

    **Reference:** Plassier et al., *Federated Averaging Langevin Dynamics: Toward a unified theory and new
    algorithms*, AISTATS 2023, Section 5.

    :param model: the Pyro model.
    :param samples: draws ``{site: [K, ...]}`` of every latent site (``mcmc.get_samples()``), or ArviZ data
        whose ``posterior`` group holds them; floating-point draws are moved to the dtype and device of the
        first floating-point tensor among the test inputs.
    :param args: the model's test inputs, e.g. ``x_test``; the observed values may be left out (``None``)
        or given (they do not change the probabilities; a model that reads them through
        ``pyro.subsample(y, ...)`` needs them).
    :param str site: the observed site; by default the model's only sample site without draws.
    :param int chunk_size: number of draws evaluated at once (by default about ``2**22 / (N C)``).
    :param kwargs: the model's keyword test inputs.
    :returns: ``[N, C]``, in float64, the ``N`` test points being the site's elements in row-major order.
    """
    like = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.is_floating_point()), None)
    draws = _posterior_draws(samples, *((like.dtype, like.device) if like is not None else ()))
    num_draws = next(iter(draws.values())).shape[0]
    if site is None:
        site = _test_site(model, {k: v[0] for k, v in draws.items()}, args, kwargs)
    elif site in draws:
        raise ValueError(f"site={site!r} is a latent site with draws; name the model's observed site.")

    def one_draw(draw: dict[str, torch.Tensor]) -> torch.Tensor:
        try:  # escape stops the model at the site, before it samples (the test set has no observations)
            poutine.escape(poutine.condition(model, draw), lambda msg: msg["name"] == site)(*args, **kwargs)
        except NonlocalExit as stop:
            stop.reset_stack()
            return _class_probabilities(stop.site["fn"], site)
        raise ValueError(f"site {site!r} is not a sample site of the model run on the test inputs.")

    with torch.no_grad(), pyro.validation_enabled(False):  # validation checks values, which vmap forbids
        first = one_draw({k: v[0] for k, v in draws.items()})  # unvectorised: clear errors, output size
        # float64 sums keep the small probabilities that the NLL needs; MPS has no float64
        dtype = first.dtype if first.device.type == "mps" else torch.float64
        total = torch.zeros(first.shape, dtype=dtype, device=first.device)
        chunk_size = chunk_size or max(1, 2**22 // first.numel())
        # a running sum over chunks (not all K x N x C outputs); vmap cannot run every model (`.item()`,
        # Python branching on a latent value): any vmap error falls back to draw by draw (nothing samples)
        for chunk in map_draw_chunks(
            lambda draw: {"probs": one_draw(draw)}, draws, chunk_size, falls_back=lambda error: True
        ):
            total += chunk["probs"].sum(0, dtype=total.dtype)
    return total / num_draws


# ---------------------------------------------------------------------------------------------------------
# metrics of predictive probabilities [N, C]


def _check_probs(probs: torch.Tensor, argument: str = "probs") -> torch.Tensor:
    probs = torch.as_tensor(probs)
    if probs.dim() != 2 or not probs.is_floating_point():
        raise ValueError(
            f"{argument} must be a floating-point [N, C] tensor of class probabilities, one row per test "
            f"point; got {probs.dtype} of shape {tuple(probs.shape)}. For a binary model with p = P(y = 1) "
            "pass torch.stack([1 - p, p], -1)."
        )
    return probs


def _check_pair(probs: torch.Tensor, reference_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs, reference_probs = _check_probs(probs), _check_probs(reference_probs, "reference_probs")
    if probs.shape != reference_probs.shape:
        raise ValueError(
            f"probs {tuple(probs.shape)} and reference_probs {tuple(reference_probs.shape)} must have the "
            "same shape [N, C]: the predictives of two samplers on the same test points."
        )
    return probs, reference_probs


def _check_labels(probs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs = _check_probs(probs)
    labels = torch.as_tensor(labels, device=probs.device)
    n, c = probs.shape
    if labels.shape != (n,):
        raise ValueError(
            f"labels must have shape [N] = ({n},), one class index per row of probs; got "
            f"{tuple(labels.shape)}. Flatten them to match probs' rows."
        )
    if labels.is_floating_point() and not torch.equal(labels, labels.round()):
        raise ValueError("labels must be class indices; the floating-point labels given are not integers.")
    labels = labels.long()  # bool and float 0/1 labels of a binary model become class indices
    if n and not 0 <= int(labels.min()) <= int(labels.max()) < c:
        raise ValueError(f"labels must be in {{0, ..., {c - 1}}} for C = {c} classes; got {labels.unique()}.")
    return probs, labels


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    r"""Accuracy of the predicted classes, :math:`\frac1N \sum_n 1[\arg\max_c \hat p(c | x_n) = y_n]`
    (ties go to the lowest class index). FALD paper, Section 5.

    :param probs: predictive probabilities ``[N, C]``.
    :param labels: classes ``[N]`` (integer, or bool / float 0-1 for a binary model).
    """
    probs, labels = _check_labels(probs, labels)
    return float((probs.argmax(-1) == labels).double().mean())


def agreement(probs: torch.Tensor, reference_probs: torch.Tensor) -> float:
    r"""Fraction of test points where the predicted classes of two predictives agree,
    :math:`\frac1N \sum_n 1[\arg\max_c p(c | x_n) = \arg\max_c q(c | x_n)]`, ``q`` being the reference
    (e.g. HMC). FALD paper, Section 5.

    :param probs: predictive probabilities ``[N, C]``.
    :param reference_probs: the reference predictive probabilities ``[N, C]``.
    """
    probs, reference_probs = _check_pair(probs, reference_probs)
    return float((probs.argmax(-1) == reference_probs.argmax(-1)).double().mean())


def total_variation(probs: torch.Tensor, reference_probs: torch.Tensor) -> float:
    r"""Mean total variation distance to a reference predictive,
    :math:`\frac1N \sum_n \frac12 \sum_c |p(c | x_n) - q(c | x_n)|`. FALD paper, Section 5.

    :param probs: predictive probabilities ``[N, C]``.
    :param reference_probs: the reference predictive probabilities ``[N, C]``.
    """
    probs, reference_probs = _check_pair(probs, reference_probs)
    return float(0.5 * (probs.double() - reference_probs.double()).abs().sum(-1).mean())


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = 20) -> float:
    r"""Expected calibration error (Guo et al., 2017) with ``M = bins`` equal-width confidence bins,

    .. math:: \mathrm{ECE} = \sum_{m=1}^M \frac{|B_m|}N \, |\mathrm{acc}(B_m) - \mathrm{conf}(B_m)|,

    where the confidence of a point is :math:`\max_c \hat p(c | x_n)`, :math:`B_m` holds the points whose
    confidence lies in the **right-closed** bin :math:`((m - 1)/M, m/M]` (as Guo et al.: a confidence
    exactly on an edge :math:`m/M` belongs to bin :math:`m`), and :math:`\mathrm{acc}`,
    :math:`\mathrm{conf}` are the bin's accuracy and mean confidence; empty bins count 0.
    FALD paper, Section 5.

    :param probs: predictive probabilities ``[N, C]``.
    :param labels: classes ``[N]``.
    :param int bins: number ``M`` of bins.
    """
    probs, labels = _check_labels(probs, labels)
    if bins < 1:
        raise ValueError(f"bins must be a positive integer; got {bins!r}.")
    confidence, predicted = probs.double().max(-1)
    # edges m/M by one division each, so that a confidence written as a decimal lands on them exactly
    edges = torch.arange(1, bins + 1, dtype=torch.float64, device=probs.device) / bins
    # right=False: bin i holds edges[i-1] < confidence <= edges[i]; clamp: sums of probs may round above 1
    index = torch.bucketize(confidence, edges, right=False).clamp(max=bins - 1)
    correct = (predicted == labels).double()
    # |B_m|/N |acc(B_m) - conf(B_m)| = |sum_{B_m} correct - sum_{B_m} confidence| / N: no empty-bin division
    gap = torch.zeros(bins, dtype=torch.float64, device=probs.device)
    gap.index_add_(0, index, correct - confidence)
    return float(gap.abs().sum() / len(labels))


def brier_score(probs: torch.Tensor, labels: torch.Tensor) -> float:
    r"""Multi-class Brier score, :math:`\frac1N \sum_n \sum_c (\hat p(c | x_n) - 1[c = y_n])^2`, in
    :math:`[0, 2]`; the FALD paper's form (Section 5). For a binary model it is twice the one-column form
    :math:`\frac1N \sum_n (\hat p(1 | x_n) - y_n)^2`.

    :param probs: predictive probabilities ``[N, C]``.
    :param labels: classes ``[N]``.
    """
    probs, labels = _check_labels(probs, labels)
    one_hot = torch.nn.functional.one_hot(labels, probs.shape[1]).double()
    return float((probs.double() - one_hot).square().sum(-1).mean())


def negative_log_likelihood(probs: torch.Tensor, labels: torch.Tensor) -> float:
    r"""Mean negative log predictive likelihood of the test labels, :math:`-\frac1N \sum_n \log \hat p(y_n |
    x_n)`. FALD paper, Section 5.

    No clamping: a label of predictive probability 0 gives ``inf``. A clamp at some :math:`\epsilon` would
    make the score of a confidently wrong sampler whatever :math:`\log \epsilon` is chosen to be, and hide
    that the predictive excludes an observed label; :func:`predictive_probabilities` returns float64 sums,
    so a 0 only appears when every draw underflows in the model's own dtype.

    :param probs: predictive probabilities ``[N, C]``.
    :param labels: classes ``[N]``.
    """
    probs, labels = _check_labels(probs, labels)
    return float(-probs.double().gather(-1, labels[:, None]).log().mean())


# ---------------------------------------------------------------------------------------------------------
# Wasserstein-2


def _w2_squared_1d(x: np.ndarray, y: np.ndarray) -> float:
    """Exact squared W2 of two 1-D empirical measures, any sizes: the integral over u in (0, 1) of the
    squared gap between their quantile functions, which are step functions jumping at u = i/K and j/M."""
    x, y = np.sort(x), np.sort(y)
    jumps = np.unique(np.concatenate([np.arange(1, len(x) + 1) / len(x), np.arange(1, len(y) + 1) / len(y)]))
    widths = np.diff(jumps, prepend=0.0)
    # the middle of each interval, away from the jumps, where floor(u K) is the quantile index of x
    middles = jumps - widths / 2
    ix = np.minimum((middles * len(x)).astype(np.int64), len(x) - 1)
    iy = np.minimum((middles * len(y)).astype(np.int64), len(y) - 1)
    return float(np.sum(widths * (x[ix] - y[iy]) ** 2))


def wasserstein2(
    samples: torch.Tensor | np.ndarray | Draws, reference: torch.Tensor | np.ndarray | Draws
) -> float:
    r"""Wasserstein-2 distance between the empirical measures of two clouds of draws,

    .. math:: W_2 = \Big(\min_{\gamma \in \Gamma(\mu_K, \nu_M)} \sum_{i,j} \gamma_{ij}
        \|x_i - y_j\|^2\Big)^{1/2}, \quad \mu_K = \frac1K \sum_i \delta_{x_i}, \
        \nu_M = \frac1M \sum_j \delta_{y_j},

    computed exactly: for ``d = 1`` by the quantile (sorted) coupling, any ``K`` and ``M``; for ``K = M`` by
    an optimal assignment (with equal uniform weights an optimal plan is a permutation, Birkhoff's theorem;
    :func:`scipy.optimize.linear_sum_assignment`, :math:`O(K^3)` time, :math:`K^2` memory); otherwise by
    POT's network simplex (``ot.emd2``), which needs ``pip install pot``. D-ULA paper, Section 5.

    **Reference:** Parayil, Bai, George, Gurram, *Decentralized Langevin dynamics for Bayesian
    learning*, NeurIPS 2020, Section 5.

    :param samples: ``[K, d]`` draws (``[K]``: d = 1), or ``{site: [K, ...]}`` / ArviZ data, every site
        flattened and concatenated in sorted order of the names.
    :param reference: ``[M, d]`` reference draws, in the same form.
    """
    x, y = _as_draw_matrix(samples).numpy(), _as_draw_matrix(reference).numpy()
    if x.shape[1] != y.shape[1]:
        raise ValueError(
            f"samples and reference must have the same dimension d per draw; got {x.shape[1]} and "
            f"{y.shape[1]} (as [K, d] {x.shape} and [M, d] {y.shape})."
        )
    if x.shape[1] == 1:
        return math.sqrt(max(_w2_squared_1d(x[:, 0], y[:, 0]), 0.0))
    from scipy.spatial.distance import cdist  # lazily: scipy comes with arviz, but is slow to import

    cost = cdist(x, y, "sqeuclidean")
    if len(x) == len(y):
        from scipy.optimize import linear_sum_assignment

        rows, cols = linear_sum_assignment(cost)
        return math.sqrt(cost[rows, cols].mean())
    try:
        import ot
    except ImportError as error:
        raise ImportError(
            f"wasserstein2 between clouds of different sizes ({len(x)} and {len(y)} draws) in d = "
            f"{x.shape[1]} needs POT: pip install pot. Or subsample both clouds to the same size, where the "
            "exact assignment needs only scipy."
        ) from error
    return math.sqrt(max(float(ot.emd2(ot.unif(len(x)), ot.unif(len(y)), cost)), 0.0))
