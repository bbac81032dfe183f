# capsule network with dynamic routing (gram-ai/capsule-networks, capsule_network.py): the routing logits start at
# zero every forward and are updated by agreement three times inside the graph; margin loss plus a reconstruction
# of the input from the capsule of the true class, masked by the label.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
NUM_ROUTING_ITERATIONS = 3


def softmax(input, dim=1):
    transposed_input = input.transpose(dim, len(input.size()) - 1)
    softmaxed_output = F.softmax(transposed_input.contiguous().view(-1, transposed_input.size(-1)), dim=-1)
    return softmaxed_output.view(*transposed_input.size()).transpose(dim, len(input.size()) - 1)


class CapsuleLayer(nn.Module):
    def __init__(self, num_capsules, num_route_nodes, in_channels, out_channels):
        super().__init__()
        self.num_route_nodes = num_route_nodes
        self.route_weights = nn.Parameter(torch.randn(num_capsules, num_route_nodes, in_channels, out_channels))

    @staticmethod
    def squash(tensor, dim=-1):
        squared_norm = (tensor ** 2).sum(dim=dim, keepdim=True)
        scale = squared_norm / (1 + squared_norm)
        return scale * tensor / torch.sqrt(squared_norm)

    def forward(self, x):
        priors = x[None, :, :, None, :] @ self.route_weights[:, None, :, :, :]
        logits = torch.zeros(*priors.size())
        for i in range(NUM_ROUTING_ITERATIONS):
            probs = softmax(logits, dim=2)
            outputs = self.squash((probs * priors).sum(dim=2, keepdim=True))
            if i != NUM_ROUTING_ITERATIONS - 1:
                delta_logits = (priors * outputs).sum(dim=-1, keepdim=True)
                logits = logits + delta_logits
        return outputs.squeeze()


class CapsuleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.primary = nn.Linear(12, 6 * 4)
        self.digit_capsules = CapsuleLayer(num_capsules=3, num_route_nodes=6, in_channels=4, out_channels=5)
        self.decoder = nn.Sequential(nn.Linear(5 * 3, 16), nn.ReLU(), nn.Linear(16, 12), nn.Sigmoid())

    def forward(self, x, y=None):
        u = CapsuleLayer.squash(self.primary(x).view(x.size(0), 6, 4))
        x = self.digit_capsules(u).transpose(0, 1)
        classes = (x ** 2).sum(dim=-1) ** 0.5
        classes = F.softmax(classes, dim=-1)
        if y is None:
            _, max_length_indices = classes.max(dim=1)
            y = torch.eye(3).index_select(dim=0, index=max_length_indices)
        reconstructions = self.decoder((x * y[:, :, None]).reshape(x.size(0), -1))
        return classes, reconstructions


class CapsuleLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.reconstruction_loss = nn.MSELoss(reduction="sum")

    def forward(self, images, labels, classes, reconstructions):
        left = F.relu(0.9 - classes, inplace=True) ** 2
        right = F.relu(classes - 0.1, inplace=True) ** 2
        margin_loss = (labels * left + 0.5 * (1.0 - labels) * right).sum()
        reconstruction_loss = self.reconstruction_loss(reconstructions, images)
        return (margin_loss + 0.0005 * reconstruction_loss) / images.size(0)


model, capsule_loss = CapsuleNet(), CapsuleLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(4):
    data, labels = torch.rand(5, 12), torch.randint(0, 3, (5,))
    labels = torch.eye(3).index_select(dim=0, index=labels)
    classes, reconstructions = model(data, labels)
    loss = capsule_loss(data, labels, classes, reconstructions)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, repr(loss.item()))
print([p.sum().item() for p in model.parameters()])
