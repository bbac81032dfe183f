# pytorch/examples' time_sequence_prediction with the LSTM states kept on the module from one call to the next,
# detached after each backward: each closure call back-propagates through its own graph only.
import torch
import torch.nn as nn


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 8)
        self.lstm2 = nn.LSTMCell(8, 8)
        self.linear = nn.Linear(8, 1)
        self.state = None

    def forward(self, input):
        outputs = []
        if self.state is None:
            z = torch.zeros(input.size(0), 8, dtype=torch.double)
            self.state = (z, z, z, z)
        h_t, c_t, h_t2, c_t2 = self.state
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        self.state = (h_t, c_t, h_t2, c_t2)
        return torch.cat(outputs, dim=1)


torch.manual_seed(0)
data = torch.sin(torch.arange(0, 30, dtype=torch.double).view(1, -1).repeat(3, 1) / 4)
inp, target = data[:, :-1], data[:, 1:]
seq = Sequence().double()
criterion = nn.MSELoss()
optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=4)
for i in range(3):
    def closure():
        optimizer.zero_grad()
        out = seq(inp)
        loss = criterion(out, target)
        loss.backward()
        seq.state = tuple(t.detach() for t in seq.state)
        return loss
    print(f"{optimizer.step(closure).item():.6f}")
