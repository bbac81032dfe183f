# SRGAN as leftthomas/SRGAN train.py first trained it: G's loss built from the fake_out of D's step
# (d_loss.backward(retain_graph=True) kept its graph), after optimizerD.step() changed D's weights in place, which
# that graph saved: PyTorch >= 1.5 stops G's backward ('modified by an inplace operation'). retain_graph=True cannot
# help; D(G(z)) computed again after D's step can.
import hashlib

import torch
from torch import nn

torch.manual_seed(0)


class GeneratorLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.loss_network = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        for param in self.loss_network.parameters():
            param.requires_grad = False
        self.mse_loss = nn.MSELoss()

    def forward(self, out_labels, out_images, target_images):
        adversarial_loss = torch.mean(1 - out_labels)
        perception_loss = self.mse_loss(self.loss_network(out_images), self.loss_network(target_images))
        image_loss = self.mse_loss(out_images, target_images)
        h_tv = torch.pow(out_images[:, :, 1:, :] - out_images[:, :, :-1, :], 2).sum()
        w_tv = torch.pow(out_images[:, :, :, 1:] - out_images[:, :, :, :-1], 2).sum()
        tv_loss = 2e-8 * (h_tv + w_tv) / out_images.size(0)
        return image_loss + 0.001 * adversarial_loss + 0.006 * perception_loss + tv_loss


G = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.PReLU(), nn.Conv2d(8, 12, 3, padding=1), nn.PixelShuffle(2))
D = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.LeakyReLU(0.2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                  nn.Linear(4, 1), nn.Sigmoid())
generator_criterion = GeneratorLoss()
optimizerG = torch.optim.Adam(G.parameters())
optimizerD = torch.optim.Adam(D.parameters())
train_loader = [(torch.rand(2, 3, 4, 4), torch.rand(2, 3, 8, 8)) for _ in range(3)]
for epoch in range(2):
    for data, target in train_loader:
        real_img, z = target, data
        fake_img = G(z)
        D.zero_grad()
        real_out = D(real_img).mean()
        fake_out = D(fake_img).mean()
        d_loss = 1 - real_out + fake_out
        d_loss.backward(retain_graph=True)
        optimizerD.step()
        G.zero_grad()
        g_loss = generator_criterion(fake_out, fake_img, real_img)
        g_loss.backward()
        optimizerG.step()
        print(f"epoch {epoch}: d_loss {d_loss.item()!r} g_loss {g_loss.item()!r}")
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for m in (G, D) for t in m.state_dict().values()))
      .hexdigest())
