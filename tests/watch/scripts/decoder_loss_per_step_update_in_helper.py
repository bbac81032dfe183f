# A decoder's loss back-propagated at each of its steps (retain_graph=True: each goes through the encoder's output),
# and the update in a function of the script the loop's function calls after it (`update(optimizer, ...)`, the chatbot
# tutorial's clipping and optimizer steps moved out of `train`). Correct: that loop runs inside one update, so the
# encoder's output, made before it, is the update's own, not a graph built before training.
import torch
from torch import nn

torch.manual_seed(0)


def update(optimizer, modules, clip):
    nn.utils.clip_grad_norm_([p for m in modules for p in m.parameters()], clip)
    optimizer.step()


def train(x, encoder, decoder, optimizer):
    optimizer.zero_grad()
    e = torch.tanh(encoder(x))
    h = torch.zeros(2, 4)
    for t in range(3):
        h = decoder(e, h)
        loss = h.pow(2).mean()
        loss.backward(retain_graph=True)
    update(optimizer, (encoder, decoder), 1.0)
    return loss.item()


encoder, decoder = nn.Linear(4, 4), nn.GRUCell(4, 4)
optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=0.01)
for iteration in range(3):
    print(iteration, train(torch.randn(2, 4), encoder, decoder, optimizer))
print(repr(decoder.weight_hh.sum().item()))
