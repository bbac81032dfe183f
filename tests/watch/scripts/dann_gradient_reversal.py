# domain-adversarial training (fungtion/DANN, train/main.py and models/functions.py): a gradient reversal layer, an
# autograd.Function whose backward negates and scales the gradient by alpha (kept on ctx), between the features and
# the domain classifier; alpha grows with training progress. Source and target batches, three losses summed.
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

torch.manual_seed(0)


class ReverseLayerF(Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.neg() * ctx.alpha, None


class CNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.class_classifier = nn.Linear(8, 3)
        self.domain_classifier = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, input_data, alpha):
        feature = self.feature(input_data)
        reverse_feature = ReverseLayerF.apply(feature, alpha)
        return F.log_softmax(self.class_classifier(feature), 1), F.log_softmax(self.domain_classifier(reverse_feature), 1)


my_net = CNNModel()
optimizer = torch.optim.Adam(my_net.parameters(), lr=1e-3)
n_epoch, len_dataloader = 2, 3
for epoch in range(n_epoch):
    for i in range(len_dataloader):
        p = float(i + epoch * len_dataloader) / n_epoch / len_dataloader
        alpha = 2. / (1. + np.exp(-10 * p)) - 1
        s_img, s_label = torch.randn(4, 6), torch.randint(0, 3, (4,))
        my_net.zero_grad()
        class_output, domain_output = my_net(s_img, alpha)
        err_s_label = F.nll_loss(class_output, s_label)
        err_s_domain = F.nll_loss(domain_output, torch.zeros(4, dtype=torch.long))
        t_img = torch.randn(4, 6)
        _, domain_output = my_net(t_img, alpha)
        err_t_domain = F.nll_loss(domain_output, torch.ones(4, dtype=torch.long))
        err = err_t_domain + err_s_domain + err_s_label
        err.backward()
        optimizer.step()
        print(f"epoch {epoch} batch {i}: err {err.item()!r}")
print([p.sum().item() for p in my_net.parameters()])
