# watch: --check always
# Trimmed from eriklindernoren/PyTorch-GAN, implementations/acgan/acgan.py (36d3c77): the discriminator's auxiliary
# classifier ends in `nn.Softmax()` with no dim, so torch warns once, at the frame of module.py its stacklevel names.
import torch
from torch import nn

torch.manual_seed(0)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2))
        self.adv_layer = nn.Sequential(nn.Linear(32, 1), nn.Sigmoid())
        self.aux_layer = nn.Sequential(nn.Linear(32, 4), nn.Softmax())

    def forward(self, img):
        out = self.body(img)
        return self.adv_layer(out), self.aux_layer(out)


generator = nn.Sequential(nn.Linear(8 + 4, 16), nn.Tanh())
discriminator = Discriminator()
adversarial_loss, auxiliary_loss = nn.BCELoss(), nn.CrossEntropyLoss()
optimizer_G = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))

for i in range(4):
    real_imgs, labels = torch.randn(8, 16), torch.randint(0, 4, (8,))
    valid, fake = torch.ones(8, 1), torch.zeros(8, 1)

    optimizer_G.zero_grad()
    gen_labels = torch.randint(0, 4, (8,))
    gen_imgs = generator(torch.cat([torch.randn(8, 8), nn.functional.one_hot(gen_labels, 4).float()], 1))
    validity, pred_label = discriminator(gen_imgs)
    g_loss = 0.5 * (adversarial_loss(validity, valid) + auxiliary_loss(pred_label, gen_labels))
    g_loss.backward()
    optimizer_G.step()

    optimizer_D.zero_grad()
    real_pred, real_aux = discriminator(real_imgs)
    fake_pred, fake_aux = discriminator(gen_imgs.detach())
    d_loss = (adversarial_loss(real_pred, valid) + auxiliary_loss(real_aux, labels)
              + adversarial_loss(fake_pred, fake) + auxiliary_loss(fake_aux, gen_labels)) / 4
    d_loss.backward()
    optimizer_D.step()
    print(f"[Batch {i}] [D loss: {d_loss.item():.6f}] [G loss: {g_loss.item():.6f}]")

print(sum(p.sum() for p in discriminator.parameters()).item(), sum(p.sum() for p in generator.parameters()).item())
