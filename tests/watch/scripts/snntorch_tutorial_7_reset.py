"""snntorch's tutorial 7 (jeshraghian/snntorch, docs/tutorials/tutorial_7.rst): `init_hidden=True` Leaky neurons in an
nn.Sequential, `utils.reset(net)` before the time loop of each batch, spike counts trained by `mse_count_loss`. The
neuron is snntorch/_neurons/leaky.py and neurons.py (membrane `mem` a non-persistent buffer, the reset signal
`.clone().detach()`), with the ATan surrogate of snntorch/surrogate.py and `reset` of snntorch/utils.py. Linear layers
stand in for the convolutions, random spikes for N-MNIST."""
import torch
from torch import nn

torch.manual_seed(0)


class ATan(torch.autograd.Function):
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
    instances = []

    def __init__(self, beta, init_hidden=False, output=False):
        super().__init__()
        Leaky.instances.append(self)
        self.init_hidden, self.output = init_hidden, output
        self.register_buffer("threshold", torch.as_tensor(1.0))
        self.register_buffer("beta", torch.as_tensor(beta))
        self.register_buffer("mem", torch.zeros(0), False)

    def reset_mem(self):
        self.mem = torch.zeros_like(self.mem, device=self.mem.device)
        return self.mem

    def forward(self, input_, mem=None):
        if not mem == None:  # noqa: E711
            self.mem = mem
        if not self.mem.shape == input_.shape:
            self.mem = torch.zeros_like(input_, device=self.mem.device)
        self.reset = ATan.apply(self.mem - self.threshold, 2.0).clone().detach()
        self.mem = self.beta.clamp(0, 1) * self.mem + input_ - self.reset * self.threshold
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
    if any(isinstance(m, Leaky) for m in net._modules.values()):
        Leaky.reset_hidden()
        Leaky.detach_hidden()


def mse_count_loss(spk_out, targets, correct_rate=0.8, incorrect_rate=0.2):
    num_steps = spk_out.size(0)
    on = nn.functional.one_hot(targets, spk_out.size(-1)).float()
    wanted = (on * correct_rate + (1 - on) * incorrect_rate) * num_steps
    return nn.functional.mse_loss(spk_out.sum(0), wanted) / num_steps


net = nn.Sequential(nn.Linear(6, 32), Leaky(beta=0.5, init_hidden=True),
                    nn.Linear(32, 32), Leaky(beta=0.5, init_hidden=True),
                    nn.Linear(32, 3), Leaky(beta=0.5, init_hidden=True, output=True))
optimizer = torch.optim.Adam(net.parameters(), lr=2e-2, betas=(0.9, 0.999))
loss_fn = mse_count_loss


def forward_pass(net, data):
    spk_rec = []
    reset(net)  # resets hidden states for all LIF neurons in net
    for step in range(data.size(0)):  # data.size(0) = number of time steps
        spk_out, mem_out = net(data[step])
        spk_rec.append(spk_out)
    return torch.stack(spk_rec)


loss_hist = []
for i in range(5):
    data, targets = (torch.rand(8, 5, 6) < 0.5).float() * 4, torch.randint(0, 3, (5,))
    net.train()
    spk_rec = forward_pass(net, data)
    loss_val = loss_fn(spk_rec, targets)
    optimizer.zero_grad()
    loss_val.backward()
    optimizer.step()
    loss_hist.append(loss_val.item())
    print(f"{i} {loss_val.item()!r}")
print(repr(sum(p.double().sum().item() for p in net.parameters())))
