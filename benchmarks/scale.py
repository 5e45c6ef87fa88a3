"""How the kernels' cost grows with the dimension, the clients and the data, beside Pyro's NUTS.

What is measured
----------------
Three axes, each grown one size at a time with the others fixed, every size in a process of its own (its
peak memory is its own), one thread:

- ``dimension``: a Bayesian logistic regression of ``d`` coefficients (``Normal(0, 1)``, features of
  variance ``1 / d`` so that the logits stay of order one) on ``--dimension-data`` points over 20 clients,
  and above ``--mlp-above`` coordinates a Bayesian network of one ``tanh`` hidden layer on 64 inputs and
  10 classes (``d = 75 H + 10`` for ``H`` hidden units, MNIST's digits' input size), labels drawn from a
  random network of its shape;
- ``clients``: the logistic regression at ``d = 20`` on ``--clients-data`` points, split into ``b``
  i.i.d. clients;
- ``data``: the logistic regression at ``d = 20`` over 100 clients, on ``N`` points.

Each kernel (``--kernels``; FALD and VR-FALD⋆ by default) runs at its defaults (``Kernel(model, b)``),
``--chains`` chains of ``--warmup`` + ``--samples`` draws, float32. Reported per size: the wall time, the
set-up's share of it (the warm-up's choices before the chains start, the issue's "warm-up share") and the
warm-up's share (with the ``--warmup`` draws, until the first kept draw), the
seconds per iteration of the draws, the smallest bulk ESS (over all coordinates, or a fixed set of 100
evenly spaced ones above 100), the time to 1,000 effective draws (the warm-up plus the draws' time scaled
to 1,000 ESS) and the peak resident memory of its process. Pyro's NUTS runs the same model on the pooled
data (its chains one after another) where ``d * N`` is at most ``--nuts-limit``. Per axis and sampler, the
growth of the time per iteration and of the time to 1,000 effective draws is fitted as an exponent (least
squares of their logarithms against the size's).

Run::

    python benchmarks/scale.py                       # every axis at the issue's sizes: hours
    python benchmarks/scale.py --axes clients,data   # some axes
    python benchmarks/scale.py --quick               # smoke run (CI)
    python benchmarks/scale.py --merge a.json b.json # one table of several runs' rows

Results: ``benchmarks/results/scale{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import arviz as az
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
#: the sizes of each axis, at full size and in the smoke run
SIZES = {
    "dimension": ([50, 100, 1_000, 10_000, 100_000], [10, 40]),
    "clients": ([10, 100, 1_000, 10_000], [2, 8]),
    "data": ([100_000, 1_000_000, 10_000_000], [400, 1_600]),
}
KERNELS = ("FALD", "VR-FALD*")
#: coordinates whose ESS is computed above this dimension (a fixed, evenly spaced set)
ESS_COORDINATES = 100
INPUTS, CLASSES = 64, 10


# --------------------------------------------------------------------------------------------- one size
def logistic(x, y):
    """Bayesian logistic regression, ``w ~ Normal(0, I)``, the data read through the plate."""
    import pyro
    import pyro.distributions as dist

    w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[-1]), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample(
            "y", dist.Bernoulli(logits=pyro.subsample(x, event_dim=1) @ w), obs=pyro.subsample(y, event_dim=0)
        )


def network(x, y, hidden: int):
    """A Bayesian network of one ``tanh`` layer of ``hidden`` units, ``Normal(0, 1)`` weights scaled by the
    inverse square root of their fan-in, a categorical likelihood."""
    import pyro
    import pyro.distributions as dist

    def weights(name, shape):
        return pyro.sample(name, dist.Normal(x.new_zeros(shape), shape[0] ** -0.5).to_event(len(shape)))

    w1, b1 = weights("w1", (INPUTS, hidden)), weights("b1", (hidden,))
    w2, b2 = weights("w2", (hidden, CLASSES)), weights("b2", (CLASSES,))
    with pyro.plate("data", x.shape[0]):
        features = pyro.subsample(x, event_dim=1)
        logits = (features @ w1 + b1).tanh() @ w2 + b2
        pyro.sample("y", dist.Categorical(logits=logits), obs=pyro.subsample(y, event_dim=0))


def problem(spec: dict):
    """The model (a function of ``x, y``) and its data for one size."""
    import functools

    import torch

    generator = torch.Generator().manual_seed(spec["seed"])
    n, d = spec["data"], spec["dim"]
    if spec["model"] == "logistic":
        x = torch.randn(n, d, generator=generator) / math.sqrt(d)
        w = torch.randn(d, generator=generator)
        y = torch.bernoulli(torch.sigmoid(x @ w), generator=generator)
        return logistic, x, y
    hidden = spec["hidden"]
    x = torch.randn(n, INPUTS, generator=generator)
    w1 = torch.randn(INPUTS, hidden, generator=generator) / math.sqrt(INPUTS)
    w2 = torch.randn(hidden, CLASSES, generator=generator) * 3 / math.sqrt(hidden)
    y = torch.distributions.Categorical(logits=(x @ w1).tanh() @ w2).sample()
    return functools.partial(network, hidden=hidden), x, y


def flat(samples: dict, chains: int) -> np.ndarray:
    """``[chains, draws, d]`` of every latent site's coordinates."""
    parts = [v.reshape(chains, -1, int(np.prod(v.shape[2:], dtype=int))) for v in samples.values()]
    return np.concatenate([p.numpy() for p in parts], axis=-1)


def smallest_ess(draws: np.ndarray) -> float:
    """The smallest bulk ESS over the coordinates (a fixed set of ``ESS_COORDINATES`` above that many)."""
    d = draws.shape[-1]
    picked = np.linspace(0, d - 1, min(d, ESS_COORDINATES)).round().astype(int)
    return float(min(az.ess(draws[..., j], method="bulk") for j in picked))


def run_one(spec: dict) -> dict:
    """One sampler at one size: its times, ESS and peak memory (this process's)."""
    import pyro
    import torch
    from pyro.infer import MCMC, NUTS

    import pyro_fed

    torch.set_num_threads(1)
    model, x, y = problem(spec)
    chains, warmup, samples = spec["chains"], spec["warmup"], spec["samples"]
    pyro.set_rng_seed(spec["seed"])
    marks = {}
    if spec["sampler"] == "NUTS":
        start, draws = time.perf_counter(), []
        for _ in range(chains):
            mcmc = MCMC(NUTS(model), num_samples=samples, warmup_steps=warmup, disable_progbar=True)
            mcmc.run(x, y)
            draws.append(mcmc.get_samples(group_by_chain=True))
        wall = time.perf_counter() - start
        samples_by_chain = {k: torch.cat([d[k] for d in draws]) for k in draws[0]}
        # NUTS's warm-up share is not separated here: its draws' seconds are its whole time's share
        warm_seconds, iterations = float("nan"), float("nan")
    else:
        kernel = {"FALD": pyro_fed.FaldKernel, "VR-FALD*": pyro_fed.VrFaldKernel}[spec["sampler"]](
            model, spec["clients"]
        )
        served = [0]
        setup, sample = kernel.setup, kernel.sample

        def timed_setup(*args, **kwargs):
            if "setup" not in marks:
                marks["start"] = time.perf_counter()
            setup(*args, **kwargs)
            marks.setdefault("setup", time.perf_counter())

        def timed_sample(params):
            if served[0] == warmup:  # the first kept draw of chain 0: the warm-up's draws are computed
                marks["warm"] = time.perf_counter()
            served[0] += 1
            return sample(params)

        kernel.setup, kernel.sample = timed_setup, timed_sample
        mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, num_chains=chains, disable_progbar=True)
        start = time.perf_counter()
        with warnings.catch_warnings():  # the verdict is in the ESS measured here
            warnings.simplefilter("ignore")
            mcmc.run(x, y)
        wall = time.perf_counter() - start
        samples_by_chain = mcmc.get_samples(group_by_chain=True)
        warm_seconds = marks.get("warm", time.perf_counter()) - start
        iterations = samples * kernel.current_thinning
    draws = flat(samples_by_chain, chains)
    ess = smallest_ess(draws)
    draw_seconds = wall - (0.0 if math.isnan(warm_seconds) else warm_seconds)
    row = {
        **spec,
        "wall_s": wall,
        "warmup_share": warm_seconds / wall if wall > 0 else float("nan"),
        "seconds_per_iteration": draw_seconds / iterations if iterations == iterations else float("nan"),
        "ess": ess,
        "to_1000_ess_s": (0.0 if math.isnan(warm_seconds) else warm_seconds) + draw_seconds * 1000 / ess,
        "ess_per_s": ess / wall,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if spec["sampler"] != "NUTS":
        row["setup_s"] = marks["setup"] - marks["start"]
        row["thinning"] = kernel.current_thinning
        row["warmup_line"] = kernel.warmup.summary()
    return row


# --------------------------------------------------------------------------------------------- the axes
def specs(args) -> list[dict]:
    """Every sampler at every size of the axes asked for."""
    out, pooled = [], set()
    for axis in args.axes:
        for size in SIZES[axis][1 if args.quick else 0]:
            if (args.max_size is not None and size > args.max_size) or size < args.min_size:
                continue
            spec = {
                "axis": axis, "size": size, "chains": args.chains, "warmup": args.warmup,
                "samples": args.samples, "seed": args.seed, "model": "logistic", "hidden": 0,
            }  # fmt: skip
            if axis == "dimension":
                spec.update(dim=size, clients=20, data=args.dimension_data)
                if size > args.mlp_above:
                    hidden = max(1, round((size - CLASSES) / (INPUTS + 1 + CLASSES)))
                    dim = (INPUTS + 1) * hidden + (hidden + 1) * CLASSES
                    spec.update(model="mlp", hidden=hidden, dim=dim, size=dim)  # the network's own d
            elif axis == "clients":
                spec.update(dim=20, clients=size, data=args.clients_data)
            else:
                spec.update(dim=20, clients=min(100, size), data=size)
            samplers = list(args.kernels)
            # NUTS on the pooled data, once per model and data (the clients do not change it)
            key = (spec["model"], spec["dim"], spec["data"])
            if spec["dim"] * spec["data"] <= args.nuts_limit and key not in pooled:
                samplers.append("NUTS")
                pooled.add(key)
            out += [{**spec, "sampler": s} for s in samplers]
    return out


def run_isolated(spec: dict, timeout: float) -> dict:
    """``run_one(spec)`` in a fresh process (its own peak memory), or a row saying why it has none."""
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(spec)],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {**spec, "failed": f"no result within {timeout:.0f} s"}
    if done.returncode != 0:
        return {**spec, "failed": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "crashed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def exponent(rows: list[dict], field: str) -> float:
    """The slope of ``log(field)`` against ``log(size)`` over ``rows`` (least squares; ``nan`` under two)."""
    points = [
        (r["size"], r[field]) for r in rows if "failed" not in r and r[field] > 0 and r[field] == r[field]
    ]
    if len(points) < 2:
        return float("nan")
    sizes, values = np.log([p[0] for p in points]), np.log([p[1] for p in points])
    return float(np.polyfit(sizes, values, 1)[0])


def fits(rows: list[dict]) -> list[dict]:
    """Per axis and sampler, the exponents of the time per iteration and of the time to 1,000 ESS."""
    out = []
    for axis in dict.fromkeys(r["axis"] for r in rows):
        for sampler in dict.fromkeys(r["sampler"] for r in rows if r["axis"] == axis):
            chosen = [r for r in rows if r["axis"] == axis and r["sampler"] == sampler]
            out.append(
                {
                    "axis": axis,
                    "sampler": sampler,
                    "sizes": [r["size"] for r in chosen if "failed" not in r],
                    "per_iteration": exponent(chosen, "seconds_per_iteration"),
                    "to_1000_ess": exponent(chosen, "to_1000_ess_s"),
                    "peak_memory": exponent(chosen, "peak_rss_gb"),
                }
            )
    return out


def fmt(value, digits: int = 3) -> str:
    if isinstance(value, float):
        return "—" if math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


def table(rows: list[dict], fitted: list[dict], info: dict) -> str:
    lines = [
        "# Scale: the cost of the kernels' defaults as the dimension, the clients and the data grow",
        "",
        f"{info['chains']} chains x ({info['warmup']} + {info['samples']}) draws, float32, one thread, "
        f"{info['machine']}; every size in its own process. Written by `benchmarks/scale.py`"
        + (" --quick (smoke sizes: the figures say nothing of scale)." if info["quick"] else "."),
        "",
        "| axis | size | d | clients | N | sampler | wall s | set-up share | warm-up share | s / iteration | "
        "thinning | min ESS | s to 1,000 ESS | ESS/s | peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(
                f"| {r['axis']} | {r['size']} | {r['dim']} | {r['clients']} | {r['data']} | {r['sampler']} | "
                f"{r['failed']} | | | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['axis']} | {r['size']} | {r['dim']} | {r['clients']} | {r['data']} | {r['sampler']} | "
            f"{fmt(r['wall_s'])} | {fmt(r.get('setup_s', float('nan')) / r['wall_s'], 2)} | "
            f"{fmt(r['warmup_share'], 2)} | {fmt(r['seconds_per_iteration'])} | "
            f"{r.get('thinning', '—')} | {fmt(r['ess'])} | {fmt(r['to_1000_ess_s'])} | "
            f"{fmt(r['ess_per_s'])} | "
            f"{fmt(r['peak_rss_gb'], 2)} |"
        )
    lines += [
        "",
        "Growth, as exponents of the size (least squares over the sizes that finished): 0 is constant, "
        "1 linear.",
        "",
        "| axis | sampler | sizes | time per iteration | time to 1,000 ESS | peak memory |",
        "|---|---|---|---|---|---|",
    ]
    for f in fitted:
        lines.append(
            f"| {f['axis']} | {f['sampler']} | {', '.join(map(str, f['sizes']))} | "
            f"{fmt(f['per_iteration'], 2)} | "
            f"{fmt(f['to_1000_ess'], 2)} | {fmt(f['peak_memory'], 2)} |"
        )
    lines += ["", "What each warm-up chose:", ""]
    lines += [
        f"- {r['axis']} {r['size']}, {r['sampler']}: {r['warmup_line']}" for r in rows if r.get("warmup_line")
    ]
    return "\n".join(lines) + "\n"


def write(out: Path, stem: str, rows: list[dict], info: dict) -> None:
    """The rows, the info and the fitted exponents, as ``stem.json`` and ``stem.md`` in ``out``."""
    fitted = fits(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"info": info, "rows": rows, "fits": fitted}, indent=1))
    (out / f"{stem}.md").write_text(table(rows, fitted, info))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke sizes, 2 x (30 + 30) draws")
    parser.add_argument("--axes", default="dimension,clients,data", help="comma-separated axes")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: FALD, VR-FALD*")
    parser.add_argument("--chains", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--samples", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dimension-data", type=int, help="points of the dimension axis (default 20,000)")
    parser.add_argument("--clients-data", type=int, help="points of the clients axis (default 100,000)")
    parser.add_argument("--mlp-above", type=int, default=1_000, help="the network above this dimension")
    parser.add_argument("--nuts-limit", type=float, default=2e7, help="NUTS where d * N is at most this")
    parser.add_argument("--max-size", type=int, help="leave out the sizes above this on every axis")
    parser.add_argument("--min-size", type=int, default=0, help="leave out the sizes below this")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per size and sampler")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--merge", nargs="+", type=Path, help="write one table of these runs' JSON files")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return []
    if args.merge:
        runs = [json.loads(path.read_text()) for path in args.merge]
        rows = [row for run in runs for row in run["rows"]]
        write(args.out, "scale", rows, runs[0]["info"])
        return rows
    args.axes = [a for a in args.axes.split(",") if a]
    args.kernels = [k for k in args.kernels.split(",") if k]
    unknown = [a for a in args.axes if a not in SIZES] + [k for k in args.kernels if k not in KERNELS]
    if unknown:
        parser.error(f"unknown axes or kernels {unknown}: the axes are {list(SIZES)}, the kernels {KERNELS}")
    quick = args.quick
    args.chains = args.chains or (2 if quick else 4)
    args.warmup = args.warmup or (30 if quick else 200)
    args.samples = args.samples or (30 if quick else 500)
    args.dimension_data = args.dimension_data or (400 if quick else 20_000)
    args.clients_data = args.clients_data or (400 if quick else 100_000)
    if quick:
        args.mlp_above = min(args.mlp_above, 20)
    info = {
        "quick": quick, "chains": args.chains, "warmup": args.warmup, "samples": args.samples,
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
    }  # fmt: skip
    rows = []
    stem = "scale_quick" if quick else "scale"
    for spec in specs(args):
        rows.append(run_isolated(spec, args.timeout))
        row = rows[-1]
        print(
            f"{spec['axis']} {spec['size']} {spec['sampler']}: "
            + (row["failed"] if "failed" in row else f"{row['wall_s']:.1f} s, ESS {row['ess']:.0f}"),
            flush=True,
        )
        write(args.out, stem, rows, info)  # after every size: a long run keeps what it measured
    print(table(rows, fits(rows), info))
    return rows


if __name__ == "__main__":
    main()
