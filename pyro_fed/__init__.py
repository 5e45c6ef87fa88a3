"""pyro_fed: federated Langevin samplers as Pyro MCMC kernels, with ArviZ output.

The package's folders are its layers, each importing only those below it: :mod:`~pyro_fed.engine`
(randomness, compiled iterations, draws), :mod:`~pyro_fed.data` (clients and minibatches),
:mod:`~pyro_fed.network` (where clients meet), :mod:`~pyro_fed.model` (the Pyro model split into clients),
:mod:`~pyro_fed.algorithms` (pure tensor code of the papers' algorithms and of the warm-up's rules),
:mod:`~pyro_fed.kernels` (the Pyro ``MCMCKernel`` adapters), :mod:`~pyro_fed.output` (ArviZ, metrics) and
:mod:`~pyro_fed.consensus` (one-shot consensus Monte Carlo, which needs no iterations).
"""

import importlib
import importlib.abc
import importlib.util
import sys

from . import consensus, testing
from .algorithms import convergence
from .data import datasets, partition
from .kernels import (
    DglmcKernel,
    DulaKernel,
    FaldKernel,
    FederatedKernel,
    FsgldKernel,
    PsgldKernel,
    QlsdKernel,
    SgldKernel,
    SvrgLdKernel,
    VrFaldKernel,
)
from .model.potential import FederatedPotential
from .network import compression, graphs
from .network import in_process as communication
from .output.arviz import to_inference_data

#: the modules users reach by their short names, which they keep: ``pyro_fed.partition`` is
#: ``pyro_fed.data.partition``; ``metrics`` is imported on first use, as it imports ArviZ's stack
SHORT_NAMES = {
    "communication": "network.in_process",
    "compression": "network.compression",
    "convergence": "algorithms.convergence",
    "datasets": "data.datasets",
    "distributed": "network.distributed",
    "graphs": "network.graphs",
    "metrics": "output.metrics",
    "partition": "data.partition",
}


class _ShortNameFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import pyro_fed.partition`` (and ``from pyro_fed.metrics import ...``) load the module by
    its full name."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name in SHORT_NAMES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(f".{SHORT_NAMES[spec.name.rpartition('.')[2]]}", __name__)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _ShortNameFinder())


def __getattr__(name: str):
    if name in SHORT_NAMES:
        return importlib.import_module(f".{SHORT_NAMES[name]}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DglmcKernel",
    "DulaKernel",
    "SgldKernel",
    "FaldKernel",
    "FederatedKernel",
    "FederatedPotential",
    "FsgldKernel",
    "PsgldKernel",
    "SvrgLdKernel",
    "communication",
    "compression",
    "consensus",
    "convergence",
    "datasets",
    "distributed",
    "graphs",
    "partition",
    "QlsdKernel",
    "testing",
    "to_inference_data",
    "VrFaldKernel",
]
__version__ = "0.1.0"
