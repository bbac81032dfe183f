# watch: --check always
# Trimmed from pytorch/examples, mnist_forward_forward/main.py (65722fe): Hinton's forward-forward training. The layers
# are kept in a plain list on purpose: each `Layer` owns an Adam over its own weights and trains on a local loss, one
# layer after the other, on the detached outputs of the last. Correct: no gradient goes unused.
import torch
import torch.nn as nn
from torch.optim import Adam

torch.manual_seed(0)
EPOCHS, THRESHOLD, LR = 6, 2.0, 0.03


def overlay_y_on_x(x, y, classes=10):
    x_ = x.clone()
    x_[:, :classes] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_


class Net(torch.nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.layers = []
        for d in range(len(dims) - 1):
            self.layers = self.layers + [Layer(dims[d], dims[d + 1])]

    def predict(self, x):
        goodness_per_label = []
        for label in range(10):
            h = overlay_y_on_x(x, label)
            goodness = []
            for layer in self.layers:
                h = layer(h)
                goodness = goodness + [h.pow(2).mean(1)]
            goodness_per_label += [sum(goodness).unsqueeze(1)]
        return torch.cat(goodness_per_label, 1).argmax(1)

    def train(self, x_pos, x_neg):
        h_pos, h_neg = x_pos, x_neg
        for i, layer in enumerate(self.layers):
            print("training layer: ", i)
            h_pos, h_neg = layer.train(h_pos, h_neg)


class Layer(nn.Linear):
    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.relu = torch.nn.ReLU()
        self.opt = Adam(self.parameters(), lr=LR)
        self.threshold = THRESHOLD
        self.num_epochs = EPOCHS

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def train(self, x_pos, x_neg):
        for i in range(self.num_epochs):
            g_pos = self.forward(x_pos).pow(2).mean(1)
            g_neg = self.forward(x_neg).pow(2).mean(1)
            loss = torch.log1p(torch.exp(torch.cat([-g_pos + self.threshold, g_neg - self.threshold]))).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            print("Loss: ", loss.item())
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


net = Net([64, 32, 32])
x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
x_pos = overlay_y_on_x(x, y)
x_neg = overlay_y_on_x(x, (y + torch.randint(1, 10, (16,))) % 10)
net.train(x_pos, x_neg)
print("train error:", 1.0 - net.predict(x).eq(y).float().mean().item())
print([layer.weight.sum().item() for layer in net.layers])
