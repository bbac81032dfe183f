# A loop whose closure (passed to optimizer.step) keeps the last loss on a record object, as a library's loop does,
# and a running sum of the losses on the model, with their graphs (meant: `model.total + loss.item()`).
import torch
from torch import nn


class Record:
    result = None


def main():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    record = Record()
    for i in range(6):
        x, y = torch.randn(8, 4), torch.randn(8, 1)

        def closure():
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            model.total = loss if i == 0 else model.total + loss
            record.result = loss
            loss.backward()
            return loss

        optimizer.step(closure)
    print(f"mean loss {model.total.item() / 6:.6f}")


main()
