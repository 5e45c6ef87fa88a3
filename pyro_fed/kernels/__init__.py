"""Pyro ``MCMCKernel`` adapters of the federated algorithms."""

from .base import FederatedKernel
from .fald import FaldKernel

__all__ = ["FaldKernel", "FederatedKernel"]
