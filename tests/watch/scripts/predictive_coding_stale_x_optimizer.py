# Trimmed from the predictive_coding library's PCTrainer.train_on_batch (YuhangSong/Prospective-Configuration,
# predictive_coding/pc_trainer.py and pc_layer.py): each PCLayer holds its value node `_x`, a Parameter sampled anew
# from the prediction at the first inference step of every batch; an optimizer over the value nodes, made again for
# each batch, takes T inference steps on the energy, and the weights' optimizer steps at the last one. The mistake:
# the value nodes' optimizer made once, for the first batch's nodes: the later batches' inference moves nothing.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class PCLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self._x = None
        self.is_sample_x = False
        self._energy = None

    def forward(self, mu):
        if self.training:
            if self.is_sample_x or self._x is None:
                self._x = nn.Parameter(mu.detach().clone(), requires_grad=True)
                self.is_sample_x = False
            self._energy = 0.5 * (mu - self._x).pow(2).sum()
            return self._x
        return mu


model = nn.Sequential(nn.Linear(8, 16), PCLayer(), nn.ReLU(), nn.Linear(16, 16), PCLayer(), nn.ReLU(), nn.Linear(16, 4))
pc_layers = [m for m in model.modules() if isinstance(m, PCLayer)]
optimizer_p = torch.optim.Adam([p for n, p in model.named_parameters() if not n.endswith("_x")], lr=1e-3)
data = [(torch.randn(8, 8), torch.randint(0, 4, (8,))) for _ in range(3)]
T = 4
optimizer_x = None

for epoch in range(2):
    for inputs, targets in data:
        for t in range(T):
            if t == 0:
                for layer in pc_layers:
                    layer.is_sample_x = True
            outputs = model(inputs)
            if optimizer_x is None:  # Bug: made again for each batch in PCTrainer
                optimizer_x = torch.optim.SGD([layer._x for layer in pc_layers], lr=0.1)
            if t == 0:
                optimizer_p.zero_grad()
            loss = F.cross_entropy(outputs, targets, reduction="sum")
            overall = loss + sum(layer._energy for layer in pc_layers)
            optimizer_x.zero_grad()
            overall.backward()
            optimizer_x.step()
            if t == T - 1:
                optimizer_p.step()
        print(f"{overall.item():.6f}")
print([round(p.sum().item(), 6) for n, p in model.named_parameters() if not n.endswith("_x")])
