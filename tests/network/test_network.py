"""The network is where the iterations' clients meet: a network passed as ``network=`` sees the
iterations' reductions over the clients, and one that holds the clients in two halves (as two processes
would, each reducing its own and combining) gives the in-process draws to rounding."""

import warnings

import pytest
import torch
from pyro.infer import MCMC

from pyro_fed import DulaKernel, FaldKernel, QlsdKernel, SgldKernel, VrFaldKernel
from pyro_fed.network.in_process import InProcessNetwork

from ..models import logistic_data, logistic_model

NUM_CLIENTS = 6


class RecordingNetwork(InProcessNetwork):
    """The in-process network, noting which operation each call was (at tracing: once per prepared
    iteration; eager: every iteration)."""

    def __init__(self):
        super().__init__()
        self.calls = set()

    def __getattribute__(self, name):
        operations = (
            "sum",
            "sums",
            "average",
            "average_where",
            "stacked",
            "everywhere",
            "neighbours",
            "maximum",
        )
        if name in (*operations, "held", "gather", "share"):
            object.__getattribute__(self, "calls").add(name)
        return object.__getattribute__(self, name)


class HalvesNetwork(InProcessNetwork):
    """The clients held in two halves: every reduction is each half's, combined, as two processes holding
    half the clients each would compute it (a neighbour exchange brings D-ULA's agents their neighbours:
    here, all the agents, as in one process)."""

    def _halves(self, values, dim):
        half = self.num_clients // 2
        return values.narrow(dim, 0, half), values.narrow(dim, half, values.shape[dim] - half)

    def sum(self, values, dim=-2):
        first, second = self._halves(values, dim)
        return first.sum(dim) + second.sum(dim)

    def average(self, uploads):
        return self.sum(uploads) / self.num_clients

    def maximum(self, values, dim=-1):
        first, second = self._halves(values, dim)
        return torch.maximum(first.amax(dim), second.amax(dim))


class WireNetwork(InProcessNetwork):
    """The in-process network whose every reduction leaves torch, as a message over a socket would (its
    tensors through NumPy's bytes and back): it cannot run inside a traced iteration, and says so."""

    traceable = False

    @staticmethod
    def _wire(values):
        return torch.from_numpy(values.detach().cpu().numpy().copy()).to(values.device)

    def sum(self, values, dim=-2):
        return super().sum(self._wire(values), dim)

    def average(self, uploads):
        return super().average(self._wire(uploads))

    def maximum(self, values, dim=-1):
        return super().maximum(self._wire(values), dim)

    def stacked(self, part):
        return super().stacked(self._wire(part))

    def everywhere(self, flags):
        return super().everywhere(self._wire(flags))

    def neighbours(self, graph, agents):
        return super().neighbours(graph, self._wire(agents))


class UndeclaredWireNetwork(WireNetwork):
    """The wire network, saying that it can be traced, which it cannot."""

    traceable = True


KERNELS = {
    "FALD": (
        lambda **kw: FaldKernel(logistic_model, NUM_CLIENTS, comm_prob=0.5, batch_size=4, **kw),
        {"average", "everywhere", "stacked"},
    ),
    "VR-FALD*": (
        lambda **kw: VrFaldKernel(logistic_model, NUM_CLIENTS, batch_size=4, refresh_prob=0.2, **kw),
        {"average", "everywhere", "stacked"},
    ),
    "QLSD++": (
        lambda **kw: QlsdKernel(
            logistic_model, NUM_CLIENTS, control_variate="svrg", batch_size=4, snapshot_every=5, **kw
        ),
        {"sums", "everywhere"},
    ),
    "D-ULA": (
        lambda **kw: DulaKernel(logistic_model, NUM_CLIENTS, **kw),
        {"neighbours", "stacked", "everywhere"},
    ),
    "SGLD": (lambda **kw: SgldKernel(logistic_model, batch_size=4, **kw), {"stacked", "everywhere"}),
}


def draws(name, network=None, gradient_mode="traced", **options):
    make, _ = KERNELS[name]
    kernel = make(gradient_mode=gradient_mode, network=network, **({"step_size": 0.01} | options))
    mcmc = MCMC(kernel, num_samples=30, warmup_steps=10, num_chains=2, disable_progbar=True)
    torch.manual_seed(0)
    mcmc.run(*logistic_data(num_data=60, dim=3))
    return mcmc.get_samples(group_by_chain=True)["w"], kernel


@pytest.mark.parametrize("name", KERNELS)
def test_the_iterations_meet_through_the_given_network(name):
    network = RecordingNetwork()
    _, kernel = draws(name, network)
    assert kernel.network is network
    assert KERNELS[name][1] <= network.calls, network.calls
    # the set-up: the global client sizes and held clients, the first holder's seed and initial points
    assert {"held", "gather", "share"} <= network.calls, network.calls


@pytest.mark.parametrize("name", KERNELS)
def test_clients_held_in_two_halves_give_the_in_process_draws(name):
    # the same ops reassociated (the halves' sums added): equal to float64 rounding, many orders below
    # the draws' own scale of 0.1-1
    in_process, _ = draws(name)
    halves, kernel = draws(name, HalvesNetwork())
    assert isinstance(kernel.network, HalvesNetwork)
    torch.testing.assert_close(halves, in_process, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["FALD", "QLSD++"])
def test_the_warm_up_sums_over_clients_through_the_network(name):
    # the automatic step, preconditioner, minibatch and thinning: the mode search, the Hessians, the
    # stiffness and the noise reduce over the clients through the network, to the same choice and draws
    network = RecordingNetwork()
    in_process, kernel = draws(name, network, step_size=None)
    # FALD's clients step on their own: the largest of their stiffnesses; QLSD's server on the sum
    assert ({"sum", "maximum"} if name == "FALD" else {"sum"}) <= network.calls
    assert kernel.adaptation is not None
    halves, halved = draws(name, HalvesNetwork(), step_size=None)
    assert halved.adaptation.step_size == pytest.approx(kernel.adaptation.step_size, rel=1e-9)
    torch.testing.assert_close(halves, in_process, rtol=1e-8, atol=1e-8)


def test_a_network_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match="network must be a pyro_fed.network.base.Network"):
        FaldKernel(logistic_model, 4, network="gloo")


@pytest.mark.parametrize("name", ["FALD", "QLSD++", "D-ULA"])
def test_a_network_that_cannot_be_traced_runs_its_meetings_eagerly_and_the_rest_traced(name):
    # FALD's local steps between its rounds (comm_prob 0.5) run traced, its rounds eagerly through the
    # network; QLSD++ and D-ULA meet at every iteration, all eager; the warm-up too, automatic here (its
    # pilot eager). The same draws as the in-process network's eager run, to float64 rounding (a traced
    # iteration is the eager one's operations, reassociated at most); no fallback warning. (Were it to say
    # traceable = True, the tracer would keep its first meeting's values as constants: FALD's draws were
    # then off by 2, without a word.)
    expected, reference = draws(name, gradient_mode="eager", step_size=None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(trace|compile)", category=UserWarning)
        wired, kernel = draws(name, WireNetwork(), step_size=None)
    assert kernel.current_step_size == pytest.approx(reference.current_step_size, rel=1e-9)
    torch.testing.assert_close(wired, expected, rtol=1e-9, atol=1e-9)
    modes = {variant: prepared.mode for (variant, *_), prepared in kernel.runner.engine()._prepared.items()}
    assert modes[(False, True)] == "eager"  # the meetings
    if name == "FALD":
        assert modes[(False, False)] != "eager"  # the local steps, traced
    else:
        assert (False, False) not in modes  # nothing local to trace


@pytest.mark.parametrize("name", ["FALD", "D-ULA"])
def test_a_network_that_leaves_torch_without_saying_so_is_caught_as_it_is_traced(name):
    # its operations return values the trace would keep as constants: the tracing stops at the first one,
    # naming it, and the iterations that meet run eagerly, as they would had it said traceable = False:
    # the in-process network's eager draws, to float64 rounding (off by 2 before this check)
    expected, _ = draws(name, gradient_mode="eager", step_size=None)
    message = r"UndeclaredWireNetwork\.\w+ returned a value that the traced iteration does not compute"
    with pytest.warns(UserWarning, match=message + r".*traceable = False"):
        wired, kernel = draws(name, UndeclaredWireNetwork(), step_size=None)
    torch.testing.assert_close(wired, expected, rtol=1e-9, atol=1e-9)
    modes = {variant: prepared.mode for (variant, *_), prepared in kernel.runner.engine()._prepared.items()}
    assert modes[(False, True)] == "eager"
