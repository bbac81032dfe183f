"""Spiking neural networks trained with surrogate gradients: snntorch's tutorials (jeshraghian/snntorch,
docs/tutorials/tutorial_5.rst: membranes passed explicitly, started by ``init_leaky()`` in ``forward``, the loss summed
over the time steps; tutorial_7.rst: ``init_hidden=True`` neurons in an ``nn.Sequential``, ``utils.reset(net)`` before
each batch), with the neuron of snntorch/_neurons/leaky.py and neurons.py (the reset signal ``.clone().detach()``),
the ATan surrogate of snntorch/surrogate.py and ``reset`` of snntorch/utils.py ported as they are written."""
import re
import warnings

import pytest
import torch
from torch import nn

from safeloop import CarriedGraphError, GraphGuard, GraphLeakWarning
from tests.guard.runs import quietly, watched

MODES = ["always", "auto", "off"]


class ATan(torch.autograd.Function):
    """snntorch.surrogate.ATan: a Heaviside step forward, the arc-tangent's derivative backward."""

    @staticmethod
    def forward(ctx, input_, alpha):
        ctx.save_for_backward(input_)
        ctx.alpha = alpha
        return (input_ > 0).float()

    @staticmethod
    def backward(ctx, grad_output):
        (input_,) = ctx.saved_tensors
        grad_input = grad_output.clone()
        return ctx.alpha / 2 / (1 + (torch.pi / 2 * ctx.alpha * input_).pow_(2)) * grad_input, None


class Leaky(nn.Module):
    """snntorch.Leaky (reset_delay=True, no inhibition or quantization): ``mem`` a non-persistent buffer, every
    instance kept in the class's ``instances``, as ``SpikingNeuron`` keeps them."""
    instances = []

    def __init__(self, beta, init_hidden=False, output=False, reset_mechanism="subtract", detach_reset=True):
        super().__init__()
        Leaky.instances.append(self)
        self.init_hidden, self.output, self.reset_mechanism = init_hidden, output, reset_mechanism
        self.detach_reset = detach_reset
        self.register_buffer("threshold", torch.as_tensor(1.0))
        self.register_buffer("beta", torch.as_tensor(beta))
        self.register_buffer("mem", torch.zeros(0), False)

    def reset_mem(self):
        self.mem = torch.zeros_like(self.mem, device=self.mem.device)
        return self.mem

    def init_leaky(self):
        """Deprecated, use :class:`Leaky.reset_mem` instead"""
        return self.reset_mem()

    def mem_reset(self, mem):
        reset = ATan.apply(mem - self.threshold, 2.0).clone()
        return reset.detach() if self.detach_reset else reset

    def forward(self, input_, mem=None):
        if not mem == None:  # noqa: E711 (as snntorch writes it)
            self.mem = mem
        if not self.mem.shape == input_.shape:
            self.mem = torch.zeros_like(input_, device=self.mem.device)
        self.reset = self.mem_reset(self.mem)
        if self.reset_mechanism == "subtract":
            self.mem = self.beta.clamp(0, 1) * self.mem + input_ - self.reset * self.threshold
        else:
            self.mem = (1 - self.reset) * self.mem
            self.mem = self.beta.clamp(0, 1) * self.mem + input_
        spk = ATan.apply(self.mem - self.threshold, 2.0)
        if self.output:
            return spk, self.mem
        return spk if self.init_hidden else (spk, self.mem)

    @classmethod
    def reset_hidden(cls):
        for layer in cls.instances:
            layer.mem = torch.zeros_like(layer.mem, device=layer.mem.device)

    @classmethod
    def detach_hidden(cls):
        for layer in cls.instances:
            layer.mem.detach_()


def reset(net):
    """snntorch.utils.reset: every Leaky's membrane set to zeros and detached."""
    if any(isinstance(m, Leaky) for m in net._modules.values()):
        Leaky.reset_hidden()
        Leaky.detach_hidden()


@pytest.fixture(autouse=True)
def no_neurons_kept():
    """``Leaky.instances`` is global, as snntorch's is: each test starts with none."""
    Leaky.instances = []
    yield
    Leaky.instances = []


class Net(nn.Module):
    """tutorial_5's network: membranes started in ``forward``, the last layer's recorded over time."""

    def __init__(self, num_steps=4, **kwargs):
        super().__init__()
        self.num_steps = num_steps
        self.fc1, self.lif1 = nn.Linear(6, 8), Leaky(beta=0.95, **kwargs)
        self.fc2, self.lif2 = nn.Linear(8, 3), Leaky(beta=0.95, **kwargs)

    def forward(self, x):
        mem1, mem2 = self.lif1.init_leaky(), self.lif2.init_leaky()
        spk2_rec, mem2_rec = [], []
        for _ in range(self.num_steps):
            spk1, mem1 = self.lif1(self.fc1(x), mem1)
            spk2, mem2 = self.lif2(self.fc2(spk1), mem2)
            spk2_rec.append(spk2)
            mem2_rec.append(mem2)
        return torch.stack(spk2_rec, dim=0), torch.stack(mem2_rec, dim=0)


def tutorial_5(check: str | None, loss_kept: bool = False, **kwargs) -> list[torch.Tensor]:
    """Four batches, a test forward under ``no_grad`` after each; ``loss_kept``: ``loss_hist.append(loss_val)``
    without ``.item()``."""
    torch.manual_seed(0)
    net = Net(**kwargs)
    loss = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(net.parameters(), lr=5e-2, betas=(0.9, 0.999))
    guard = GraphGuard(net, optimizer, check=check) if check else None
    loss_hist = []
    for _ in range(4):
        data, targets = torch.randn(5, 6) * 3, torch.randint(0, 3, (5,))
        net.train()
        spk_rec, mem_rec = net(data)
        loss_val = torch.zeros((1), dtype=torch.float)
        for step in range(net.num_steps):
            loss_val += loss(mem_rec[step], targets)
        optimizer.zero_grad()
        guard.backward(loss_val) if guard else loss_val.backward()
        optimizer.step()
        loss_hist.append(loss_val if loss_kept else loss_val.item())
        with torch.no_grad():
            net.eval()
            _, test_mem = net(torch.randn(5, 6))
    return [p.detach().clone() for p in net.parameters()]


def sequential(**kwargs) -> nn.Sequential:
    """tutorial_7's network, linear layers for its convolutions."""
    return nn.Sequential(nn.Linear(6, 8), Leaky(beta=0.5, init_hidden=True, **kwargs),
                         nn.Linear(8, 8), Leaky(beta=0.5, init_hidden=True, **kwargs),
                         nn.Linear(8, 3), Leaky(beta=0.5, init_hidden=True, output=True, **kwargs))


def mse_count_loss(spk_out, targets, correct_rate=0.8, incorrect_rate=0.2):
    """snntorch.functional.mse_count_loss: spike counts against the counts wanted, over the time steps."""
    num_steps = spk_out.size(0)
    on = nn.functional.one_hot(targets, spk_out.size(-1)).float()
    wanted = (on * correct_rate + (1 - on) * incorrect_rate) * num_steps
    return nn.functional.mse_loss(spk_out.sum(0), wanted) / num_steps


def tutorial_7(check: str | None, reset_net: bool = True, fix: str = "", **kwargs) -> list[torch.Tensor]:
    """Four batches of four time steps; ``reset_net``: ``utils.reset(net)`` in ``forward_pass``, as written;
    ``fix``: a fix of the guard's applied where it says, the code it gives with ``reset_net`` left out."""
    torch.manual_seed(0)
    net = sequential(**kwargs)
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-2, betas=(0.9, 0.999))
    guard = GraphGuard(net, optimizer, check=check) if check else None

    def forward_pass(net, data):
        spk_rec = []
        if reset_net:
            reset(net)
        for step in range(data.size(0)):
            spk_out, mem_out = net(data[step])
            spk_rec.append(spk_out)
        return torch.stack(spk_rec)

    loss_hist = []
    for _ in range(4):
        data, targets = torch.randn(4, 5, 6) * 3, torch.randint(0, 3, (5,))
        net.train()
        if fix.startswith("net"):
            exec(fix)  # before each batch's forward
        spk_rec = forward_pass(net, data)
        loss_val = mse_count_loss(spk_rec, targets)
        optimizer.zero_grad()
        guard.backward(loss_val) if guard else loss_val.backward()
        optimizer.step()
        loss_hist.append(loss_val.item())
        if fix.startswith("detach "):
            exec(fix[len("detach "):])  # at the end of each step
    return [p.detach().clone() for p in net.parameters()]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("check", MODES)
@pytest.mark.parametrize("mechanism", ["subtract", "zero"])
def test_tutorial_5_membranes_started_in_forward_are_quiet_and_bit_identical(check, mechanism):
    assert same(quietly(tutorial_5, check, reset_mechanism=mechanism), tutorial_5(None, reset_mechanism=mechanism))


@pytest.mark.parametrize("check", MODES)
@pytest.mark.parametrize("mechanism", ["subtract", "zero"])
def test_tutorial_7_reset_before_each_batch_is_quiet_and_bit_identical(check, mechanism):
    assert same(quietly(tutorial_7, check, reset_mechanism=mechanism), tutorial_7(None, reset_mechanism=mechanism))


@pytest.mark.parametrize("check", MODES)
def test_a_reset_signal_left_attached_is_other_maths_not_a_mistake(check):
    """Without the ``.detach()`` of ``mem_reset`` the gradient flows through the reset too (snntorch's own option
    before it detached by default): different gradients, no graph kept across batches."""
    assert same(quietly(tutorial_7, check, detach_reset=False), tutorial_7(None, detach_reset=False))
    assert same(quietly(tutorial_5, check, detach_reset=False), tutorial_5(None, detach_reset=False))


@pytest.mark.parametrize("check", MODES)
def test_correct_loops_under_watch_are_quiet_and_bit_identical(check):
    assert same(watched(lambda: tutorial_7(None), check), tutorial_7(None))
    assert same(watched(lambda: tutorial_5(None), check), tutorial_5(None))


def test_unreset_membranes_raise_as_torch_does_in_a_bare_loop():
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        tutorial_7(None, reset_net=False)


def unreset(check: str = "always") -> CarriedGraphError:
    with pytest.raises(CarriedGraphError) as caught:
        tutorial_7(check, reset_net=False)
    return caught.value


@pytest.mark.parametrize("check", ["always", "auto"])
def test_unreset_membranes_are_stopped_at_the_second_batch_naming_a_membrane(check):
    error = unreset(check)
    assert "step 2" in str(error) and re.search(r"held by `net\[[135]\]\.mem`", str(error)), error


def test_unreset_membranes_are_told_to_be_reset_every_layer_at_once_and_so_train_as_the_tutorial():
    """Each layer keeps its own membrane: a fix for the one named alone would stop the next run at the next."""
    fix = unreset().fixes[0]
    calls = "net[1].reset_mem(); net[3].reset_mem(); net[5].reset_mem()"
    assert f"start the state from rest before each batch's forward (`{calls}`)" in fix, fix
    assert "utils.reset" not in fix, fix  # a layer of no library known
    assert same(quietly(tutorial_7, "always", reset_net=False, fix=calls), tutorial_7(None))


def test_unreset_snntorch_membranes_are_told_the_library_reset(monkeypatch):
    monkeypatch.setattr(Leaky, "__module__", "snntorch._neurons.leaky")
    fix = unreset().fixes[0]
    assert fix.endswith("; `snntorch.utils.reset(net)` does it for every layer of the network"), fix


def test_unreset_membranes_detached_instead_run_quiet():
    """Valid maths, if not the tutorial's: each batch starts from the last one's membranes."""
    detach = re.search(r"`(.*)`", unreset().fixes[1]).group(1)
    assert detach.count(".detach()") == 3, detach
    quietly(tutorial_7, "always", reset_net=False, fix="detach " + detach)


@pytest.mark.parametrize("check", ["always", "auto"])
def test_losses_kept_across_batches_are_warned(check):
    with pytest.warns(GraphLeakWarning, match="loss_hist"):
        tutorial_5(check, loss_kept=True)
