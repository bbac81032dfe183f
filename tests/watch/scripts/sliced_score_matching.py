# Sliced score matching (ermongroup/sliced_score_matching losses/sliced_sm.py, sliced_score_estimation_vr): the loss
# holds the gradient torch.autograd.grad takes, with create_graph=True, of the score along random directions.
import torch
from torch import autograd, nn


def sliced_score_estimation_vr(score_net, samples, n_particles=1):
    dup_samples = samples.unsqueeze(0).expand(n_particles, *samples.shape).contiguous().view(-1, *samples.shape[1:])
    dup_samples.requires_grad_(True)
    vectors = torch.randn_like(dup_samples)
    grad1 = score_net(dup_samples)
    gradv = torch.sum(grad1 * vectors)
    loss1 = torch.sum(grad1 * grad1, dim=-1) / 2.
    grad2 = autograd.grad(gradv, dup_samples, create_graph=True)[0]
    loss2 = torch.sum(vectors * grad2, dim=-1)
    loss1 = loss1.view(n_particles, -1).mean(dim=0)
    loss2 = loss2.view(n_particles, -1).mean(dim=0)
    return (loss1 + loss2).mean()


torch.manual_seed(0)
score = nn.Sequential(nn.Linear(2, 16), nn.Softplus(), nn.Linear(16, 2))
optimizer = torch.optim.Adam(score.parameters(), lr=1e-3)
data = torch.randn(32, 2)
for step in range(4):
    loss = sliced_score_estimation_vr(score, data[step * 8:(step + 1) * 8].detach(), n_particles=2)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.6f}")
print("weights", repr(torch.cat([p.flatten() for p in score.parameters()]).double().sum().item()))
