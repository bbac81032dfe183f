"""``encoded_pair_before_loop.py`` fixed as its error advises: the pair recomputed inside the loop."""
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
    total = 0.0
    for i in range(3):
        encoded = (encoder(x), encoder(x) * 0.5)
        total += update(encoded)
    print(f"{total:.6f}")


main()
