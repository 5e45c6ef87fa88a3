"""pyro_fed: federated Langevin samplers as Pyro MCMC kernels, with ArviZ output."""

from . import datasets, partition
from .arviz import to_inference_data
from .kernels import FaldKernel, FederatedKernel
from .potential import FederatedPotential

__all__ = [
    "FaldKernel",
    "FederatedKernel",
    "FederatedPotential",
    "datasets",
    "partition",
    "to_inference_data",
]
__version__ = "0.1.0"
