# A decoder's loss back-propagated at each of its steps (retain_graph=True: each goes through the encoder's output),
# and the update in a method of the object whose method runs that loop (`self.update()` stepping `self.optimizer`).
# Correct: that loop runs inside one update, so the encoder's output, made before it, is the update's own.
import torch
from torch import nn

torch.manual_seed(0)


class Seq2Seq:
    def __init__(self):
        self.encoder, self.decoder = nn.Linear(4, 4), nn.GRUCell(4, 4)
        self.optimizer = torch.optim.Adam([*self.encoder.parameters(), *self.decoder.parameters()], lr=0.01)

    def update(self):
        self.optimizer.step()
        self.optimizer.zero_grad()

    def train_batch(self, x):
        e = torch.tanh(self.encoder(x))
        h = torch.zeros(2, 4)
        for t in range(3):
            h = self.decoder(e, h)
            loss = h.pow(2).mean()
            loss.backward(retain_graph=True)
        self.update()
        return loss.item()


model = Seq2Seq()
for iteration in range(3):
    print(iteration, model.train_batch(torch.randn(2, 4)))
print(repr(model.decoder.weight_hh.sum().item()))
