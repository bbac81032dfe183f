# pytorch/examples gat/main.py: one forward of the whole graph per epoch (features and the dense adjacency made once
# before the loop, without grad), the loss on the training nodes' mask, and after each update the training and
# validation nodes evaluated in eval mode under torch.no_grad() by a `test` function; dropout on inputs and attention.
import hashlib

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(13)


class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, n_heads, concat, dropout=0.4, leaky_relu_slope=0.2):
        super().__init__()
        self.n_heads, self.concat, self.dropout = n_heads, concat, dropout
        self.n_hidden = out_features // n_heads if concat else out_features
        self.W = nn.Parameter(torch.empty(in_features, self.n_hidden * n_heads))
        self.a = nn.Parameter(torch.empty(n_heads, 2 * self.n_hidden, 1))
        self.leakyrelu = nn.LeakyReLU(leaky_relu_slope)
        nn.init.xavier_normal_(self.W)
        nn.init.xavier_normal_(self.a)

    def forward(self, h, adj_mat):
        n_nodes = h.shape[0]
        h_transformed = torch.mm(h, self.W)
        h_transformed = F.dropout(h_transformed, self.dropout, training=self.training)
        h_transformed = h_transformed.view(n_nodes, self.n_heads, self.n_hidden).permute(1, 0, 2)
        source = torch.matmul(h_transformed, self.a[:, :self.n_hidden, :])
        target = torch.matmul(h_transformed, self.a[:, self.n_hidden:, :])
        e = self.leakyrelu(source + target.mT)
        connectivity_mask = -9e16 * torch.ones_like(e)
        e = torch.where(adj_mat > 0, e, connectivity_mask)
        attention = F.dropout(F.softmax(e, dim=-1), self.dropout, training=self.training)
        h_prime = torch.matmul(attention, h_transformed)
        if self.concat:
            return h_prime.permute(1, 0, 2).contiguous().view(n_nodes, self.n_heads * self.n_hidden)
        return h_prime.mean(dim=0)


class GAT(nn.Module):
    def __init__(self, in_features, n_hidden, n_heads, num_classes):
        super().__init__()
        self.gat1 = GraphAttentionLayer(in_features, n_hidden, n_heads, concat=True)
        self.gat2 = GraphAttentionLayer(n_hidden, num_classes, 1, concat=False)

    def forward(self, input_tensor, adj_mat):
        x = F.elu(self.gat1(input_tensor, adj_mat))
        return F.log_softmax(self.gat2(x, adj_mat), dim=1)


def test(model, criterion, input, target, mask):
    model.eval()
    with torch.no_grad():
        output = model(*input)
        output, target = output[mask], target[mask]
        loss = criterion(output, target)
        acc = (output.argmax(dim=1) == target).float().sum() / len(target)
    return loss.item(), acc.item()


features = torch.rand(12, 6)
features = features / features.sum(1, keepdim=True)
labels = torch.randint(0, 3, (12,))
adj_mat = torch.eye(12) + (torch.rand(12, 12) > 0.7).float()
idx = torch.randperm(12)
idx_val, idx_train = idx[:4], idx[4:]
gat_net = GAT(6, 8, 2, 3)
optimizer = torch.optim.Adam(gat_net.parameters(), lr=0.005, weight_decay=5e-4)
criterion = nn.NLLLoss()
for epoch in range(4):
    gat_net.train()
    optimizer.zero_grad()
    output = gat_net(features, adj_mat)
    loss = criterion(output[idx_train], labels[idx_train])
    loss.backward()
    optimizer.step()
    loss_train, acc_train = test(gat_net, criterion, (features, adj_mat), labels, idx_train)
    loss_val, acc_val = test(gat_net, criterion, (features, adj_mat), labels, idx_val)
    print(f"epoch {epoch}: {loss_train!r} {acc_train!r} {loss_val!r} {acc_val!r}")
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in gat_net.state_dict().values())).hexdigest())
