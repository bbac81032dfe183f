# pytorch/examples siamese_network/main.py: one trunk applied to both images of a pair (forward_once twice), the two
# features concatenated into a small head, BCE on the sigmoid; Adadelta stepped by a StepLR each epoch, the test
# under torch.no_grad() after each epoch.
import hashlib

import torch
from torch import nn

torch.manual_seed(1)


class SiameseNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                                   nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))
        self.sigmoid = nn.Sigmoid()

    def forward_once(self, x):
        output = self.trunk(x)
        return output.view(output.size()[0], -1)

    def forward(self, input1, input2):
        output = torch.cat((self.forward_once(input1), self.forward_once(input2)), 1)
        return self.sigmoid(self.fc(output))


batches = [(torch.randn(6, 1, 9, 9), torch.randn(6, 1, 9, 9), torch.tensor([1., 0.] * 3)) for _ in range(3)]
model = SiameseNetwork()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
criterion = nn.BCELoss()
for epoch in range(1, 3):
    model.train()
    for batch_idx, (images_1, images_2, targets) in enumerate(batches):
        optimizer.zero_grad()
        outputs = model(images_1, images_2).squeeze()
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()
        print(f"epoch {epoch} batch {batch_idx}: loss {loss.item()!r}")
    model.eval()
    with torch.no_grad():
        test_loss = sum(criterion(model(a, b).squeeze(), t).item() for a, b, t in batches)
    print(f"test loss {test_loss!r}")
    scheduler.step()
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest())
