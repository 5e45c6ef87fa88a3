"""Pyro ``MCMCKernel`` adapters of the federated algorithms."""

from .base import FederatedKernel
from .fald import FaldKernel
from .vr_fald import VrFaldKernel

__all__ = ["FaldKernel", "FederatedKernel", "VrFaldKernel"]
