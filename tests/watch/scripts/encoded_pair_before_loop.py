"""A pair (an encoder's loc and scale) computed once before the loop with its graph, read by a step function that
calls backward and returns a float, as pyro's ``svi.step`` does: the loop's own variables hold no graph."""
import torch

torch.manual_seed(0)
encoder = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(encoder.parameters(), lr=0.1)
x = torch.randn(4, 3)


def update(pair):
    loc, scale = pair
    loss = (loc * scale.exp()).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def main():
    encoded = (encoder(x), encoder(x) * 0.5)
    total = 0.0
    for i in range(3):
        total += update(encoded)
    print(f"{total:.6f}")


main()
