# Iterative magnitude pruning with rewinding as rahulvigneswaran/Lottery-Ticket-Hypothesis-in-Pytorch (34a8c96) writes
# it, main.py: masks kept as NumPy arrays, prune_by_percentile writing `param.data` anew, original_initialization
# rewinding the weights from the initial state_dict (and setting each bias's `.data` to the saved tensor itself), a
# new Adam per pruning level, and train() zeroing the pruned weights' gradients through NumPy between backward and
# step (`p.grad.data = torch.from_numpy(...)`); fc1 shrunk, three levels of four steps. Correct: nothing to report.
import copy

import numpy as np
import torch
import torch.nn as nn
import torch.nn.init as init


class fc1(nn.Module):
    def __init__(self, num_classes=3):
        super(fc1, self).__init__()
        self.classifier = nn.Sequential(nn.Linear(12, 16), nn.ReLU(inplace=True), nn.Linear(16, 8),
                                        nn.ReLU(inplace=True), nn.Linear(8, num_classes))

    def forward(self, x):
        x = torch.flatten(x, 1)
        return self.classifier(x)


def weight_init(m):
    if isinstance(m, nn.Linear):
        init.xavier_normal_(m.weight.data)
        init.normal_(m.bias.data)


def train(model, train_loader, optimizer, criterion):
    EPS = 1e-6
    model.train()
    for batch_idx, (imgs, targets) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(imgs)
        train_loss = criterion(output, targets)
        train_loss.backward()
        # Freezing Pruned weights by making their gradients Zero
        for name, p in model.named_parameters():
            if 'weight' in name:
                tensor = p.data.cpu().numpy()
                grad_tensor = p.grad.data.cpu().numpy()
                grad_tensor = np.where(tensor < EPS, 0, grad_tensor)
                p.grad.data = torch.from_numpy(grad_tensor)
        optimizer.step()
    return train_loss.item()


def test(model, test_loader):
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            pred = model(data).data.max(1, keepdim=True)[1]
            correct += pred.eq(target.data.view_as(pred)).sum().item()
    return 100. * correct / 16


def prune_by_percentile(percent):
    global mask
    step = 0
    for name, param in model.named_parameters():
        if 'weight' in name:
            tensor = param.data.cpu().numpy()
            alive = tensor[np.nonzero(tensor)]
            percentile_value = np.percentile(abs(alive), percent)
            new_mask = np.where(abs(tensor) < percentile_value, 0, mask[step])
            param.data = torch.from_numpy(tensor * new_mask)
            mask[step] = new_mask
            step += 1


def original_initialization(mask_temp, initial_state_dict):
    step = 0
    for name, param in model.named_parameters():
        if "weight" in name:
            param.data = torch.from_numpy(mask_temp[step] * initial_state_dict[name].cpu().numpy())
            step = step + 1
        if "bias" in name:
            param.data = initial_state_dict[name]


torch.manual_seed(0)
np.random.seed(0)
train_loader = [(torch.randn(4, 3, 4), torch.randint(0, 3, (4,))) for _ in range(4)]
test_loader = [(torch.randn(8, 3, 4), torch.randint(0, 3, (8,))) for _ in range(2)]
model = fc1()
model.apply(weight_init)
initial_state_dict = copy.deepcopy(model.state_dict())
mask = [np.ones_like(p.data.cpu().numpy()) for n, p in model.named_parameters() if 'weight' in n]
optimizer = torch.optim.Adam(model.parameters(), weight_decay=1e-4)
criterion = nn.CrossEntropyLoss()
for _ite in range(3):
    if not _ite == 0:
        prune_by_percentile(20)
        original_initialization(mask, initial_state_dict)
        optimizer = torch.optim.Adam(model.parameters(), lr=1.2e-3, weight_decay=1e-4)
    accuracy = test(model, test_loader)
    loss = train(model, train_loader, optimizer, criterion)
    print(f"level {_ite} loss {loss!r} accuracy {accuracy!r}")
print(sum(p.sum() for p in model.parameters()).item(), sum(int((m == 0).sum()) for m in mask))
