"""Pyro ``MCMCKernel`` adapters of the federated algorithms."""

from . import chains
from .base import FederatedKernel
from .dula import DulaKernel, SgldKernel
from .fald import FaldKernel
from .qlsd import QlsdKernel
from .vr_fald import VrFaldKernel

chains.install()

__all__ = ["DulaKernel", "FaldKernel", "FederatedKernel", "QlsdKernel", "SgldKernel", "VrFaldKernel"]
