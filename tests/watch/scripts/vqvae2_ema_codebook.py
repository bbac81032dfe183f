# VQ-VAE-2's EMA codebook (rosinality/vq-vae-2-pytorch, vqvae.py Quantize.forward; train_vqvae.py train): in the
# training forward the buffers cluster_size, embed_avg and embed are written in place through `.data` from the
# batch's encodings (which have a graph); the codes are read before the write, the straight-through estimator
# detaches them; model.zero_grad() first, then backward, scheduler, optimizer.step().
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)


class Quantize(nn.Module):
    def __init__(self, dim, n_embed, decay=0.99, eps=1e-5):
        super().__init__()
        self.dim, self.n_embed, self.decay, self.eps = dim, n_embed, decay, eps
        embed = torch.randn(dim, n_embed)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.zeros(n_embed))
        self.register_buffer("embed_avg", embed.clone())

    def forward(self, input):
        flatten = input.reshape(-1, self.dim)
        dist = flatten.pow(2).sum(1, keepdim=True) - 2 * flatten @ self.embed + self.embed.pow(2).sum(0, keepdim=True)
        _, embed_ind = (-dist).max(1)
        embed_onehot = F.one_hot(embed_ind, self.n_embed).type(flatten.dtype)
        quantize = F.embedding(embed_ind.view(*input.shape[:-1]), self.embed.transpose(0, 1))
        if self.training:
            embed_onehot_sum = embed_onehot.sum(0)
            embed_sum = flatten.transpose(0, 1) @ embed_onehot
            self.cluster_size.data.mul_(self.decay).add_(embed_onehot_sum, alpha=1 - self.decay)
            self.embed_avg.data.mul_(self.decay).add_(embed_sum, alpha=1 - self.decay)
            n = self.cluster_size.sum()
            cluster_size = (self.cluster_size + self.eps) / (n + self.n_embed * self.eps) * n
            self.embed.data.copy_(self.embed_avg / cluster_size.unsqueeze(0))
        diff = (quantize.detach() - input).pow(2).mean()
        quantize = input + (quantize - input).detach()
        return quantize, diff


class VQVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.quantize, self.dec = nn.Linear(6, 4), Quantize(2, 8), nn.Linear(4, 6)

    def forward(self, x):
        quant, diff = self.quantize(self.enc(x).view(-1, 2, 2))
        return self.dec(quant.view(-1, 4)), diff


model = VQVAE()
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
for i in range(10):
    model.zero_grad()
    img = torch.randn(16, 6)
    out, latent_loss = model(img)
    recon_loss = F.mse_loss(out, img)
    loss = recon_loss + 0.25 * latent_loss.mean()
    loss.backward()
    optimizer.step()
    print(i, f"{recon_loss.item():.6f} {latent_loss.item():.6f}")
print(model.quantize.embed.sum().item())
