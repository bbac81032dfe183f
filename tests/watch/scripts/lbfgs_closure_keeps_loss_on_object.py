# An L-BFGS loop in a function whose closure keeps the last loss on an object the loop made before it began
# (`stats.loss = loss`), read after each step: the closure assigns it for the loop, each evaluation anew.
import torch
from torch import nn


class Stats:
    loss = None


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    stats = Stats()
    for i in range(3):
        x, y = torch.randn(32, 4), torch.randn(32, 1)

        def closure():
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            stats.loss = loss
            loss.backward()
            return loss

        optimizer.step(closure)
        print(f"step {i}: last evaluation {stats.loss.item():.6f}")


main()
