# DeepDream (e.g. eriklindernoren/PyTorch-Deep-Dream, deep_dream.py): gradient ascent on the image of the mean
# activation of a layer, the image updated by hand through .data with a normalized gradient and clamped, octave
# after octave; the network's parameters still require grad (no optimizer), their .grad filling up unused.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
network = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())


def dream(image, model, iterations, lr):
    image = image.clone().requires_grad_(True)
    for i in range(iterations):
        model.zero_grad()
        out = model(image)
        loss = out.norm()
        loss.backward()
        avg_grad = image.grad.data.abs().mean()
        norm_lr = lr / avg_grad
        image.data += norm_lr * image.grad.data
        image.data = image.data.clamp(-1, 1)
        image.grad.data.zero_()
        print(repr(loss.item()))
    return image.detach()


def deep_dream(image, model, iterations, lr, octave_scale, num_octaves):
    octaves = [image]
    for _ in range(num_octaves - 1):
        octaves.append(F.interpolate(octaves[-1], scale_factor=1 / octave_scale, mode="bilinear"))
    detail = torch.zeros_like(octaves[-1])
    for octave, octave_base in enumerate(octaves[::-1]):
        if octave > 0:
            detail = F.interpolate(detail, size=octave_base.shape[-2:], mode="bilinear")
        input_image = octave_base + detail
        dreamed_image = dream(input_image, model, iterations, lr)
        detail = dreamed_image - octave_base
    return dreamed_image


dreamed = deep_dream(torch.rand(1, 3, 12, 12) * 2 - 1, network, iterations=3, lr=0.01, octave_scale=1.4, num_octaves=2)
print(dreamed.sum().item(), [p.sum().item() for p in network.parameters()])
