# PyTorch's CIFAR-10 tutorial loop (pytorch/tutorials, beginner_source/blitz/cifar10_tutorial.py), its statistics
# kept as `running_loss += loss` instead of `loss.item()`: each print every 4 mini-batches (2000 in the tutorial)
# resets the total, but until then it keeps every mini-batch's graph alive.
import torch
import torch.nn as nn
import torch.optim as optim

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 10))
criterion = nn.CrossEntropyLoss()
optimizer = optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
trainloader = [(torch.randn(4, 12), torch.randint(10, (4,))) for _ in range(12)]

for epoch in range(2):  # loop over the dataset multiple times

    running_loss = 0.0
    for i, data in enumerate(trainloader, 0):
        # get the inputs; data is a list of [inputs, labels]
        inputs, labels = data

        # zero the parameter gradients
        optimizer.zero_grad()

        # forward + backward + optimize
        outputs = net(inputs)
        loss = criterion(outputs, labels)
        loss.backward()
        optimizer.step()

        # print statistics
        running_loss += loss
        if i % 4 == 3:    # print every 4 mini-batches
            print(f'[{epoch + 1}, {i + 1:5d}] loss: {running_loss / 4:.3f}')
            running_loss = 0.0

print('Finished Training')
