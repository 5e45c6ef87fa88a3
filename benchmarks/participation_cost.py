"""What partial participation saves: QLSD++'s time per iteration at participation 1, 0.5 and 0.1.

What is measured
----------------
Wall-clock time of one iteration of ``QlsdKernel(model, clients, quantization_levels=2**8,
control_variate="svrg", participation=p, step_size=..., batch_size=32)`` (QLSD++ in the paper's terms) on a
Bayesian logistic regression with ``d = 10`` features, ``b = 1000`` clients of 64 points each (``N = 64,000``;
``--clients`` changes ``b``), driven by hand as :class:`pyro.infer.MCMC` drives it: ``kernel.setup(0, x,
y)``, then ``kernel.sample`` calls, timed over whole chunks of iterations (``chunk_size = 64``: one call in
64 runs a chunk, the others read its buffer) after a first chunk that prepares the iteration; a later
chunk whose working clients need a new width of the oracle's batch prepares it again, and that time is
reported apart (a long run prepares a few widths once). The step and
the snapshot period are given (``snapshot_every = 1000``), so that no warm-up runs and each participation
times the same work but its clients' gradients. One torch thread, float32, ``--mode`` ``"traced"`` (default)
or ``"compiled"``.

Why
---
With participation :math:`p` only the active clients' gradients are read by an iteration: the oracle
evaluates their minibatches alone (:meth:`~pyro_fed.algorithms.base.Algorithm.working_clients`), so that
participation 0.1 costs about a tenth of the gradient work of participation 1, with the same draws. The
target: at ``p = 0.1`` over 1,000 clients, an iteration takes at most 0.3 times as long as at ``p = 1``
(what is left is the work over every client that does not read data: quantisation, memories, sums). The
script reports the ratios; it never fails on them.

Run::

    python benchmarks/participation_cost.py            # b = 1000, traced
    python benchmarks/participation_cost.py --quick    # smoke run: b = 100, fewer draws

Results: ``benchmarks/results/participation_cost{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import pyro
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import logistic_regression  # noqa: E402

from pyro_fed import QlsdKernel, partition  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POINTS_PER_CLIENT, BATCH_SIZE, DIM, CHUNK = 64, 32, 10, 64
PARTICIPATIONS = (1.0, 0.5, 0.1)
TARGET = 0.3  # the time at p = 0.1 over the time at p = 1, at most


def data(num_clients: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic logistic-regression data: ``64 b`` points, ``d = 10`` standard normal features."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(POINTS_PER_CLIENT * num_clients, DIM, generator=generator)
    w = torch.randn(DIM, generator=generator)
    y = torch.bernoulli(torch.sigmoid(x @ w), generator=generator)
    return x, y


def time_per_iteration(participation: float, x, y, num_clients: int, mode: str, chunks: int) -> dict:
    """Seconds per iteration of QLSD++ at ``participation``, over ``chunks`` whole chunks after the first."""
    pyro.set_rng_seed(0)
    kernel = QlsdKernel(
        logistic_regression,
        partition.iid(len(y), num_clients),
        quantization_levels=2**8,
        control_variate="svrg",
        snapshot_every=1000,
        participation=participation,
        step_size=1e-4,
        batch_size=BATCH_SIZE,
        gradient_mode=mode,
        chunk_size=CHUNK,
    )
    started = time.perf_counter()
    kernel.setup(0, x, y)
    params = kernel.initial_params
    for _ in range(CHUNK):  # the first chunk prepares the iteration
        params = kernel.sample(params)
    first = time.perf_counter() - started
    started, prepared = time.perf_counter(), kernel.preparation_seconds
    for _ in range(chunks * CHUNK):
        params = kernel.sample(params)
    # a chunk whose working clients need a new width prepares the iteration again: counted apart
    preparation = kernel.preparation_seconds - prepared
    seconds = (time.perf_counter() - started - preparation) / (chunks * CHUNK)
    active = kernel.sample_stats()["active_clients"]
    return {
        "participation": participation,
        "ms_per_iteration": 1e3 * seconds,
        "first_chunk_s": first,
        "later_preparation_s": preparation,
        "mean_active_clients": float(active.mean()),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: b = 100, 2 chunks")
    parser.add_argument("--clients", type=int, help="number of clients (default 1000; 100 with --quick)")
    parser.add_argument("--mode", choices=("traced", "compiled"), default="traced")
    parser.add_argument(
        "--chunks", type=int, help="timed chunks per participation (default 16; 2 with --quick)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    num_clients = args.clients or (100 if args.quick else 1000)
    chunks = args.chunks or (2 if args.quick else 16)
    threads, default_dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    try:
        x, y = data(num_clients)
        rows = [time_per_iteration(p, x, y, num_clients, args.mode, chunks) for p in PARTICIPATIONS]
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(default_dtype)
    full = rows[0]["ms_per_iteration"]
    for row in rows:
        row["ratio_to_full"] = row["ms_per_iteration"] / full
    ratio = rows[-1]["ratio_to_full"]
    verdict = "met" if ratio <= TARGET else "NOT met"
    lines = [
        "# QLSD++ time per iteration against participation",
        "",
        f"`{' '.join(['python benchmarks/participation_cost.py', *(argv or sys.argv[1:])])}`: QLSD++ "
        f"(2^8 levels, SVRG snapshots every 1000 iterations) on a logistic regression, d = {DIM}, "
        f"{num_clients} clients x {POINTS_PER_CLIENT} points, batch {BATCH_SIZE}, "
        f"gradient_mode={args.mode!r}, float32, one thread, {chunks} chunks of {CHUNK} iterations timed "
        f"after the first; torch {torch.__version__}, {platform.machine()}. The times are those of a CPU "
        "shared with other work: compare the ratios.",
        "",
        "| participation | mean active clients | ms / iteration | × participation 1 | first chunk (s) | "
        "later preparations (s) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['participation']:g} | {r['mean_active_clients']:.1f} | {r['ms_per_iteration']:.3g} | "
        f"{r['ratio_to_full']:.3f} | {r['first_chunk_s']:.2f} | {r['later_preparation_s']:.2f} |"
        for r in rows
    ]
    lines += ["", f"Target (participation 0.1 at most {TARGET}× participation 1): {verdict} ({ratio:.3f}×)."]
    text = "\n".join(lines) + "\n"
    stem = "participation_cost_quick" if args.quick else "participation_cost"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(
        json.dumps({"rows": rows, "clients": num_clients}, indent=1) + "\n"
    )
    print(text)
    return rows


if __name__ == "__main__":
    main()
