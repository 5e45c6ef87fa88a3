"""The kernels' argument checks (:mod:`pyro_fed.kernels.arguments`): integers of any integer type are
integers; floats and bools where a count is due are refused naming the argument, the value and what to do."""

import numpy as np
import pytest
import torch

from pyro_fed import FaldKernel, FederatedKernel
from pyro_fed.algorithms.fald import Fald
from pyro_fed.kernels.arguments import check_positive_int
from pyro_fed.network.in_process import InProcessNetwork

from ..models import logistic_model


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3), torch.tensor(3)])
def test_a_positive_integer_of_any_integer_type(value):
    found = check_positive_int("thinning", value)
    assert found == 3 and type(found) is int


@pytest.mark.parametrize(
    "value, match",
    [
        (True, r"thinning must be a positive integer; got True\.$"),
        (np.bool_(True), r"thinning must be a positive integer; got np\.True_\.$"),
        (2.5, r"thinning must be a positive integer; got 2\.5\. Pass int\(thinning\) if it holds a whole"),
        (1e3, r"thinning must be a positive integer; got 1000\.0\. Pass int\(thinning\)"),
        (np.float64(2.0), r"thinning must be a positive integer; got np\.float64\(2\.0\)\. Pass int"),
        (torch.tensor(2.0), r"thinning must be a positive integer; got tensor\(2\.\)"),
        (torch.tensor([2]), r"thinning must be a positive integer; got tensor\(\[2\]\)"),
        (0, r"thinning must be a positive integer; got 0\.$"),
        (np.int64(-1), r"thinning must be a positive integer; got np\.int64\(-1\)\.$"),
        ("2", r"thinning must be a positive integer; got '2'\.$"),
    ],
)
def test_anything_else_is_refused_by_name(value, match):
    with pytest.raises(ValueError, match=match):
        check_positive_int("thinning", value)


def test_none_when_it_has_a_meaning():
    assert check_positive_int("thinning", None, "chosen") is None
    with pytest.raises(ValueError, match=r"thinning must be a positive integer or None \(chosen\); got 2\.5"):
        check_positive_int("thinning", 2.5, "chosen")
    with pytest.raises(ValueError, match=r"chunk_size must be a positive integer; got None"):
        check_positive_int("chunk_size", None)


def test_a_kernel_takes_numpy_integers():
    kernel = FaldKernel(logistic_model, np.int64(4), thinning=np.int64(2), chunk_size=np.int32(8))
    assert kernel.thinning == 2 and kernel.chunk_size == 8


@pytest.mark.parametrize("clients", [True, 2.5])
def test_a_kernel_given_clients_that_are_no_whole_number_says_so_when_it_is_built(clients):
    with pytest.raises(ValueError, match=rf"clients={clients}: give a whole number of clients"):
        FaldKernel(logistic_model, clients, step_size=0.01)


def test_a_kernel_written_for_the_former_contract_is_refused_where_it_is_defined():
    # its warm-up methods on the kernel would be silently ignored now that the algorithm holds them
    with pytest.raises(TypeError, match="defines adaptation_noise, make_algorithm, server_step: a kernel no"):

        class Former(FederatedKernel):
            server_step = True

            def make_algorithm(self, **common):
                return Fald(**common)

            def adaptation_noise(self, minibatch_gradients, mode, points):
                return minibatch_gradients(points)


def test_a_kernel_is_given_an_algorithm_of_settings_alone():
    with pytest.raises(TypeError, match="algorithm must be a pyro_fed.algorithms.base.Algorithm"):
        FederatedKernel(logistic_model, 4, algorithm="fald")
    bound = Fald(network=InProcessNetwork(4, 3), num_chains=1, dim=3, dtype=torch.float64, device="cpu")
    with pytest.raises(TypeError, match="built with its settings alone"):
        FederatedKernel(logistic_model, 4, algorithm=bound)
