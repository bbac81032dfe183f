"""spikingjelly's LIF MNIST example (fangwei123456/spikingjelly, activation_based/examples/lif_fc_mnist.py): inputs
coded by Poisson spikes at each of T time steps, firing rates averaged over time against one-hot labels, and
`functional.reset_net(net)` after each batch. The neuron is activation_based/base.py's `MemoryModule` (the membrane `v`
kept in `_memories`, read and written through `__getattr__`/`__setattr__`, `reset()` setting it back to 0.) with the
LIF charge of neuron/lif.py and the hard reset of neuron/base_node.py (not detached by default), the ATan surrogate
and `reset_net` of functional/net_config.py. Random 4x4 images stand in for MNIST."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class ATan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return (x >= 0).to(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return ctx.alpha / 2 / (1 + (torch.pi / 2 * ctx.alpha * x).pow_(2)) * grad_output, None


class MemoryModule(nn.Module):
    def __init__(self):
        super().__init__()
        self._memories, self._memories_rv = {}, {}

    def register_memory(self, name, value):
        assert not hasattr(self, name), f"{name} has been set as a member variable!"
        self._memories[name] = value
        self._memories_rv[name] = value

    def reset(self):
        for key in self._memories.keys():
            self._memories[key] = self._memories_rv[key]

    def __getattr__(self, name):
        if "_memories" in self.__dict__:
            memories = self.__dict__["_memories"]
            if name in memories:
                return memories[name]
        return super().__getattr__(name)

    def __setattr__(self, name, value):
        _memories = self.__dict__.get("_memories")
        if _memories is not None and name in _memories:
            _memories[name] = value
        else:
            super().__setattr__(name, value)


class LIFNode(MemoryModule):
    def __init__(self, tau=2.0, v_threshold=1.0, v_reset=0.0, detach_reset=False):
        super().__init__()
        self.register_memory("v", v_reset)
        self.tau, self.v_threshold, self.v_reset, self.detach_reset = tau, v_threshold, v_reset, detach_reset

    def forward(self, x):
        self.v = self.v + (x - self.v) / self.tau  # neuronal_charge
        spike = ATan.apply(self.v - self.v_threshold, 2.0)  # neuronal_fire
        spike_d = spike.detach() if self.detach_reset else spike  # neuronal_reset
        self.v = spike_d * self.v_reset + (1.0 - spike_d) * self.v
        return spike


def reset_net(net: nn.Module):
    for m in net.modules():
        if hasattr(m, "reset"):
            m.reset()


class SNN(nn.Module):
    def __init__(self, tau):
        super().__init__()
        self.layer = nn.Sequential(nn.Flatten(), nn.Linear(16, 10, bias=False), LIFNode(tau=tau))

    def forward(self, x: torch.Tensor):
        return self.layer(x)


net = SNN(tau=2.0)
optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
T = 8
for epoch in range(5):
    net.train()
    img, label = torch.rand(6, 4, 4) * 4, torch.randint(0, 10, (6,))
    optimizer.zero_grad()
    label_onehot = F.one_hot(label, 10).float()
    out_fr = 0.0
    for t in range(T):
        encoded_img = (torch.rand_like(img) <= img / 4).to(img) * 4  # encoding.PoissonEncoder, scaled
        out_fr += net(encoded_img)
    out_fr = out_fr / T
    loss = F.mse_loss(out_fr, label_onehot)
    loss.backward()
    optimizer.step()
    reset_net(net)
    print(f"{epoch} {loss.item()!r} {(out_fr.argmax(1) == label).float().sum().item()!r}")
print(repr(sum(p.double().sum().item() for p in net.parameters())))
