# DLRM as facebookresearch/dlrm (08e1e93) writes it, dlrm_s_pytorch.py: MLPs whose weights are set through `.data`
# from NumPy, `nn.EmbeddingBag(..., sparse=True, _weight=torch.tensor(W, requires_grad=True))` tables (sparse COO
# gradients), sequential_forward with the dot interaction (T = cat, Z = bmm(T, T^T), its lower triangle gathered by
# index), BCELoss, one SGD over the dense and the sparse parameters, the loss kept through `E.detach().cpu().numpy()`
# and summed in NumPy; sizes shrunk, six batches. Correct: nothing to report.
import numpy as np
import torch
import torch.nn as nn


class DLRM_Net(nn.Module):
    def create_mlp(self, ln, sigmoid_layer):
        layers = nn.ModuleList()
        for i in range(0, ln.size - 1):
            n, m = ln[i], ln[i + 1]
            LL = nn.Linear(int(n), int(m), bias=True)
            std_dev = np.sqrt(2 / (m + n))
            W = np.random.normal(0.0, std_dev, size=(m, n)).astype(np.float32)
            bt = np.random.normal(0.0, np.sqrt(1 / m), size=m).astype(np.float32)
            LL.weight.data = torch.tensor(W, requires_grad=True)
            LL.bias.data = torch.tensor(bt, requires_grad=True)
            layers.append(LL)
            layers.append(nn.Sigmoid() if i == sigmoid_layer else nn.ReLU())
        return torch.nn.Sequential(*layers)

    def create_emb(self, m, ln):
        emb_l = nn.ModuleList()
        for i in range(0, ln.size):
            n = ln[i]
            W = np.random.uniform(low=-np.sqrt(1 / n), high=np.sqrt(1 / n), size=(n, m)).astype(np.float32)
            EE = nn.EmbeddingBag(n, m, mode="sum", sparse=True, _weight=torch.tensor(W, requires_grad=True))
            emb_l.append(EE)
        return emb_l

    def __init__(self, m_spa, ln_emb, ln_bot, ln_top, sigmoid_bot=-1, sigmoid_top=-1):
        super(DLRM_Net, self).__init__()
        self.emb_l = self.create_emb(m_spa, ln_emb)
        self.bot_l = self.create_mlp(ln_bot, sigmoid_bot)
        self.top_l = self.create_mlp(ln_top, sigmoid_top)

    def apply_emb(self, lS_o, lS_i, emb_l):
        ly = []
        for k, sparse_index_group_batch in enumerate(lS_i):
            sparse_offset_group_batch = lS_o[k]
            E = emb_l[k]
            ly.append(E(sparse_index_group_batch, sparse_offset_group_batch))
        return ly

    def interact_features(self, x, ly):
        (batch_size, d) = x.shape
        T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
        Z = torch.bmm(T, torch.transpose(T, 1, 2))
        _, ni, nj = Z.shape
        li = torch.tensor([i for i in range(ni) for j in range(i)])
        lj = torch.tensor([j for i in range(nj) for j in range(i)])
        Zflat = Z[:, li, lj]
        return torch.cat([x] + [Zflat], dim=1)

    def forward(self, dense_x, lS_o, lS_i):
        x = self.bot_l(dense_x)
        ly = self.apply_emb(lS_o, lS_i, self.emb_l)
        z = self.interact_features(x, ly)
        return self.top_l(z)


np.random.seed(0)
torch.manual_seed(0)
ln_emb = np.array([20, 30, 10])
ln_bot = np.array([5, 8, 4])
ln_top = np.array([4 + 6, 8, 1])
dlrm = DLRM_Net(4, ln_emb, ln_bot, ln_top, sigmoid_bot=-1, sigmoid_top=ln_top.size - 2)
loss_fn = torch.nn.BCELoss(reduction="mean")
optimizer = torch.optim.SGD(dlrm.parameters(), lr=0.1)
total_loss = 0
for j in range(6):
    X = torch.randn(8, 5)
    lS_i = [torch.randint(0, int(n), (16,)) for n in ln_emb]
    lS_o = [torch.arange(0, 16, 2) for _ in ln_emb]
    T = torch.randint(0, 2, (8, 1)).float()
    Z = dlrm(X, lS_o, lS_i)
    E = loss_fn(Z, T)
    L = E.detach().cpu().numpy()
    optimizer.zero_grad()
    E.backward()
    optimizer.step()
    total_loss += L * T.shape[0]
    print(j, repr(float(L)))
print(repr(float(total_loss)), sum(p.sum() for p in dlrm.parameters()).item())
