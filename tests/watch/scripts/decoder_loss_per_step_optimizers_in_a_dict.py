# A decoder's loss back-propagated at each of its steps (retain_graph=True: each goes through the encoder's output),
# then each optimizer of a dict stepped by its name after the loop (`optimizers[name].step()`). Correct: that loop runs
# inside one update, so the encoder's output, made before it, is the update's own.
import torch
from torch import nn

torch.manual_seed(0)


def train(x, encoder, decoder, optimizers):
    encoder.zero_grad()
    decoder.zero_grad()
    e = torch.tanh(encoder(x))
    h = torch.zeros(2, 4)
    for t in range(3):
        h = decoder(e, h)
        loss = h.pow(2).mean()
        loss.backward(retain_graph=True)
    for name in ("enc", "dec"):
        optimizers[name].step()
    return loss.item()


encoder, decoder = nn.Linear(4, 4), nn.GRUCell(4, 4)
optimizers = {"enc": torch.optim.Adam(encoder.parameters(), lr=0.01),
              "dec": torch.optim.Adam(decoder.parameters(), lr=0.01)}
for iteration in range(3):
    print(iteration, train(torch.randn(2, 4), encoder, decoder, optimizers))
print(repr(decoder.weight_hh.sum().item()))
