# A memory-augmented network shaped as ixaxaar/pytorch-dnc's `rnn(input, (chx, mhx, rv))`: an LSTM controller's
# state per layer `chx`, a dict of memory tensors `mhx` and the last read vector `rv`, fed back with each input and
# carried across batches. The loop detaches `chx` and `mhx` (as the repo's copy task does `mhx`) but not `rv`: the
# loss reaches the last batch's read through the new `rv`, `chx` and `mhx`, which the guard must not name again.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class MemoryNet(nn.Module):
    def __init__(self, inp=4, hid=8, cells=5, width=3):
        super().__init__()
        self.lstm = nn.LSTM(inp + width, hid, batch_first=True)
        self.key = nn.Linear(hid, width)
        self.write = nn.Linear(hid, width)
        self.out = nn.Linear(hid + width, inp)
        self.cells, self.width, self.hid = cells, width, hid

    def forward(self, x, hx):
        chx, mhx, rv = hx
        if chx is None:
            chx = [(torch.zeros(1, x.size(0), self.hid), torch.zeros(1, x.size(0), self.hid))]
            mhx = {"memory": torch.zeros(x.size(0), self.cells, self.width), "usage": torch.zeros(x.size(0), self.cells)}
            rv = torch.zeros(x.size(0), self.width)
        outs = []
        for t in range(x.size(1)):
            o, chx[0] = self.lstm(torch.cat([x[:, t], rv], -1).unsqueeze(1), chx[0])
            w = F.softmax(torch.einsum("bnw,bw->bn", mhx["memory"], self.key(o[:, 0])), -1)
            memory = mhx["memory"] + w.unsqueeze(-1) * self.write(o[:, 0]).unsqueeze(1)
            mhx = {"memory": memory, "usage": mhx["usage"] * 0.9 + w}
            rv = torch.einsum("bn,bnw->bw", w, memory)
            outs.append(self.out(torch.cat([o[:, 0], rv], -1)))
        return torch.stack(outs, 1), (chx, mhx, rv)


rnn = MemoryNet()
optimizer = torch.optim.Adam(rnn.parameters(), lr=1e-3)
chx, mhx, rv = None, None, None
for epoch in range(4):
    optimizer.zero_grad()
    input_data = torch.randn(2, 3, 4)
    output, (chx, mhx, rv) = rnn(input_data, (chx, mhx, rv))
    loss = F.mse_loss(output, input_data.flip(1))
    loss.backward()
    optimizer.step()
    chx = [(h.detach(), c.detach()) for h, c in chx]
    mhx.update({k: v.detach() for k, v in mhx.items()})
    print(f"batch {epoch}: loss {loss.item()!r}")
