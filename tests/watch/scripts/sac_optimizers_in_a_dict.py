# watch: --check always
# Soft actor-critic as TorchRL's scripts write it: one forward makes the three losses, then each is back-propagated
# into its own optimizer, the optimizers kept in a dict by name. The entropy coefficient's loss, made before the
# actor's and the critic's updates, is back-propagated after them: one iteration, three optimizer steps.
import hashlib

import torch
from torch import nn

torch.manual_seed(0)
actor, critic = nn.Linear(3, 1), nn.Linear(4, 1)
log_alpha = torch.zeros(1, requires_grad=True)
optims = {"actor": torch.optim.Adam(actor.parameters(), lr=1e-3),
          "qvalue": torch.optim.Adam(critic.parameters(), lr=1e-3),
          "alpha": torch.optim.Adam([log_alpha], lr=1e-3)}
for step in range(4):
    obs, action = torch.randn(8, 3), torch.randn(8, 1)
    log_prob = actor(obs)
    losses = {"actor": (log_prob - critic(torch.cat([obs, action], 1)).detach()).mean(),
              "qvalue": critic(torch.cat([obs, action], 1)).pow(2).mean(),
              "alpha": -(log_alpha * log_prob.detach()).mean()}
    for name in optims:
        losses[name].backward()
        optims[name].step()
        optims[name].zero_grad()
    print(f"step {step} " + " ".join(f"{name} {loss.item():.6f}" for name, loss in losses.items()))
params = [*actor.parameters(), *critic.parameters(), log_alpha]
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest())
