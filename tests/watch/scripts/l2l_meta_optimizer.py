# Trimmed from chenwydj/learning-to-learn-by-gradient-descent-by-gradient-descent, Grad_buffer.ipynb (`do_fit`):
# "learning to learn by gradient descent by gradient descent". An LSTM proposes the updates of an optimizee whose
# weights are plain tensors carried with their graph across `unroll` steps; each step's loss is back-propagated (with
# retain_graph) for the gradient the LSTM reads, and the unrolled sum of the losses trains the LSTM. Every `unroll`
# steps the weights and the LSTM states are cut (`detach_var`). Correct: that per-step backward reaches none of the
# meta-optimizer's parameters, but the sum back-propagated after it does, through the same weights.
import torch
import torch.nn as nn

torch.manual_seed(0)


class Optimizer(nn.Module):
    def __init__(self, hidden_sz=8):
        super().__init__()
        self.hidden_sz = hidden_sz
        self.recurs = nn.LSTMCell(1, hidden_sz)
        self.recurs2 = nn.LSTMCell(hidden_sz, hidden_sz)
        self.output = nn.Linear(hidden_sz, 1)

    def forward(self, inp, hidden, cell):
        hidden0, cell0 = self.recurs(inp, (hidden[0], cell[0]))
        hidden1, cell1 = self.recurs2(hidden0, (hidden[1], cell[1]))
        return self.output(hidden1), (hidden0, hidden1), (cell0, cell1)


class QuadraticLoss:
    def __init__(self):
        self.W = torch.randn(4, 4)
        self.y = torch.randn(4)

    def get_loss(self, theta):
        return torch.sum((self.W.matmul(theta) - self.y) ** 2)


class QuadOptimizee(nn.Module):
    def __init__(self, theta=None):
        super().__init__()
        self.theta = theta if theta is not None else torch.zeros(4, requires_grad=True)

    def forward(self, target):
        return target.get_loss(self.theta)

    def all_named_parameters(self):
        return [("theta", self.theta)]


def detach_var(v):
    var = v.detach().clone().requires_grad_(True)
    var.retain_grad()
    return var


def do_fit(opt_net, meta_opt, unroll, optim_it, out_mul):
    target = QuadraticLoss()
    optimizee = QuadOptimizee()
    n_params = 4
    hidden_states = [torch.zeros(n_params, opt_net.hidden_sz) for _ in range(2)]
    cell_states = [torch.zeros(n_params, opt_net.hidden_sz) for _ in range(2)]
    meta_opt.zero_grad()
    all_losses = None
    all_losses_ever = []
    for iteration in range(1, optim_it + 1):
        loss = optimizee(target)
        if all_losses is None:
            all_losses = loss
        else:
            all_losses += loss
        all_losses_ever.append(round(loss.item(), 6))
        loss.backward(retain_graph=True)
        offset = 0
        result_params = {}
        hidden_states2 = [torch.zeros(n_params, opt_net.hidden_sz) for _ in range(2)]
        cell_states2 = [torch.zeros(n_params, opt_net.hidden_sz) for _ in range(2)]
        for name, p in optimizee.all_named_parameters():
            cur_sz = p.numel()
            gradients = detach_var(p.grad.view(cur_sz, 1))
            updates, new_hidden, new_cell = opt_net(gradients, [h[offset:offset + cur_sz] for h in hidden_states],
                                                    [c[offset:offset + cur_sz] for c in cell_states])
            for i in range(len(new_hidden)):
                hidden_states2[i][offset:offset + cur_sz] = new_hidden[i]
                cell_states2[i][offset:offset + cur_sz] = new_cell[i]
            result_params[name] = p + updates.view(*p.size()) * out_mul
            result_params[name].retain_grad()
            offset += cur_sz
        if iteration % unroll == 0:
            meta_opt.zero_grad()
            all_losses.backward()
            meta_opt.step()
            all_losses = None
            optimizee = QuadOptimizee(**{k: detach_var(v) for k, v in result_params.items()})
            hidden_states = [detach_var(v) for v in hidden_states2]
            cell_states = [detach_var(v) for v in cell_states2]
        else:
            optimizee = QuadOptimizee(**result_params)
            hidden_states, cell_states = hidden_states2, cell_states2
    return all_losses_ever


opt_net = Optimizer()
meta_opt = torch.optim.Adam(opt_net.parameters(), lr=1e-2)
for epoch in range(2):
    print(epoch, do_fit(opt_net, meta_opt, unroll=3, optim_it=9, out_mul=0.1))
print([round(p.sum().item(), 6) for p in opt_net.parameters()])
