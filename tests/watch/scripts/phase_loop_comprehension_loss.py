"""A recurrent CNN's CIFAR-10 training function (a public research script; its loop as written): train and test
phases in one loop, `with torch.set_grad_enabled(phase == "train"):`, a deep-supervision loss summed over the
outputs of every recurrent step in a list comprehension (`sum([criterion(o, labels) for o in outputs])`, inlined
into the function on Python 3.12), backward only in the train phase, and a OneCycleLR. Random data, a tiny model."""
import torch
import torch.nn as nn
import torch.optim as optim
from tqdm import tqdm


class Steps(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.lateral, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h, outs = self.inp(x).relu(), []
        for _ in range(3):
            h = (self.inp(x) + self.lateral(h)).relu()
            outs.append(self.out(h))
        return outs


def training(num_epochs=2):
    torch.manual_seed(0)
    model = Steps()
    dataloaders = {p: [(torch.randn(4, 6), torch.randint(3, (4,))) for _ in range(3)] for p in ["train", "test"]}
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(model.parameters(), lr=1e-2)
    lr_scheduler = optim.lr_scheduler.OneCycleLR(optimizer, 1e-2, epochs=num_epochs, steps_per_epoch=3)
    for epoch in range(num_epochs):
        for phase in ["train", "test"]:
            model.train() if phase == "train" else model.eval()
            running_loss = 0.0
            for batch, (inputs, labels) in tqdm(enumerate(dataloaders[phase]), total=3, disable=True):
                optimizer.zero_grad()
                with torch.set_grad_enabled(phase == "train"):
                    outputs = model(inputs)
                    _, preds = torch.max(outputs[-1], 1)
                    loss = sum([criterion(o, labels) for o in outputs])
                    if phase == "train":
                        loss.backward()
                        optimizer.step()
                        lr_scheduler.step()
                running_loss += loss.item() * inputs.size(0)
            print(f"{epoch} {phase} Loss: {running_loss}")
    return model


for p in training().parameters():
    print(p.sum().item())
