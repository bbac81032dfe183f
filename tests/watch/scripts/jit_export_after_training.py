# watch: --check always
# Trimmed from shariqfarhan/EMLOV3, Assignment_10/classwork/mnist_train.py (0ba08d2): a LeNet trained on MNIST (here
# random images), then exported to TorchScript with torch.jit.trace; torch.jit.script added, the other way to export.
import torch
import torch.nn as nn
import torch.optim as optim
from torch.nn import functional as F

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 4 * 4)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


trainloader = [(torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))) for _ in range(4)]
net = Net()
criterion = nn.CrossEntropyLoss()
optimizer = optim.SGD(net.parameters(), lr=0.001, momentum=0.9)

for epoch in range(2):
    running_loss = 0.0
    for i, data in enumerate(trainloader, 0):
        inputs, labels = data
        optimizer.zero_grad()
        outputs = net(inputs)
        loss = criterion(outputs, labels)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
    print(f"Epoch {epoch + 1}, Loss: {running_loss / len(trainloader)}")

example_input = torch.randn(1, 1, 28, 28)
traced_script_module = torch.jit.trace(net, example_input)
print("traced", traced_script_module(example_input).sum().item())
scripted = torch.jit.script(net)
print("scripted", scripted(example_input).sum().item())
