"""Pyro ``MCMCKernel`` adapters of the federated algorithms."""

from . import chains
from .base import FederatedKernel
from .fald import FaldKernel
from .qlsd import QlsdKernel
from .vr_fald import VrFaldKernel

chains.install()

__all__ = ["FaldKernel", "FederatedKernel", "QlsdKernel", "VrFaldKernel"]
