# Grad-CAM (jacobgil/pytorch-grad-cam, activations_and_gradients.py and base_cam.py) over a few images: a forward
# hook keeps the target layer's activation detached and registers a hook on its output for the gradient, the
# model's zero_grad() and the target's backward(retain_graph=True) per image, weights from the mean gradient.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()
target_layer = model[3]


class ActivationsAndGradients:
    def __init__(self, model, target_layers):
        self.model = model
        self.gradients = []
        self.activations = []
        self.handles = []
        for target_layer in target_layers:
            self.handles.append(target_layer.register_forward_hook(self.save_activation))
            self.handles.append(target_layer.register_forward_hook(self.save_gradient))

    def save_activation(self, module, input, output):
        self.activations.append(output.cpu().detach())

    def save_gradient(self, module, input, output):
        if not hasattr(output, "requires_grad") or not output.requires_grad:
            return

        def _store_grad(grad):
            self.gradients = [grad.cpu().detach()] + self.gradients

        output.register_hook(_store_grad)

    def __call__(self, x):
        self.gradients = []
        self.activations = []
        return self.model(x)


activations_and_grads = ActivationsAndGradients(model, [target_layer])
for i in range(4):
    input_tensor = torch.rand(2, 3, 8, 8)
    outputs = activations_and_grads(input_tensor)
    targets = outputs.argmax(dim=1)
    model.zero_grad()
    loss = sum(output[target] for output, target in zip(outputs, targets))
    loss.backward(retain_graph=True)
    activations, grads = activations_and_grads.activations[0], activations_and_grads.gradients[0]
    weights = grads.mean(dim=(2, 3), keepdim=True)
    cam = F.relu((weights * activations).sum(dim=1))
    cam = cam / (cam.flatten(1).max(dim=1)[0].view(-1, 1, 1) + 1e-7)
    print(i, repr(cam.sum().item()), targets.tolist())
