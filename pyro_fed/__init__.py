"""pyro_fed: federated Langevin samplers as Pyro MCMC kernels, with ArviZ output."""

from . import convergence, datasets, graphs, partition, testing
from .arviz import to_inference_data
from .kernels import DulaKernel, FaldKernel, FederatedKernel, QlsdKernel, SgldKernel, VrFaldKernel
from .potential import FederatedPotential

__all__ = [
    "DulaKernel",
    "SgldKernel",
    "FaldKernel",
    "FederatedKernel",
    "FederatedPotential",
    "convergence",
    "datasets",
    "graphs",
    "partition",
    "QlsdKernel",
    "testing",
    "to_inference_data",
    "VrFaldKernel",
]
__version__ = "0.1.0"
