"""Titanic survival with the clients in separate processes: the same kernels over ``torch.distributed``.

The 2201 people aboard the Titanic are spread over 10 label-skewed sites (clients). Here every process
holds a block of the sites and only their rows: it joins the process group ``torchrun`` starts, computes
the same global assignment of passengers to sites, asks the network which sites are its own, loads their
rows and runs the ordinary ``MCMC(FaldKernel(model, ..., network=network))`` on them. Only parameter
vectors and gradients cross between the processes, never data; every process gets the same draws, equal to
those of one process holding all the sites (to float64 rounding), for the same seed.

Run it on a laptop, two processes of five sites each (the draws are written by rank 0)::

    torchrun --nproc-per-node=2 examples/distributed.py --out output/distributed
    python examples/distributed.py --out output/one_process   # the same run in one process

With ``--checkpoint DIR`` each process keeps a checkpoint of its run in ``DIR``: the same command started
again after an interruption (a Ctrl-C, a killed process, or ``torchrun --max-restarts=3`` restarting the
group by itself) resumes the run, to the same final draws.

On several machines, start the same command on each with ``--nnodes``, ``--node-rank`` and a rendezvous
address (``--rdzv-endpoint``) on a trusted network: the rendezvous has no authentication.

Reference: Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a unified
theory and new algorithms*, AISTATS 2023 (the Titanic experiment of Section 5).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC

import pyro_fed

NUM_CLIENTS = 10
DIRICHLET_ALPHA = 0.5  # label skew of the split: small alpha, very different clients


def model(x, y=None):
    """Bayesian logistic regression, w ~ N(0, I), as written for NUTS: each process runs it on its clients'
    rows of the data it loaded."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    logits = x @ w
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("output/distributed"))
    parser.add_argument("--smoke", action="store_true", help="tiny chains, for the tests")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="a folder for the run's checkpoints (one file per process): started again, the run resumes",
    )
    args = parser.parse_args(argv)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)  # one core per process
    # under torchrun: join its group; alone: every client in this process
    network = pyro_fed.distributed.join() if "RANK" in os.environ else None
    rank = 0 if network is None else network.rank

    # every process computes the same global assignment (a seeded split); this demo reads the shipped data
    # and keeps its rows, where a site would read its own
    x_all, y_all = pyro_fed.datasets.titanic()
    assignment = pyro_fed.partition.dirichlet(y_all, num_clients=NUM_CLIENTS, alpha=DIRICHLET_ALPHA, seed=0)
    if network is None:
        rows, clients = torch.arange(len(y_all)), assignment
    else:
        rows, clients = pyro_fed.distributed.shard(assignment, len(y_all), network)
    num_samples, warmup_steps = (20, 10) if args.smoke else (1000, 300)
    checkpoint = None if args.checkpoint is None else args.checkpoint / f"fald-{rank}.pt"
    kernel = pyro_fed.FaldKernel(
        model, clients, comm_prob=0.5, batch_size=64, network=network, checkpoint=checkpoint
    )
    # (the progress bar shows on rank 0 only: every rank computes the same draws)
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps)
    pyro.set_rng_seed(0)
    mcmc.run(x_all[rows], y_all[rows])

    draws = mcmc.get_samples()["w"]
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"w": draws}, args.out / "draws.pt")
        held = "all" if network is None else f"{len(kernel.potential.client_sizes)} per process"
        print(f"{NUM_CLIENTS} clients ({held}), {num_samples} draws, step {kernel.current_step_size:.3g}")
        for name, mean, sd in zip(pyro_fed.datasets.feature_names, draws.mean(0), draws.std(0), strict=True):
            print(f"  w[{name}]: {mean:+.3f} ± {sd:.3f}")
        print(f"uploaded {kernel.diagnostics()['uploaded bits'] / 8e6:.2f} MB; draws in {args.out}/draws.pt")
    return {"w": draws}


if __name__ == "__main__":
    main()
