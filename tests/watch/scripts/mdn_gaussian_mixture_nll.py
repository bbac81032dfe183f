# A mixture density network (hardmaru/pytorch_notebooks mixture_density_networks.ipynb, sagelywizard/pytorch-mdn):
# one forward gives the mixture's logits, means and standard deviations; the negative log-likelihood is built from a
# torch.distributions.Normal and a logsumexp over the components; the whole data set each epoch, full batch.
import hashlib

import torch
from torch import nn

torch.manual_seed(0)


class MDN(nn.Module):
    def __init__(self, n_hidden=8, n_gaussians=3):
        super().__init__()
        self.z_h = nn.Sequential(nn.Linear(1, n_hidden), nn.Tanh())
        self.z_pi = nn.Linear(n_hidden, n_gaussians)
        self.z_sigma = nn.Linear(n_hidden, n_gaussians)
        self.z_mu = nn.Linear(n_hidden, n_gaussians)

    def forward(self, x):
        z_h = self.z_h(x)
        return torch.log_softmax(self.z_pi(z_h), -1), torch.exp(self.z_sigma(z_h)), self.z_mu(z_h)


def mdn_loss_fn(log_pi, sigma, mu, y):
    m = torch.distributions.Normal(loc=mu, scale=sigma)
    return -torch.logsumexp(m.log_prob(y) + log_pi, dim=1).mean()


y_data = torch.rand(40, 1) * 2 - 1
x_data = torch.sin(3 * y_data) + 0.1 * torch.randn(40, 1)
network = MDN()
optimizer = torch.optim.Adam(network.parameters())
for epoch in range(6):
    log_pi, sigma, mu = network(x_data)
    loss = mdn_loss_fn(log_pi, sigma, mu, y_data)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"epoch {epoch}: loss {loss.data.item()!r}")
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in network.state_dict().values())).hexdigest())
