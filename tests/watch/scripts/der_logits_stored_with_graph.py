# Dark experience replay after aimagelab/mammoth's Der.observe: the loss adds the MSE between the net's logits on
# buffered examples and the logits stored with them, and each batch goes into a reservoir buffer whose slots are
# written in place. The mistake: `logits=outputs` where mammoth stores `outputs.data`, so every slot written keeps the
# graph of the step that wrote it, and the next step's replay loss goes back into graphs already freed.
import torch
import torch.nn as nn
import torch.nn.functional as F


class Buffer:
    def __init__(self, size):
        self.size, self.seen = size, 0
        self.examples, self.logits = torch.zeros(size, 10), torch.zeros(size, 4)

    def add_data(self, examples, logits):
        for i in range(examples.shape[0]):
            index = self.seen if self.seen < self.size else int(torch.randint(0, self.seen + 1, ()))
            self.seen += 1
            if index < self.size:
                self.examples[index] = examples[i]
                self.logits[index] = logits[i]

    def get_data(self, n):
        choice = torch.randperm(min(self.seen, self.size))[:n]
        return self.examples[choice], self.logits[choice]


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
buffer = Buffer(20)
for inputs, labels in [(torch.randn(6, 10), torch.randint(0, 4, (6,))) for _ in range(3)]:
    opt.zero_grad()
    outputs = net(inputs)
    loss = F.cross_entropy(outputs, labels)
    if buffer.seen:
        buf_inputs, buf_logits = buffer.get_data(4)
        loss = loss + 0.5 * F.mse_loss(net(buf_inputs), buf_logits)
    loss.backward()
    opt.step()
    buffer.add_data(inputs, logits=outputs)  # mammoth: logits=outputs.data
    print(f"{loss.item():.6f}")
