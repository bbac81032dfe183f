# A decoder's loss back-propagated at each of its steps, in a loop nested in the training loop's body, and the optimizer
# stepped once after it: the second step's backward goes through the encoder's output and the first decoder step, which
# the first backward freed. One update's backwards: retain_graph=True (or one backward of the summed losses), not the
# truncation a recurrent state carried across updates needs (`h = h.detach()` would cut the gradient between words).
import torch
from torch import nn

torch.manual_seed(0)
encoder, decoder = nn.Linear(4, 4), nn.GRUCell(4, 4)
optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=0.01)
for iteration in range(3):
    optimizer.zero_grad()
    e = torch.tanh(encoder(torch.randn(2, 4)))
    h = torch.zeros(2, 4)
    for t in range(3):
        h = decoder(e, h)
        loss = h.pow(2).mean()
        loss.backward()
    optimizer.step()
    print(iteration, loss.item())
