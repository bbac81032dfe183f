# VQGAN+CLIP as nerdyrodent/VQGAN-CLIP's generate.py writes it: the latent `z` (one-hot codes times the frozen
# codebook) made a leaf with `z.requires_grad_(True)` and the only thing Adam optimizes; the prompts embedded once
# before the loop by a frozen perceptor and kept as buffers of `Prompt` modules; straight-through quantization and
# clamping through autograd Functions (`ReplaceGrad`, `ClampWithGrad`, this one saving its input); random cutouts;
# after each step, `z` clamped in place under `torch.inference_mode()` (`z.copy_(...)`), so the optimizer keeps the
# same leaf.
import torch
import torch.nn.functional as F
from torch import nn, optim


class ReplaceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_forward, x_backward):
        ctx.shape = x_backward.shape
        return x_forward

    @staticmethod
    def backward(ctx, grad_in):
        return None, grad_in.sum_to_size(ctx.shape)


replace_grad = ReplaceGrad.apply


class ClampWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, min, max):
        ctx.min = min
        ctx.max = max
        ctx.save_for_backward(input)
        return input.clamp(min, max)

    @staticmethod
    def backward(ctx, grad_in):
        input, = ctx.saved_tensors
        return grad_in * (grad_in * (input - input.clamp(ctx.min, ctx.max)) >= 0), None, None


clamp_with_grad = ClampWithGrad.apply


def vector_quantize(x, codebook):
    d = x.pow(2).sum(dim=-1, keepdim=True) + codebook.pow(2).sum(dim=1) - 2 * x @ codebook.T
    indices = d.argmin(-1)
    x_q = F.one_hot(indices, codebook.shape[0]).to(d.dtype) @ codebook
    return replace_grad(x_q, x)


class Prompt(nn.Module):
    def __init__(self, embed, weight=1., stop=float('-inf')):
        super().__init__()
        self.register_buffer('embed', embed)
        self.register_buffer('weight', torch.as_tensor(weight))
        self.register_buffer('stop', torch.as_tensor(stop))

    def forward(self, input):
        input_normed = F.normalize(input.unsqueeze(1), dim=2)
        embed_normed = F.normalize(self.embed.unsqueeze(0), dim=2)
        dists = input_normed.sub(embed_normed).norm(dim=2).div(2).arcsin().pow(2).mul(2)
        dists = dists * self.weight.sign()
        return self.weight.abs() * replace_grad(dists, torch.maximum(dists, self.stop)).mean()


class MakeCutoutsOrig(nn.Module):
    def __init__(self, cut_size, cutn, cut_pow=1.):
        super().__init__()
        self.cut_size = cut_size
        self.cutn = cutn
        self.cut_pow = cut_pow

    def forward(self, input):
        sideY, sideX = input.shape[2:4]
        max_size = min(sideX, sideY)
        min_size = min(sideX, sideY, self.cut_size)
        cutouts = []
        for _ in range(self.cutn):
            size = int(torch.rand([])**self.cut_pow * (max_size - min_size) + min_size)
            offsetx = torch.randint(0, sideX - size + 1, ())
            offsety = torch.randint(0, sideY - size + 1, ())
            cutout = input[:, :, offsety:offsety + size, offsetx:offsetx + size]
            cutouts.append(F.interpolate(cutout, (self.cut_size, self.cut_size), mode='bilinear', align_corners=True))
        return clamp_with_grad(torch.cat(cutouts, dim=0), 0, 1)


class VQModel(nn.Module):
    def __init__(self, n_toks=16, e_dim=4):
        super().__init__()
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(n_toks, e_dim)
        self.decoder = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(e_dim, 3, 3, padding=1))

    def decode(self, z_q):
        return torch.tanh(self.decoder(z_q))


class Perceptor(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.token_embedding = nn.Embedding(32, dim)
        self.visual = nn.Sequential(nn.Conv2d(3, dim, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(dim, dim))

    def encode_text(self, tokens):
        return self.token_embedding(tokens).mean(1)

    def encode_image(self, image):
        return self.visual(image)


torch.manual_seed(0)
model = VQModel().eval().requires_grad_(False)
perceptor = Perceptor().eval().requires_grad_(False)
make_cutouts = MakeCutoutsOrig(6, 4)
n_toks, e_dim, toksX, toksY = 16, 4, 4, 4
z_min = model.quantize.embedding.weight.min(dim=0).values[None, :, None, None]
z_max = model.quantize.embedding.weight.max(dim=0).values[None, :, None, None]

one_hot = F.one_hot(torch.randint(n_toks, [toksY * toksX]), n_toks).float()
z = one_hot @ model.quantize.embedding.weight
z = z.view([-1, toksY, toksX, e_dim]).permute(0, 3, 1, 2)
z_orig = z.clone()
z.requires_grad_(True)

pMs = []
for txt, weight, stop in [(torch.tensor([[1, 5, 7]]), 1., float('-inf')), (torch.tensor([[2, 9]]), 0.5, 0.1)]:
    embed = perceptor.encode_text(txt).float()
    pMs.append(Prompt(embed, weight, stop))

opt = optim.Adam([z], lr=0.1)


def synth(z):
    z_q = vector_quantize(z.movedim(1, 3), model.quantize.embedding.weight).movedim(3, 1)
    return clamp_with_grad(model.decode(z_q).add(1).div(2), 0, 1)


def ascend_txt():
    out = synth(z)
    iii = perceptor.encode_image(make_cutouts(out)).float()
    result = []
    result.append(F.mse_loss(z, torch.zeros_like(z_orig)) * ((1/torch.tensor(i*2 + 1))*0.1) / 2)
    for prompt in pMs:
        result.append(prompt(iii))
    return result


def train(i):
    opt.zero_grad(set_to_none=True)
    lossAll = ascend_txt()
    loss = sum(lossAll)
    loss.backward()
    opt.step()
    print(i, ', '.join(f'{loss.item():.8f}' for loss in lossAll))
    with torch.inference_mode():
        z.copy_(z.maximum(z_min).minimum(z_max))


i = 0
while True:
    train(i)
    if i == 6:
        break
    i += 1
print(f"{z.double().sum().item():.12f}")
