# A decoder's loss back-propagated at each of its steps (retain_graph=True: each goes through the encoder's output) in
# a function that steps no optimizer, called from the training loop, which steps the optimizer after it. Correct: the
# function's loop runs inside one update, so the encoder's output, made before it, is the update's own.
import torch
from torch import nn

torch.manual_seed(0)


def decode_losses(x, encoder, decoder):
    e = torch.tanh(encoder(x))
    h = torch.zeros(2, 4)
    for t in range(3):
        h = decoder(e, h)
        loss = h.pow(2).mean()
        loss.backward(retain_graph=True)
    return loss.item()


encoder, decoder = nn.Linear(4, 4), nn.GRUCell(4, 4)
optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=0.01)
for iteration in range(3):
    optimizer.zero_grad()
    print(iteration, decode_losses(torch.randn(2, 4), encoder, decoder))
    optimizer.step()
print(repr(decoder.weight_hh.sum().item()))
