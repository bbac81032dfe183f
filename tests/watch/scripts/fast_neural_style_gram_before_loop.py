# pytorch/examples fast_neural_style/neural_style/neural_style.py: the style image's Gram matrices are computed once
# before the loop by a loss network made with requires_grad=False (Vgg16(requires_grad=False)), and every batch's
# loss compares the transformed batch's Gram matrices with them; content loss on one feature, the style loss summed
# over the features with `+=`.
import hashlib

import torch
from torch import nn

torch.manual_seed(42)


def gram_matrix(y):
    b, ch, h, w = y.size()
    features = y.view(b, ch, w * h)
    return features.bmm(features.transpose(1, 2)) / (ch * h * w)


class Vgg(nn.Module):
    def __init__(self, requires_grad=False):
        super().__init__()
        self.slice1 = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.slice2 = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.ReLU())
        if not requires_grad:
            for param in self.parameters():
                param.requires_grad = False

    def forward(self, x):
        h1 = self.slice1(x)
        return [h1, self.slice2(h1)]


transformer = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True), nn.ReLU(),
                            nn.Conv2d(8, 3, 3, padding=1))
optimizer = torch.optim.Adam(transformer.parameters(), 1e-3)
mse_loss = nn.MSELoss()
vgg = Vgg(requires_grad=False)
style = torch.rand(1, 3, 8, 8).repeat(2, 1, 1, 1)
features_style = vgg(style)
gram_style = [gram_matrix(y) for y in features_style]
train_loader = [torch.rand(2, 3, 8, 8) for _ in range(3)]
for e in range(2):
    transformer.train()
    agg_content_loss = agg_style_loss = 0.
    for batch_id, x in enumerate(train_loader):
        n_batch = len(x)
        optimizer.zero_grad()
        y = transformer(x)
        features_y = vgg(y)
        features_x = vgg(x)
        content_loss = 1e2 * mse_loss(features_y[1], features_x[1])
        style_loss = 0.
        for ft_y, gm_s in zip(features_y, gram_style):
            gm_y = gram_matrix(ft_y)
            style_loss += mse_loss(gm_y, gm_s[:n_batch, :, :])
        style_loss *= 1e3
        total_loss = content_loss + style_loss
        total_loss.backward()
        optimizer.step()
        agg_content_loss += content_loss.item()
        agg_style_loss += style_loss.item()
    print(f"epoch {e}: content {agg_content_loss!r} style {agg_style_loss!r}")
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in transformer.state_dict().values())).hexdigest())
