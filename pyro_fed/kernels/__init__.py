"""Pyro ``MCMCKernel`` adapters of the federated algorithms."""

from . import chains
from .base import FederatedKernel
from .dglmc import DglmcKernel
from .dula import DulaKernel, SgldKernel
from .fald import FaldKernel
from .fsgld import FsgldKernel
from .psgld import PsgldKernel
from .qlsd import QlsdKernel
from .svrg_ld import SvrgLdKernel
from .vr_fald import VrFaldKernel

chains.install()

__all__ = [
    "DglmcKernel",
    "DulaKernel",
    "FaldKernel",
    "FederatedKernel",
    "FsgldKernel",
    "PsgldKernel",
    "QlsdKernel",
    "SgldKernel",
    "SvrgLdKernel",
    "VrFaldKernel",
]
