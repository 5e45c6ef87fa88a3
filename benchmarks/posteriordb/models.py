r"""posteriordb posteriors written in Pyro as their Stan programs are written.

Each Stan program's ``transformed data`` block becomes a ``prepare`` function (raw posteriordb data, a
``dict`` of lists, to the model's tensors: data-wide statistics such as a mean or an sd are taken over the
whole data set, as Stan takes them, so they are data, not something a client computes on its share), and
its ``model`` block a Pyro model whose data-point terms sit in ``pyro.plate("data", N)`` and read the data
through :func:`pyro.subsample` (:func:`read`; :func:`written_for_nuts` gives each model as a NUTS user writes
it, the data read at full size). Rules of the translation:

- a parameter with no prior statement has Stan's implicit flat prior on its constrained support:
  :class:`~pyro.distributions.ImproperUniform` with that support (``<lower=0>``:
  :data:`~torch.distributions.constraints.positive`; ``ordered``: ``ordered_vector``);
- a prior statement on a bounded parameter is the distribution truncated to the bound, which differs from
  Pyro's half distributions by a constant only (``sigma ~ cauchy(0, 2.5)`` with ``<lower=0>`` is
  ``HalfCauchy(2.5)``);
- a prior on a parameter whose support no Pyro distribution of that family has (``ordered[2] mu ~
  normal(0, 2)``) is written as a flat prior on the support plus a :func:`pyro.factor` with the density.

Pyro sites carry the Stan parameters' names, so that Stan's ``beta[2]`` is element 1 of the site ``beta``
(:func:`stan_site`). The registry :data:`POSTERIORS` gives, per posterior, its data set, the data fields
the program reads, the preparation and the model.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints

__all__ = ["POSTERIORS", "Posterior", "stan_site", "written_for_nuts"]


# ---------------------------------------------------------------------------------------------- models
def read(data: torch.Tensor, event_dim: int) -> torch.Tensor:
    """A data-point term's data, read through the data plate's indices (:func:`pyro.subsample`); the data
    at full size in the copies :func:`written_for_nuts` makes."""
    return pyro.subsample(data, event_dim=event_dim)


def written_for_nuts(model: Callable) -> Callable:
    """``model`` as a NUTS user writes it, the Stan program's shape: the same code, its data read at full
    size (:func:`read` the identity), so that pyro_fed runs it on each client's rows of its arguments."""
    full_size = {**model.__globals__, "read": lambda data, event_dim: data}
    code, name = model.__code__, model.__name__
    copy = types.FunctionType(code, full_size, name, model.__defaults__, model.__closure__)
    copy.__doc__ = model.__doc__
    return copy


def _flat(name: str, support, shape: tuple[int, ...] = ()) -> torch.Tensor:
    """Stan's implicit flat prior on ``support``: an improper uniform over the whole support, with the
    parameter's shape as its event shape."""
    return pyro.sample(name, dist.ImproperUniform(support, (), shape))


def linear_flat(x: torch.Tensor, y: torch.Tensor) -> None:
    """``y ~ normal(x * beta, sigma)``, ``beta`` and ``sigma`` flat (no prior statement); ``x`` holds the
    intercept column and the program's predictors in its order."""
    beta = _flat("beta", constraints.real, (x.shape[-1],))
    sigma = _flat("sigma", constraints.positive)
    with pyro.plate("data", x.shape[0]):
        mu = read(x, event_dim=1) @ beta
        pyro.sample("y", dist.Normal(mu, sigma), obs=read(y, event_dim=0))


def linear_cauchy(x: torch.Tensor, y: torch.Tensor) -> None:
    """``y ~ normal(x * beta, sigma)``, ``beta`` flat, ``sigma ~ cauchy(0, 2.5)`` on ``<lower=0>``."""
    beta = _flat("beta", constraints.real, (x.shape[-1],))
    sigma = pyro.sample("sigma", dist.HalfCauchy(2.5))
    with pyro.plate("data", x.shape[0]):
        mu = read(x, event_dim=1) @ beta
        pyro.sample("y", dist.Normal(mu, sigma), obs=read(y, event_dim=0))


def kilpisjarvi(x: torch.Tensor, y: torch.Tensor, prior: torch.Tensor) -> None:
    """``alpha ~ normal(pmualpha, psalpha)``, ``beta ~ normal(pmubeta, psbeta)``, ``sigma`` flat on
    ``<lower=0>``, ``y ~ normal(alpha + beta * x, sigma)``; ``prior`` holds the four prior constants of
    the data, in that order. ``x`` is the year, uncentred, as in the program: the posterior of ``alpha``
    and ``beta`` is correlated almost to one."""
    alpha = pyro.sample("alpha", dist.Normal(prior[0], prior[1]))
    beta = pyro.sample("beta", dist.Normal(prior[2], prior[3]))
    sigma = _flat("sigma", constraints.positive)
    with pyro.plate("data", x.shape[0]):
        mu = alpha + beta * read(x, event_dim=0)
        pyro.sample("y", dist.Normal(mu, sigma), obs=read(y, event_dim=0))


def ar_k(lags: torch.Tensor, y: torch.Tensor) -> None:
    """AR(K): ``y[t] ~ normal(alpha + sum_k beta[k] * y[t - k], sigma)`` for ``t = K + 1 .. T``, with
    ``alpha ~ normal(0, 10)``, ``beta ~ normal(0, 10)``, ``sigma ~ cauchy(0, 2.5)`` on ``<lower=0>``.
    The likelihood is a sum over ``t`` of terms that read only data, so the lagged values are a design
    matrix ``lags[t, k] = y[t - k]`` (data), and the plate runs over ``t``."""
    alpha = pyro.sample("alpha", dist.Normal(0.0, 10.0))
    beta = pyro.sample("beta", dist.Normal(0.0, 10.0).expand([lags.shape[-1]]).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfCauchy(2.5))
    with pyro.plate("data", y.shape[0]):
        mu = alpha + read(lags, event_dim=1) @ beta
        pyro.sample("y", dist.Normal(mu, sigma), obs=read(y, event_dim=0))


def low_dim_gauss_mix(y: torch.Tensor) -> None:
    """Two normals mixed with weight ``theta``: ``ordered[2] mu ~ normal(0, 2)``, ``sigma ~ normal(0, 2)``
    on ``<lower=0>``, ``theta ~ beta(5, 5)``, each ``y[n]`` adding ``log_mix(theta, normal_lpdf(y[n] |
    mu[1], sigma[1]), normal_lpdf(y[n] | mu[2], sigma[2]))``: a mixture observed per data point."""
    mu = _flat("mu", constraints.ordered_vector, (2,))
    # the normal prior of an ordered vector: no Pyro normal has that support, so its density is a factor
    pyro.factor("mu_prior", dist.Normal(0.0, 2.0).log_prob(mu).sum(-1))
    sigma = pyro.sample("sigma", dist.HalfNormal(2.0).expand([2]).to_event(1))
    theta = pyro.sample("theta", dist.Beta(5.0, 5.0))
    weights = torch.stack([theta, 1.0 - theta], -1)
    with pyro.plate("data", y.shape[0]):
        mixture = dist.MixtureSameFamily(dist.Categorical(probs=weights), dist.Normal(mu, sigma))
        pyro.sample("y", mixture, obs=read(y, event_dim=0))


def eight_schools_noncentered(y: torch.Tensor, sigma: torch.Tensor) -> None:
    """Eight schools, non-centred: ``theta_trans ~ normal(0, 1)`` (one per school), ``mu ~ normal(0, 5)``,
    ``tau ~ cauchy(0, 5)`` on ``<lower=0>``, ``y ~ normal(mu + tau * theta_trans, sigma)`` with the schools'
    standard errors ``sigma`` as data. Each data point (a school) reads its own ``theta_trans``: a latent
    effect per point, a global site indexed by the plate (a client holds its schools' effects' likelihood,
    the prior of every effect is split over the clients as any prior is). Stan's transformed parameter
    ``theta = theta_trans * tau + mu`` is :func:`eight_schools_theta`."""
    theta_trans = pyro.sample("theta_trans", dist.Normal(0.0, 1.0).expand([y.shape[0]]).to_event(1))
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("data", y.shape[0]) as school:
        theta = theta_trans[school] * tau + mu
        pyro.sample("y", dist.Normal(theta, read(sigma, event_dim=0)), obs=read(y, event_dim=0))


def eight_schools_theta(samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stan's ``transformed parameters`` of eight schools from the draws:
    ``theta = theta_trans * tau + mu``."""
    return {"theta": samples["theta_trans"] * samples["tau"][..., None] + samples["mu"][..., None]}


def blr(x: torch.Tensor, y: torch.Tensor) -> None:
    """``beta ~ normal(0, 10)``, ``sigma ~ normal(0, 10)`` on ``<lower=0>``, ``y ~ normal(X * beta,
    sigma)`` (the program adds the three densities to ``target``)."""
    beta = pyro.sample("beta", dist.Normal(0.0, 10.0).expand([x.shape[-1]]).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(10.0))
    with pyro.plate("data", x.shape[0]):
        mu = read(x, event_dim=1) @ beta
        pyro.sample("y", dist.Normal(mu, sigma), obs=read(y, event_dim=0))


def diamonds(x: torch.Tensor, y: torch.Tensor) -> None:
    """brms's linear regression on centred predictors: ``y ~ normal(Intercept + Xc * b, sigma)``, ``b ~
    normal(0, 1)``, ``Intercept ~ student_t(3, 8, 10)``, ``sigma ~ student_t(3, 0, 10)`` on ``<lower=0>``
    (a folded Student t: the truncation's constant aside, the same density). ``x`` is ``Xc``, the design
    without its intercept column, each column less its mean (transformed data). Its 24 predictors (``carat
    * (log(x) + log(y) + log(z)) + cut + color + clarity``: interactions and contrasts) are highly correlated,
    and so is the posterior of ``b``."""
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    intercept = pyro.sample("Intercept", dist.StudentT(3.0, 8.0, 10.0))
    sigma = pyro.sample("sigma", dist.FoldedDistribution(dist.StudentT(3.0, 0.0, 10.0)))
    with pyro.plate("data", x.shape[0]):
        mu = intercept + read(x, event_dim=1) @ b
        pyro.sample("y", dist.Normal(mu, sigma), obs=read(y, event_dim=0))


# -------------------------------------------------------------------------------- transformed data
def _columns(*columns) -> np.ndarray:
    """A design matrix: an intercept column, then ``columns`` (Stan's ``beta[1] + beta[2] * c1 + ...``)."""
    n = len(columns[0])
    return np.column_stack([np.ones(n), *columns])


def _sd(v: np.ndarray) -> float:
    """Stan's ``sd``: the sample standard deviation (denominator ``N - 1``)."""
    return float(np.std(v, ddof=1))


def _design(columns: Callable[[dict], tuple], response: Callable[[dict], np.ndarray]):
    """``prepare`` of a linear regression: ``(x, y)`` with ``x = [1, *columns(data)]``."""

    def prepare(data: dict) -> tuple[np.ndarray, ...]:
        d = {k: np.asarray(v, dtype=np.float64) for k, v in data.items()}
        return _columns(*columns(d)), response(d)

    return prepare


def _kidiq_interaction_c(d):
    hs, iq = d["mom_hs"] - d["mom_hs"].mean(), d["mom_iq"] - d["mom_iq"].mean()
    return hs, iq, hs * iq


def _kidiq_interaction_c2(d):
    hs, iq = d["mom_hs"] - 0.5, d["mom_iq"] - 100.0
    return hs, iq, hs * iq


def _kidiq_interaction_z(d):
    hs = (d["mom_hs"] - d["mom_hs"].mean()) / (2 * _sd(d["mom_hs"]))
    iq = (d["mom_iq"] - d["mom_iq"].mean()) / (2 * _sd(d["mom_iq"]))
    return hs, iq, hs * iq


def _mom_work(d):
    work = d["mom_work"]
    return (work == 2).astype(float), (work == 3).astype(float), (work == 4).astype(float)


def _earnings_interaction_z(d):
    z = (d["height"] - d["height"].mean()) / _sd(d["height"])
    return z, d["male"], z * d["male"]


def _mesquite_logvash(d):
    return (
        np.log(d["diam1"] * d["diam2"] * d["canopy_height"]),
        np.log(d["diam1"] * d["diam2"]),
        np.log(d["diam1"] / d["diam2"]),
        np.log(d["total_height"]),
        d["group"],
    )


def _nes(d):
    age = d["age_discrete"]
    return (
        d["real_ideo"],
        d["race_adj"],
        (age == 2).astype(float),
        (age == 3).astype(float),
        (age == 4).astype(float),
        d["educ1"],
        d["gender"],
        d["income"],
    )


def _prepare_kilpisjarvi(data: dict) -> tuple[np.ndarray, ...]:
    prior = [data[k] for k in ("pmualpha", "psalpha", "pmubeta", "psbeta")]
    return np.asarray(data["x"], float), np.asarray(data["y"], float), np.asarray(prior, float)


def _prepare_ar_k(data: dict) -> tuple[np.ndarray, ...]:
    y, k = np.asarray(data["y"], float), int(data["K"])
    t = np.arange(k, len(y))  # Stan's t = K + 1 .. T, 0-based
    lags = np.stack([y[t - j] for j in range(1, k + 1)], axis=1)  # lags[:, j - 1] = y[t - j]
    return lags, y[t]


def _prepare_blr(data: dict) -> tuple[np.ndarray, ...]:
    return np.asarray(data["X"], float), np.asarray(data["y"], float)


# ------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Posterior:
    """One posteriordb posterior: ``<data_name>-<stan_model>``."""

    #: posteriordb's data set name (``kidiq``)
    data_name: str
    #: posteriordb's model name (the Stan program's file name, ``kidscore_momhs``)
    stan_model: str
    #: the data fields the program reads (those shipped)
    fields: tuple[str, ...]
    #: the program's ``transformed data``: the raw data (a dict of lists) to the model's arrays
    prepare: Callable[[dict], tuple[np.ndarray, ...]]
    #: the Pyro model, called with the prepared arrays as tensors
    model: Callable
    #: the program's ``transformed parameters``: the draws (``{site: tensor}``) to the extra Stan parameters
    #: the reference has (``None``: it has none)
    transformed: Callable[[dict], dict] | None = None

    @property
    def name(self) -> str:
        return f"{self.data_name}-{self.stan_model}"

    def tensors(self, data: dict, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        """The model's arguments from the raw data, in ``dtype``."""
        return tuple(torch.as_tensor(a, dtype=dtype) for a in self.prepare(data))


def _prepare_diamonds(data: dict) -> tuple[np.ndarray, ...]:
    """``(Xc, Y)``: the design's columns but the first (the intercept), each less its mean."""
    x = np.asarray(data["X"], dtype=np.float64)[:, 1:]
    return x - x.mean(0), np.asarray(data["Y"], dtype=np.float64)


def _log(field):
    return lambda d: np.log(d[field])


_KIDIQ = ("kid_score", "mom_hs", "mom_iq")
_EARN = ("earn", "height", "male")
_MESQ = ("weight", "diam1", "diam2", "canopy_height", "total_height", "density", "group")
_NES = ("partyid7", "real_ideo", "race_adj", "educ1", "gender", "income", "age_discrete")
_KIDS = lambda d: d["kid_score"]  # noqa: E731 (a one-line response, like the others)

_ENTRIES = [
    Posterior("kidiq", "kidscore_momhs", _KIDIQ, _design(lambda d: (d["mom_hs"],), _KIDS), linear_cauchy),
    Posterior("kidiq", "kidscore_momiq", _KIDIQ, _design(lambda d: (d["mom_iq"],), _KIDS), linear_cauchy),
    Posterior(
        "kidiq",
        "kidscore_momhsiq",
        _KIDIQ,
        _design(lambda d: (d["mom_hs"], d["mom_iq"]), _KIDS),
        linear_cauchy,
    ),
    Posterior(
        "kidiq",
        "kidscore_interaction",
        _KIDIQ,
        _design(lambda d: (d["mom_hs"], d["mom_iq"], d["mom_hs"] * d["mom_iq"]), _KIDS),
        linear_cauchy,
    ),
    Posterior(
        "kidiq_with_mom_work",
        "kidscore_interaction_c",
        _KIDIQ,
        _design(_kidiq_interaction_c, _KIDS),
        linear_flat,
    ),
    Posterior(
        "kidiq_with_mom_work",
        "kidscore_interaction_c2",
        _KIDIQ,
        _design(_kidiq_interaction_c2, _KIDS),
        linear_flat,
    ),
    Posterior(
        "kidiq_with_mom_work",
        "kidscore_interaction_z",
        _KIDIQ,
        _design(_kidiq_interaction_z, _KIDS),
        linear_flat,
    ),
    Posterior(
        "kidiq_with_mom_work",
        "kidscore_mom_work",
        ("kid_score", "mom_work"),
        _design(_mom_work, _KIDS),
        linear_flat,
    ),
    Posterior(
        "earnings", "earn_height", _EARN, _design(lambda d: (d["height"],), lambda d: d["earn"]), linear_flat
    ),
    Posterior(
        "earnings", "logearn_height", _EARN, _design(lambda d: (d["height"],), _log("earn")), linear_flat
    ),
    Posterior(
        "earnings",
        "logearn_height_male",
        _EARN,
        _design(lambda d: (d["height"], d["male"]), _log("earn")),
        linear_flat,
    ),
    Posterior(
        "earnings",
        "logearn_interaction_z",
        _EARN,
        _design(_earnings_interaction_z, _log("earn")),
        linear_flat,
    ),
    Posterior(
        "earnings",
        "logearn_logheight_male",
        _EARN,
        _design(lambda d: (np.log(d["height"]), d["male"]), _log("earn")),
        linear_flat,
    ),
    Posterior(
        "mesquite",
        "mesquite",
        _MESQ,
        _design(lambda d: tuple(d[k] for k in _MESQ[1:]), lambda d: d["weight"]),
        linear_flat,
    ),
    Posterior(
        "mesquite", "logmesquite_logvash", _MESQ, _design(_mesquite_logvash, _log("weight")), linear_flat
    ),
    Posterior("nes2000", "nes", _NES, _design(_nes, lambda d: d["partyid7"]), linear_flat),
    Posterior(
        "kilpisjarvi_mod",
        "kilpisjarvi",
        ("x", "y", "pmualpha", "psalpha", "pmubeta", "psbeta"),
        _prepare_kilpisjarvi,
        kilpisjarvi,
    ),
    Posterior("arK", "arK", ("K", "y"), _prepare_ar_k, ar_k),
    Posterior(
        "low_dim_gauss_mix",
        "low_dim_gauss_mix",
        ("y",),
        lambda data: (np.asarray(data["y"], float),),
        low_dim_gauss_mix,
    ),
    Posterior("sblrc", "blr", ("X", "y"), _prepare_blr, blr),
    Posterior(
        "eight_schools",
        "eight_schools_noncentered",
        ("y", "sigma"),
        lambda data: (np.asarray(data["y"], float), np.asarray(data["sigma"], float)),
        eight_schools_noncentered,
        eight_schools_theta,
    ),
    Posterior("sblri", "blr", ("X", "y"), _prepare_blr, blr),
    Posterior("diamonds", "diamonds", ("X", "Y"), _prepare_diamonds, diamonds),
]

#: every posterior of the benchmark, by posteriordb name
POSTERIORS: dict[str, Posterior] = {p.name: p for p in _ENTRIES}


def stan_site(stan_name: str) -> tuple[str, int | None]:
    """The Pyro site and flat index of a Stan parameter: ``"beta[2]"`` is ``("beta", 1)``, ``"sigma"`` is
    ``("sigma", None)`` (Stan counts from 1; the sites here are scalars or vectors)."""
    match = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", stan_name)
    if match is None:
        raise ValueError(f"not a scalar or vector element of a Stan parameter: {stan_name!r}")
    index = match.group(2)
    return match.group(1), None if index is None else int(index) - 1
