"""pyro_fed: federated Langevin samplers as Pyro MCMC kernels, with ArviZ output."""

from . import datasets, partition, testing
from .arviz import to_inference_data
from .kernels import FaldKernel, FederatedKernel, QlsdKernel, VrFaldKernel
from .potential import FederatedPotential

__all__ = [
    "FaldKernel",
    "FederatedKernel",
    "FederatedPotential",
    "datasets",
    "partition",
    "QlsdKernel",
    "testing",
    "to_inference_data",
    "VrFaldKernel",
]
__version__ = "0.1.0"
