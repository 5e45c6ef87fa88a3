r"""Every kernel at its defaults, and Pyro's NUTS on the pooled data, against posteriordb's reference
posteriors.

What is measured
----------------
posteriordb (``stan-dev/posteriordb``, BSD 3-Clause) holds Stan programs, their data and reference draws
(10 chains of 1,000 draws of Stan's NUTS, thinned by 10 from 10,000 each). ``benchmarks/posteriordb/``
ships, for 22 of its posteriors whose likelihood is a sum over data points, the data fields the programs
read and the reference's mean, sd and effective sample size per parameter, with the Stan programs and the
licence (``benchmarks/posteriordb/README.md``); ``benchmarks/posteriordb/models.py`` writes each program in
Pyro as it is written in Stan: a parameter without a prior statement keeps Stan's flat prior
(:class:`~pyro.distributions.ImproperUniform` on its support), the data-point terms are in
``pyro.plate("data", N)`` and read the data through :func:`pyro.subsample`. Nothing is downloaded.

Each posterior is sampled, in one run, by

- every kernel at its defaults on an i.i.d. split into 10 clients, ``Kernel(model, 10)`` (fewer where the
  data set has fewer than 20 points, so that each client holds at least two: eight schools' 8 schools on 4
  clients): FALD, VR-FALD⋆, QLSD (``QlsdKernel(model, 10)``: its defaults are no quantisation and no
  control variate, LSD in the paper's terms), QLSD++ (``control_variate="svrg"``), D-ULA (its default
  ring); with ``--kernels``, also SGLD (``SgldKernel(model)``, one client, the pooled data), D-ULA on the
  complete graph (``"D-ULA complete"``: how much of D-ULA's speed its default ring costs) and on the ring
  with three exchanges per step (``"D-ULA 3 rounds"``, ``consensus_rounds=3``: what three times the bits buy),
  and the papers' baselines at their defaults: pSGLD (``PsgldKernel(model, 10)``), SVRG-LD
  (``SvrgLdKernel(model)``, the pooled data), FSGLD (``FsgldKernel(model, 10)``) and DG-LMC
  (``DglmcKernel(model, 10)``);
- Pyro's ``NUTS`` on the pooled data, with a dense mass matrix (``full_mass=True``: the kernels' default
  preconditioner is dense where correlations would slow them more than 4×, so a diagonal NUTS would be the
  easier reference; several of these posteriors correlate their intercept and slope beyond 0.99), its
  potential traced by the JIT (``jit_compile=True``: the kernels compile theirs too) and otherwise Pyro's
  defaults. Pyro's default starts sample the prior, which an improper prior cannot do, so
  NUTS starts where Stan starts: uniform on ``(-2, 2)`` in the unconstrained space
  (:func:`init_to_stan_uniform`). Its chains run one after the other, each in its own ``MCMC`` (Pyro runs
  several CPU chains in parallel processes, whose wall time would not be single-threaded); its time is the
  sum of theirs.

Every sampler runs ``--chains`` chains of ``--warmup`` warm-up and ``--samples`` draws (the issue's set-up:
4 × (500 + 1,000)), in ``--dtype`` (default ``float32``), on one torch thread. The draws are compared with
the reference on the constrained scale, per Stan parameter :math:`j`:

- ``mean err`` :math:`= \max_j |\hat\mu_j - \mu_j| / \sigma_j` (the reference's mean and sd);
- ``sd ratio``: the ratio :math:`\hat\sigma_j / \sigma_j` farthest from 1;
- ``R-hat``: the largest rank-normalised split R-hat (ArviZ); ``ESS``: the smallest bulk ESS (ArviZ);
- ``ESS/s``: ``ESS`` over the wall time of ``mcmc.run`` (warm-up, adaptation and compilation included), and
  its ratio to NUTS's on the same posterior.

A sampler passes a posterior when, for every parameter, :math:`|\hat\mu_j - \mu_j| / \sigma_j \le 0.2 + 3
\sqrt{r_j^2 / E_j + 1 / E^{ref}_j}` and :math:`|\hat\sigma_j / \sigma_j - 1| \le 0.15 + 3 \sqrt{1/(2E_j) +
1/(2E^{ref}_j)}` (:math:`E_j`, :math:`E^{ref}_j` the bulk ESS of the run and of the reference, :math:`r_j`
the sd ratio: three Monte Carlo standard errors of the difference, the sd's taken as a normal's, :math:`\sigma
/ \sqrt{2E}`), and every R-hat is at most 1.05. A run that raises fails, and its row says with what.

Run::

    python benchmarks/posteriordb.py                 # every posterior and sampler, 4 x (500 + 1000)
    python benchmarks/posteriordb.py --quick         # smoke run: 2 posteriors, 2 x (50 + 100)
    python benchmarks/posteriordb.py --posteriors arK-arK,sblri-blr --kernels FALD,NUTS --samples 500
    python benchmarks/posteriordb.py --merge a/posteriordb.json b/posteriordb.json  # one table of two runs
    python benchmarks/posteriordb.py --written-for-nuts --kernels FALD  # the models as NUTS users write them

``--written-for-nuts`` runs each model as a NUTS user writes it, the Stan program's shape: its data read at
full size, no :func:`pyro.subsample` (:func:`models.written_for_nuts`), so that every kernel runs it on each
client's rows of its arguments (``benchmarks/results/posteriordb_written_for_nuts.{md,json}``).

Results: ``benchmarks/results/posteriordb{,_quick}.{md,json}`` (``--out`` changes the folder), rewritten
after every posterior, so that a run stopped early leaves the table of the posteriors it finished (its
header says so); a run of some posteriors or samplers writes only its rows. Without ``--posteriors`` the
posteriors run one data set at a time in turn (:func:`interleaved`).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import inspect
import json
import math
import platform
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import arviz as az
import numpy as np
import pyro
import torch
from pyro.distributions.transforms import biject_to
from pyro.infer import MCMC, NUTS

import pyro_fed

HERE = Path(__file__).resolve().parent
SHIPPED = HERE / "posteriordb"
sys.path.insert(0, str(SHIPPED))
from models import POSTERIORS, Posterior, stan_site, written_for_nuts  # noqa: E402 (the shipped models sit beside this script)

#: the targets: mean within 0.2 reference sd, sd within 15%, R-hat at most 1.05
MEAN_TARGET, SD_TARGET, RHAT_TARGET = 0.2, 0.15, 1.05
#: Monte Carlo standard errors added to the mean and sd targets
MC_ERRORS = 3.0
#: clients of the i.i.d. split every federated kernel gets (fewer where the data has fewer than 2 points
#: per client: eight schools' 8 schools go to 4 clients, :func:`clients_for`)
CLIENTS = 10
#: the two posteriors of ``--quick``: a flat-prior regression and the AR(5)
QUICK = ("kidiq-kidscore_momhs", "arK-arK")


def count(clients) -> int:
    """The number of clients of a split: ``clients`` itself, or the number of its index lists."""
    return clients if isinstance(clients, int) else len(clients)


#: the samplers, each at its defaults, then at the papers' federated settings (``NUTS`` is run by
#: :func:`run_nuts`, ``consensus`` by :func:`run_consensus`)
KERNELS: dict[str, Callable] = {
    "FALD": lambda model, clients: pyro_fed.FaldKernel(model, clients),
    "VR-FALD*": lambda model, clients: pyro_fed.VrFaldKernel(model, clients),
    "QLSD": lambda model, clients: pyro_fed.QlsdKernel(model, clients),
    "QLSD++": lambda model, clients: pyro_fed.QlsdKernel(model, clients, control_variate="svrg"),
    "D-ULA": lambda model, clients: pyro_fed.DulaKernel(model, clients),
    # D-ULA on the graph that mixes in one exchange: how much of its speed its default ring costs
    "D-ULA complete": lambda model, clients: pyro_fed.DulaKernel(model, clients, graph="complete"),
    # the ring with three exchanges per step: what three times the bits per iteration buy
    "D-ULA 3 rounds": lambda model, clients: pyro_fed.DulaKernel(model, clients, consensus_rounds=3),
    "SGLD": lambda model, clients: pyro_fed.SgldKernel(model),
    # the papers' baselines, each at its defaults
    "pSGLD": lambda model, clients: pyro_fed.PsgldKernel(model, clients),
    "SVRG-LD": lambda model, clients: pyro_fed.SvrgLdKernel(model),
    "FSGLD": lambda model, clients: pyro_fed.FsgldKernel(model, clients),
    "DG-LMC": lambda model, clients: pyro_fed.DglmcKernel(model, clients),
    # averaging at every iteration, the setting of earlier defaults
    "FALD p=1": lambda model, clients: pyro_fed.FaldKernel(model, clients, comm_prob=1.0),
    "VR-FALD* p=1": lambda model, clients: pyro_fed.VrFaldKernel(model, clients, comm_prob=1.0),
    # the warm-up's choice of the averaging probability
    "FALD auto": lambda model, clients: pyro_fed.FaldKernel(model, clients, comm_prob=None),
    "VR-FALD* auto": lambda model, clients: pyro_fed.VrFaldKernel(model, clients, comm_prob=None),
    # the papers' settings: an average every tenth iteration, or every b-th (the FALD paper's 1 / b)
    "FALD p=0.1": lambda model, clients: pyro_fed.FaldKernel(model, clients, comm_prob=0.1),
    "FALD p=1/b": lambda model, clients: pyro_fed.FaldKernel(model, clients, comm_prob=1 / count(clients)),
    "VR-FALD* p=0.1": lambda model, clients: pyro_fed.VrFaldKernel(model, clients, comm_prob=0.1),
    "VR-FALD* p=1/b": lambda model, clients: pyro_fed.VrFaldKernel(
        model, clients, comm_prob=1 / count(clients)
    ),
    # the QLSD paper's: 2^4 or 2^8 quantisation levels, each client taking part with probability 0.5
    "QLSD++ 2^4 p=0.5": lambda model, clients: pyro_fed.QlsdKernel(
        model, clients, control_variate="svrg", quantization_levels=2**4, participation=0.5
    ),
    "QLSD++ 2^8 p=0.5": lambda model, clients: pyro_fed.QlsdKernel(
        model, clients, control_variate="svrg", quantization_levels=2**8, participation=0.5
    ),
    # the warm-up's choice of the quantisation levels
    "QLSD++ auto": lambda model, clients: pyro_fed.QlsdKernel(
        model, clients, control_variate="svrg", quantization_levels="auto"
    ),
}
SAMPLERS = (*KERNELS, "consensus", "NUTS")
#: the samplers of the federated regime (``--regime``): the kernels at their defaults and at the papers'
#: settings, D-ULA, FSGLD, one-shot consensus Monte Carlo and NUTS
REGIME_SAMPLERS = (
    "FALD",
    "FALD p=1",
    "FALD p=0.1",
    "FALD p=1/b",
    "FALD auto",
    "VR-FALD*",
    "VR-FALD* p=1",
    "VR-FALD* p=0.1",
    "VR-FALD* p=1/b",
    "VR-FALD* auto",
    "QLSD++",
    "QLSD++ 2^4 p=0.5",
    "QLSD++ 2^8 p=0.5",
    "QLSD++ auto",
    "D-ULA",
    "FSGLD",
    "consensus",
    "NUTS",
)
#: how the data are split into clients (``--split``): at random, or sorted by the response into contiguous
#: clients (each site sees one range of outcomes, as hospitals or regions do)
SPLITS = ("iid", "sorted")
#: those of a run without ``--kernels``: the federated kernels (QLSD at its defaults is LSD, uncompressed and
#: without control variates; QLSD++ is the variance-reduced one the accuracy targets name; SGLD, the
#: one-client reference, with ``--kernels``) and NUTS
DEFAULT_SAMPLERS = ("FALD", "VR-FALD*", "QLSD", "QLSD++", "D-ULA", "NUTS")


# --------------------------------------------------------------------------------------------- inputs
def load(name: str, dtype: torch.dtype = torch.float32) -> tuple[Posterior, tuple[torch.Tensor, ...], dict]:
    """The posterior ``name``: its registry entry, the model's arguments in ``dtype`` and the reference
    summary (``{stan parameter: {"mean", "sd", "ess_bulk", ...}}``), from the shipped files."""
    posterior = POSTERIORS[name]
    path = SHIPPED / "data" / f"{posterior.data_name}.json"
    text = path.read_bytes() if path.exists() else gzip.decompress(path.with_suffix(".json.gz").read_bytes())
    data = json.loads(text)
    reference = json.loads((SHIPPED / "reference" / f"{name}.json").read_text())["parameters"]
    return posterior, posterior.tensors(data, dtype), reference


def clients_for(num_data: int) -> int:
    """The clients of a posterior's split: :data:`CLIENTS`, or fewer so that each holds at least two data
    points."""
    return max(1, min(CLIENTS, num_data // 2))


def split(posterior: Posterior, args: tuple[torch.Tensor, ...], how: str):
    """The clients of a posterior's split (``how`` of ``SPLITS``): :func:`clients_for`'s number of i.i.d.
    clients, or as many contiguous clients of the data points sorted by the response (the model's argument
    ``y``, the observed site of every model here), as equal in size as they can be."""
    num_clients = clients_for(int(args[0].shape[0]))
    if how == "iid":
        return num_clients
    response = args[list(inspect.signature(posterior.model).parameters).index("y")]
    order = torch.argsort(response, stable=True)
    bounds = [len(order) * i // num_clients for i in range(num_clients + 1)]
    return [order[start:end] for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


def data_megabytes(args: tuple[torch.Tensor, ...]) -> float:
    """What pooling the data costs: every number of the model's arguments sent once, 32 bits each, in MB."""
    return sum(a.numel() for a in args) * 32 / 8e6


def interleaved() -> list[str]:
    """Every shipped posterior, one of each data set in turn (a run stopped early has covered the most
    different ones)."""
    groups: dict[str, list[str]] = {}
    for name, posterior in POSTERIORS.items():
        groups.setdefault(posterior.data_name, []).append(name)
    rounds = max(len(g) for g in groups.values())
    return [g[i] for i in range(rounds) for g in groups.values() if i < len(g)]


def init_to_stan_uniform(site: dict | None = None, radius: float = 2.0):
    """Stan's default start: uniform on ``(-radius, radius)`` in the unconstrained space, mapped to the
    support. Unlike :func:`~pyro.infer.autoguide.init_to_uniform` it never samples the site's distribution
    (an :class:`~pyro.distributions.ImproperUniform` cannot), only reads its support and shape."""
    if site is None:
        return functools.partial(init_to_stan_uniform, radius=radius)
    fn = site["fn"]
    transform = biject_to(fn.support)
    shape = transform.inverse_shape(fn.batch_shape + fn.event_shape)
    unconstrained = torch.rand(shape) * (2 * radius) - radius
    return transform(unconstrained).detach()


# ------------------------------------------------------------------------------------------ measuring
def draws(mcmc: MCMC, names: Sequence[str], posterior: Posterior) -> dict[str, np.ndarray]:
    """``{stan parameter: [chains, draws]}`` from a run's constrained draws (and the program's transformed
    parameters computed from them)."""
    samples = mcmc.get_samples(group_by_chain=True)
    if posterior.transformed is not None:
        samples = {**samples, **posterior.transformed(samples)}
    out = {}
    for name in names:
        site, index = stan_site(name)
        value = samples[site]
        value = value if index is None else value.reshape(*value.shape[:2], -1)[..., index]
        out[name] = value.double().numpy()
    return out


def compare(values: dict[str, np.ndarray], reference: dict) -> dict:
    """Every parameter's errors against the reference, the worst ones, and the checks failed."""
    per = {}
    failed = []
    for name, v in values.items():
        ref = reference[name]
        mean_err = (v.mean() - ref["mean"]) / ref["sd"]
        sd_ratio = v.std(ddof=1) / ref["sd"]
        ess = float(az.ess(v, method="bulk"))
        rhat = float(az.rhat(v))
        mean_tol = MEAN_TARGET + MC_ERRORS * math.sqrt(sd_ratio**2 / ess + 1 / ref["ess_bulk"])
        sd_tol = SD_TARGET + MC_ERRORS * math.sqrt(1 / (2 * ess) + 1 / (2 * ref["ess_bulk"]))
        per[name] = {
            "mean_err": float(mean_err),
            "mean_tol": mean_tol,
            "sd_ratio": float(sd_ratio),
            "sd_tol": sd_tol,
            "ess": ess,
            "rhat": rhat,
        }
        if not abs(mean_err) <= mean_tol:  # written so that a NaN fails
            failed.append(f"mean {name} {mean_err:+.2f} sd (tolerance {mean_tol:.2f})")
        if not abs(sd_ratio - 1) <= sd_tol:
            failed.append(f"sd {name} x{sd_ratio:.2f} (tolerance {sd_tol:.2f})")
        if not rhat <= RHAT_TARGET:
            failed.append(f"R-hat {name} {rhat:.3f}")
    worst_mean = max(
        per, key=lambda k: abs(per[k]["mean_err"]) if np.isfinite(per[k]["mean_err"]) else np.inf
    )
    worst_sd = max(
        per, key=lambda k: abs(per[k]["sd_ratio"] - 1) if np.isfinite(per[k]["sd_ratio"]) else np.inf
    )
    return {
        "mean_err": abs(per[worst_mean]["mean_err"]),
        "mean_err_param": worst_mean,
        "sd_ratio": per[worst_sd]["sd_ratio"],
        "sd_ratio_param": worst_sd,
        "rhat": max(p["rhat"] for p in per.values()),
        "ess": min(p["ess"] for p in per.values()),
        "failed": failed,
        "passes": not failed,
        "parameters": per,
    }


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def run_nuts(model, args, chains: int, warmup: int, samples: int, seed: int) -> tuple[list[MCMC], float]:
    """NUTS on the pooled data: ``chains`` single-chain runs one after the other, and their total time."""
    runs, seconds = [], 0.0
    for chain in range(chains):
        pyro.set_rng_seed(seed + chain)
        # max_plate_nesting given: Pyro would otherwise find it by running the model with its priors
        # sampled, which an improper prior cannot do; the models here have one plate
        kernel = NUTS(
            model,
            full_mass=True,
            init_strategy=init_to_stan_uniform,
            max_plate_nesting=1,
            jit_compile=True,
            ignore_jit_warnings=True,
        )
        mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, num_chains=1, disable_progbar=True)
        start = time.perf_counter()
        mcmc.run(*args)
        seconds += time.perf_counter() - start
        runs.append(mcmc)
    return runs, seconds


def run_consensus(
    model, clients, args, chains: int, warmup: int, samples: int, seed: int
) -> tuple[list, float, int]:
    """One-shot consensus Monte Carlo (:func:`pyro_fed.consensus.sample`: each client's sub-posterior
    sampled by NUTS as :func:`run_nuts` samples the pooled data, the draws merged by the server): ``chains``
    independent runs one after the other, their total time and the bits the clients uploaded."""
    runs, seconds, bits = [], 0.0, 0

    def nuts(sub_model):
        return NUTS(
            sub_model,
            full_mass=True,
            init_strategy=init_to_stan_uniform,
            max_plate_nesting=1,
            jit_compile=True,
            ignore_jit_warnings=True,
        )

    for chain in range(chains):
        pyro.set_rng_seed(seed + chain)
        start = time.perf_counter()
        result = pyro_fed.consensus.sample(
            model, clients, *args, num_samples=samples, warmup_steps=warmup, kernel=nuts
        )
        seconds += time.perf_counter() - start
        runs.append(result)
        bits += result.uploaded_bits
    return runs, seconds, bits


def run_one(
    name: str,
    sampler: str,
    *,
    chains: int,
    warmup: int,
    samples: int,
    dtype: torch.dtype,
    seed: int = 0,
    how: str = "iid",
    for_nuts: bool = False,
) -> dict:
    """One row: the sampler ``sampler`` on the posterior ``name``, compared with the reference; with
    ``for_nuts``, its model as a NUTS user writes it (:func:`models.written_for_nuts`). Never raises for the
    sampler's sake: an exception becomes a failed row with its type and first line."""
    row = {"posterior": name, "sampler": sampler}
    caught = []
    try:
        posterior, args, reference = load(name, dtype)
        model = written_for_nuts(posterior.model) if for_nuts else posterior.model
        row["parameters_compared"] = len(reference)
        row["N"] = int(args[0].shape[0])  # every model's first argument has a row per data point
        row["split"] = how
        clients = split(posterior, args, how)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if sampler == "NUTS":
                runs, seconds = run_nuts(model, args, chains, warmup, samples, seed)
                per_chain = [draws(run, reference, posterior) for run in runs]
                values = {k: np.concatenate([c[k] for c in per_chain], 0) for k in reference}
                row["divergences"] = sum(
                    len(v) for run in runs for v in run.diagnostics()["divergences"].values()
                )
                row["uploaded_mb"] = data_megabytes(args)  # the data, pooled once
            elif sampler == "consensus":
                row["clients"] = count(clients)
                runs, seconds, bits = run_consensus(model, clients, args, chains, warmup, samples, seed)
                per_chain = [draws(run, reference, posterior) for run in runs]
                values = {k: np.concatenate([c[k] for c in per_chain], 0) for k in reference}
                row["uploaded_mb"] = bits / 8e6
            else:
                row["clients"] = count(clients)
                kernel = KERNELS[sampler](model, clients)
                mcmc = MCMC(
                    kernel, num_samples=samples, warmup_steps=warmup, num_chains=chains, disable_progbar=True
                )
                pyro.set_rng_seed(seed)
                start = time.perf_counter()
                mcmc.run(*args)
                seconds = time.perf_counter() - start
                values = draws(mcmc, reference, posterior)
                row.update(kernel_choices(kernel, mcmc))
        row.update(compare(values, reference))
        row["seconds"] = seconds
        row["ess_per_s"] = row["ess"] / seconds
        if row.get("uploaded_mb") is not None:
            row["mb_per_ess"] = row["uploaded_mb"] / row["ess"]
        row["error"] = None
    except Exception as error:  # a crash is a result: recorded, and the benchmark goes on
        row.update(passes=False, error=_first_line(error), traceback=traceback.format_exc(limit=-6))
    row["warnings"] = sorted({str(w.message).splitlines()[0][:200] for w in caught})
    return row


def kernel_choices(kernel, mcmc: MCMC) -> dict:
    """What the kernel's warm-up chose, and its end-of-run checks (what exists of them)."""
    out = {}
    for key, attribute in (
        ("step_size", "current_step_size"),
        ("batch_size", "current_batch_size"),
        ("thinning", "current_thinning"),
    ):
        value = getattr(kernel, attribute, None)
        out[key] = value if value is None or isinstance(value, (int, float)) else str(value)
    adaptation = getattr(kernel, "adaptation", None)
    if adaptation is not None:
        out["preconditioner"] = "dense" if adaptation.preconditioner.dim() == 2 else "diagonal"
    for key, attribute in (
        ("comm_prob", "current_comm_prob"),
        ("refresh_prob", "current_refresh_prob"),
        ("quantization_levels", "current_quantization_levels"),
    ):
        value = getattr(kernel, attribute, None)
        if value is not None:
            out[key] = float(value)
    try:
        diagnostics = mcmc.diagnostics()
        out["uploaded_mb"] = sum(diagnostics["uploaded bits"].values()) / 8e6
        out["divergences"] = sum(len(v) for v in diagnostics["divergences"].values())
        out["end_of_run_problems"] = kernel.end_of_run_checks["problems"]
    except (KeyError, TypeError, AttributeError):
        pass  # a kernel without them
    return out


def add_ratios(rows: list[dict]) -> list[dict]:
    """Set each row's ``ess_per_s_ratio``: its ESS/s over that of NUTS on its posterior, where NUTS ran
    without error (the rows, changed in place)."""
    for row in rows:
        nuts = next(
            (
                r
                for r in rows
                if r["posterior"] == row["posterior"] and r["sampler"] == "NUTS" and not r["error"]
            ),
            None,
        )
        if nuts is not None and row.get("error") is None:
            row["ess_per_s_ratio"] = row["ess_per_s"] / nuts["ess_per_s"]
    return rows


def run_benchmark(
    posteriors: Sequence[str],
    samplers: Sequence[str],
    *,
    chains: int,
    warmup: int,
    samples: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    how: str = "iid",
    for_nuts: bool = False,
    echo: bool = False,
    after_each: Callable[[list[dict]], object] | None = None,
) -> list[dict]:
    """Every ``samplers`` × ``posteriors`` row (:func:`run_one`), with each row's ESS/s ratio to NUTS's on
    its posterior when NUTS ran and did not fail. NUTS runs first on each posterior; ``after_each`` is
    called with the rows so far after each posterior."""
    rows = []
    order = sorted(samplers, key=lambda s: s != "NUTS")
    for name in posteriors:
        these = []
        for sampler in order:
            row = run_one(
                name,
                sampler,
                chains=chains,
                warmup=warmup,
                samples=samples,
                dtype=dtype,
                seed=seed,
                how=how,
                for_nuts=for_nuts,
            )
            these.append(row)
            if echo:
                print(
                    json.dumps({k: v for k, v in row.items() if k not in ("parameters", "traceback")}),
                    flush=True,
                )
        rows += sorted(add_ratios(these), key=lambda r: SAMPLERS.index(r["sampler"]))
        if after_each is not None:
            after_each(rows)
    return rows


# -------------------------------------------------------------------------------------------- output
def table(rows: list[dict], header: str) -> str:
    """The markdown of the results."""
    lines = [
        header,
        "",
        "| posterior | sampler | passes | mean err (param) | sd ratio (param) | R-hat | min ESS | s | ESS/s "
        "| ×NUTS | MB up | ESS/MB | failed checks, or error |",
        "|---|---|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("error") is not None:
            cells = [r["posterior"], r["sampler"], "NO", *[""] * 9, f"**{r['error']}**"]
        else:
            ratio = r.get("ess_per_s_ratio")
            cells = [
                r["posterior"],
                r["sampler"],
                "yes" if r["passes"] else "NO",
                f"{r['mean_err']:.2f} ({r['mean_err_param']})",
                f"{r['sd_ratio']:.2f} ({r['sd_ratio_param']})",
                f"{r['rhat']:.3f}",
                f"{r['ess']:.0f}",
                f"{r['seconds']:.1f}",
                f"{r['ess_per_s']:.3g}",
                "" if ratio is None else f"{ratio:.2f}",
                "" if r.get("uploaded_mb") is None else f"{r['uploaded_mb']:.3g}",
                "" if not r.get("uploaded_mb") else f"{r['ess'] / r['uploaded_mb']:.3g}",
                "; ".join(r["failed"]),
            ]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    lines += [
        "",
        "Per sampler:",
        "",
        "| sampler | passes | errors | median ×NUTS (min, max) | median MB per ESS (min, max) |",
        "|---|---:|---:|---|---|",
    ]
    for sampler in dict.fromkeys(r["sampler"] for r in rows):
        mine = [r for r in rows if r["sampler"] == sampler]
        ratios = [r["ess_per_s_ratio"] for r in mine if r.get("ess_per_s_ratio") is not None]
        spread = f"{np.median(ratios):.2f} ({min(ratios):.2f}, {max(ratios):.2f})" if ratios else ""
        costs = [r["mb_per_ess"] for r in mine if r.get("error") is None and r.get("mb_per_ess") is not None]
        cost = f"{np.median(costs):.3g} ({min(costs):.3g}, {max(costs):.3g})" if costs else ""
        errors = sum(r.get("error") is not None for r in mine)
        lines.append(
            f"| {sampler} | {sum(r['passes'] for r in mine)}/{len(mine)} | {errors} | {spread} | {cost} |"
        )
    without = [
        p
        for p in dict.fromkeys(r["posterior"] for r in rows)
        if not any(r["posterior"] == p and r["sampler"] == "NUTS" for r in rows)
    ]
    if without:
        lines += [
            "",
            f"NUTS was not run on {len(without)} posteriors (no ×NUTS there): {', '.join(without)}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {', '.join(QUICK)}, tiny chains")
    parser.add_argument("--posteriors", help="comma-separated posteriordb names (default: all shipped)")
    parser.add_argument("--kernels", help=f"comma-separated samplers of {list(SAMPLERS)}")
    parser.add_argument(
        "--regime",
        action="store_true",
        help=f"the samplers of the federated regime: {', '.join(REGIME_SAMPLERS)} (unless --kernels)",
    )
    parser.add_argument("--split", choices=SPLITS, default="iid", help="how the data are split into clients")
    parser.add_argument(
        "--written-for-nuts",
        action="store_true",
        help="each model as a NUTS user writes it, its data read at full size (no pyro.subsample)",
    )
    parser.add_argument("--chains", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--samples", type=int)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        help="write one table from the JSON results of runs made separately (e.g. side by side), and exit",
    )
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out, quick=args.quick, regime=args.regime)
    posteriors = (
        args.posteriors.split(",") if args.posteriors else list(QUICK if args.quick else interleaved())
    )
    samplers = (
        args.kernels.split(",")
        if args.kernels
        else list(REGIME_SAMPLERS if args.regime else DEFAULT_SAMPLERS)
    )
    for option, chosen, known in (("posteriors", posteriors, POSTERIORS), ("kernels", samplers, SAMPLERS)):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            parser.error(f"--{option}: unknown {unknown}; there are {list(known)}")
    sizes = (2, 50, 100) if args.quick else (4, 500, 1000)
    chains, warmup, samples = (
        given or size for given, size in zip((args.chains, args.warmup, args.samples), sizes, strict=True)
    )
    dtype = getattr(torch, args.dtype)
    threads, default_dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)
    torch.set_default_dtype(dtype)  # the kernels' own tensors (steps, noise) in the same precision
    command = "python benchmarks/posteriordb.py " + " ".join(sys.argv[1:] if argv is None else argv)
    stem = stem_for(args.quick, args.regime, args.split, args.written_for_nuts)
    started = time.perf_counter()

    def write(rows: list[dict]) -> str:
        # after every posterior: a run stopped early still leaves the table of the posteriors it finished
        done = list(dict.fromkeys(r["posterior"] for r in rows))
        info = {
            "command": command.strip(),
            "posteriors": done,
            "planned": posteriors,
            "chains": chains,
            "warmup": warmup,
            "samples": samples,
            "dtype": args.dtype,
            "clients": CLIENTS,
            "split": args.split,
            "written_for_nuts": args.written_for_nuts,
            "seed": args.seed,
            "wall_seconds": time.perf_counter() - started,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pyro": pyro.__version__,
            "machine": platform.machine(),
            "threads": 1,
            "posteriordb": json.loads((SHIPPED / "SOURCE.json").read_text())["commit"],
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{stem}.json").write_text(
            json.dumps({"rows": rows, "info": info}, indent=1, default=str) + "\n"
        )
        text = table(rows, header(info))
        (args.out / f"{stem}.md").write_text(text)
        return text

    try:
        rows = run_benchmark(
            posteriors,
            samplers,
            chains=chains,
            warmup=warmup,
            samples=samples,
            dtype=dtype,
            seed=args.seed,
            how=args.split,
            for_nuts=args.written_for_nuts,
            echo=True,
            after_each=write,
        )
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(default_dtype)
    print(write(rows))
    return rows


def stem_for(quick: bool, regime: bool, how: str, for_nuts: bool = False) -> str:
    """The results' file name: ``posteriordb``, with ``_regime`` for the regime's samplers, ``_sorted`` for
    the sorted split, ``_quick`` for a smoke run and ``_written_for_nuts`` for the models written for NUTS."""
    split = "" if how == "iid" else f"_{how}"
    return "posteriordb" + "_regime" * regime + split + "_quick" * quick + "_written_for_nuts" * for_nuts


def merge(paths: Sequence[Path], out: Path, *, quick: bool = False, regime: bool = False) -> list[dict]:
    """One table (in ``out``, named by :func:`stem_for`) from the results of several runs of the same
    sizes. A row of a later run replaces that of an earlier one for the same posterior and sampler (a
    sampler run again after a change: the header lists every run's command). The table's split, and whether
    the models are written for NUTS, are the first run's; of a run on another split only the NUTS rows are
    taken, since NUTS samples the pooled data whatever the split."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    sizes = {
        tuple(part["info"][k] for k in ("chains", "warmup", "samples", "dtype", "seed")) for part in parts
    }
    if len(sizes) != 1:
        raise SystemExit(
            f"--merge: the runs differ in (chains, warmup, samples, dtype, seed): {sorted(sizes)}"
        )
    how = parts[0]["info"].get("split", "iid")
    stem = out / stem_for(quick, regime, how, bool(parts[0]["info"].get("written_for_nuts")))
    # a posterior's rows may come from several runs (its NUTS row from another): ordered and compared here
    latest = {
        (row["posterior"], row["sampler"]): row
        for part in parts
        for row in part["rows"]
        if part["info"].get("split", "iid") == how or row["sampler"] == "NUTS"
    }
    rows = list(latest.values())
    names = list(dict.fromkeys(row["posterior"] for row in rows))
    rows = add_ratios(sorted(rows, key=lambda r: (names.index(r["posterior"]), SAMPLERS.index(r["sampler"]))))
    info = dict(parts[0]["info"])
    # a merged table merged again keeps its runs' commands, already shortened
    commands = [
        part["info"]["command"] if part["info"].get("parts", 1) > 1 else f"`{short(part['info']['command'])}`"
        for part in parts
    ]
    info.update(
        command="; ".join(commands),
        parts=sum(part["info"].get("parts", 1) for part in parts),
        posteriors=names,
        planned=names,
        wall_seconds=max(part["info"]["wall_seconds"] for part in parts),
    )
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(
        json.dumps({"rows": rows, "info": info}, indent=1, default=str) + "\n"
    )
    text = table(rows, header(info))
    stem.with_suffix(".md").write_text(text)
    print(text)
    return rows


def short(command: str) -> str:
    """A command line with its list of posteriors counted, not spelled out, and without ``--out``."""
    command = re.sub(
        r"--posteriors (\S+)", lambda m: f"--posteriors <{m.group(1).count(',') + 1} posteriors>", command
    )
    return re.sub(r" --out \S+", "", command)


def written_by(info: dict) -> str:
    if info.get("parts", 1) == 1:
        return f"Written by `{info['command']}` (see its docstring)."
    return (
        f"Written by {info['parts']} runs ({info['command']}; some side by side), then `python "
        "benchmarks/posteriordb.py --merge` of their JSON files (see its docstring)."
    )


def header(info: dict) -> str:
    """The table's title and the paragraph saying what was run and what the columns are."""
    done, planned = len(info["posteriors"]), len(info["planned"])
    count = (
        f"{done} posteriors" if done == planned else f"{done} of the {planned} planned posteriors (stopped)"
    )
    return "\n".join(
        [
            "# posteriordb: the kernels and NUTS against Stan's reference posteriors"
            + ("" if info.get("split", "iid") == "iid" else ", the clients' data sorted by the response")
            + (", the models written for NUTS" if info.get("written_for_nuts") else ""),
            "",
            written_by(info) + f" {count} of posteriordb "
            f"{info['posteriordb'][:7]}; each sampler {info['chains']} chains × ({info['warmup']} warm-up + "
            f"{info['samples']} draws), {info['dtype']}, one CPU thread; the kernels on "
            + (
                "an i.i.d. split into "
                if info.get("split", "iid") == "iid"
                else "the data points sorted by the response and cut, in that order, into "
            )
            + f"{info['clients']} clients (fewer for fewer than 20 data points: eight schools on 4), NUTS "
            "(dense mass matrix, chains one after the other) on the pooled data, consensus Monte Carlo (each "
            "client's sub-posterior sampled once by that NUTS, the draws merged). Passes: every parameter's "
            f"mean within {MEAN_TARGET} reference sd + {MC_ERRORS:g} Monte "
            "Carlo standard errors (MCSE = sd / sqrt(bulk ESS), of the run and of the reference), its sd "
            f"within {SD_TARGET:.0%} + {MC_ERRORS:g} × sqrt(1/(2 ESS) + 1/(2 ESS_ref)), every R-hat ≤ "
            f"{RHAT_TARGET}. "
            "`mean err`: the worst |mean − ref| / ref sd; `sd ratio`: the sd / ref sd farthest from 1; "
            "`min ESS`: the smallest bulk ESS; `s`: the wall time of the run (warm-up and compilation "
            "included); `×NUTS`: ESS/s over NUTS's on the same posterior; `MB up`: what the clients "
            "uploaded over all chains, warm-up included (for NUTS: the data, pooled once), `ESS/MB`: the "
            "min ESS per MB uploaded. Wall time of the "
            f"{'whole benchmark' if info.get('parts', 1) == 1 else 'longest run'}: "
            f"{info['wall_seconds'] / 60:.0f} min.",
            "",
            "The times are those of a CPU shared with other work: compare the ratios of one posterior's rows "
            + (
                "(its samplers ran one after the other in one process), not the absolute times."
                if info.get("parts", 1) == 1
                else "rather than the absolute times; a posterior's rows may come from different runs (those "
                "above), made at different times on a machine whose load changed, which moves ×NUTS too."
            ),
        ]
    )


if __name__ == "__main__":
    main()
