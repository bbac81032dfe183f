"""pytorch/examples time_sequence_prediction/train.py's L-BFGS loop (https://github.com/pytorch/examples/blob/main/
time_sequence_prediction/train.py: `def closure(): optimizer.zero_grad(); out = seq(input); loss =
criterion(out, target); loss.backward(); return loss` then `optimizer.step(closure)`), with the criterion a lambda
summing per-horizon losses in a list comprehension (inlined into the lambda on Python 3.12) and a test pass
under torch.no_grad() after each step. A linear predictor on a noisy sine."""
import torch
import torch.nn as nn

torch.manual_seed(0)
t = torch.linspace(0, 6, 40)
data = torch.sin(t) + 0.05 * torch.randn(40)
input = data.unfold(0, 4, 1)[:34]
target = torch.stack([data[4:38], data[5:39]], 1)
seq = nn.Linear(4, 2)
criterion = lambda out, y: sum([nn.functional.mse_loss(out[:, k], y[:, k]) for k in range(2)])
optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8)
for i in range(3):
    print('STEP: ', i)

    def closure():
        optimizer.zero_grad()
        out = seq(input)
        loss = criterion(out, target)
        print('loss:', loss.item())
        loss.backward()
        return loss
    optimizer.step(closure)
    with torch.no_grad():
        pred = seq(input[-4:])
        print('test loss:', criterion(pred, target[-4:]).item())
print(seq.weight.sum().item(), seq.bias.sum().item())
