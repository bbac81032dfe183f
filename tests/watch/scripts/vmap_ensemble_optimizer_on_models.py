# vmap_ensemble_backward.py (pytorch/tutorials, intermediate_source/ensembling.py, trained) with the optimizer built
# on the original models' parameters instead of the stacked ones that functional_call uses: the backward fills the
# stacked tensors' .grad, which no optimizer holds, and nothing trains.
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

torch.manual_seed(0)


class SimpleMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


models = [SimpleMLP() for _ in range(4)]
params, buffers = stack_module_state(models)
base_model = copy.deepcopy(models[0]).to("meta")


def fmodel(params, buffers, x):
    return functional_call(base_model, (params, buffers), (x,))


optimizer = torch.optim.Adam([p for m in models for p in m.parameters()], lr=1e-2)
for step in range(5):
    minibatches, targets = torch.randn(4, 8, 6), torch.randint(0, 3, (4, 8))
    predictions = vmap(fmodel)(params, buffers, minibatches)
    loss = F.cross_entropy(predictions.flatten(0, 1), targets.flatten(), reduction="sum") / 8
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
print(params["fc1.weight"].sum(dim=(1, 2)).tolist())
