# Score distillation sampling as ashawkey/stable-dreamfusion wrote it before commit 28bd8ee (nerf/sd.py's train_step,
# nerf/utils.py's Trainer): a small radiance field renders an image, a frozen VAE encodes it into `latents`, a frozen
# UNet predicts the noise under torch.no_grad() with text embeddings computed once before the loop (also under
# no_grad), and the guidance's gradient is given to the latents by hand: `latents.backward(gradient=grad,
# retain_graph=True)` inside train_step, which returns 0; the trainer then adds the opacity and entropy regularizers on
# the same render and back-propagates their sum (through the retained graph) before the optimizer's step.
import torch
import torch.nn.functional as F
from torch import nn


class StableDiffusion(nn.Module):
    def __init__(self):
        super().__init__()
        self.text_encoder = nn.Embedding(10, 4).requires_grad_(False)
        self.vae = nn.Conv2d(3, 4, 2, stride=2).requires_grad_(False)
        self.unet = nn.Conv2d(8, 4, 3, padding=1).requires_grad_(False)
        self.alphas = torch.linspace(0.99, 0.01, 100)
        self.min_step, self.max_step = 2, 98

    def get_text_embeds(self, prompt, negative_prompt):
        with torch.no_grad():
            text_embeddings = self.text_encoder(prompt).mean(1)
        with torch.no_grad():
            uncond_embeddings = self.text_encoder(negative_prompt).mean(1)
        text_embeddings = torch.cat([uncond_embeddings, text_embeddings])
        return text_embeddings

    def encode_imgs(self, imgs):
        return self.vae(2 * imgs - 1) * 0.18215

    def train_step(self, text_embeddings, pred_rgb, guidance_scale=100):
        pred_rgb_512 = F.interpolate(pred_rgb, (16, 16), mode='bilinear', align_corners=False)
        t = torch.randint(self.min_step, self.max_step + 1, [1], dtype=torch.long)
        latents = self.encode_imgs(pred_rgb_512)
        with torch.no_grad():
            noise = torch.randn_like(latents)
            a = self.alphas[t]
            latents_noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
            latent_model_input = torch.cat([latents_noisy] * 2)
            cond = text_embeddings[:, :, None, None].expand(-1, -1, 8, 8)
            noise_pred = self.unet(torch.cat([latent_model_input, cond], 1))
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred = noise_pred_text + guidance_scale * (noise_pred_text - noise_pred_uncond)
        w = (1 - self.alphas[t])
        grad = w * (noise_pred - noise)
        grad = torch.nan_to_num(grad)
        # manually backward, since we omitted an item in grad and cannot simply autodiff.
        latents.backward(gradient=grad, retain_graph=True)
        return 0  # dummy loss value


class Field(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 4))

    def render(self, rays_o, rays_d):
        out = self.net(rays_o + rays_d)
        return {'image': torch.sigmoid(out[..., :3]), 'weights_sum': torch.sigmoid(out[..., 3])}


class Trainer:
    def __init__(self, model, guidance):
        self.model, self.guidance = model, guidance
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        self.text_z = guidance.get_text_embeds(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 0, 0]]))
        self.lambda_opacity, self.lambda_entropy = 1e-3, 1e-4

    def train_step(self, data):
        rays_o, rays_d = data['rays_o'], data['rays_d']
        B, N = rays_o.shape[:2]
        H, W = data['H'], data['W']
        outputs = self.model.render(rays_o, rays_d)
        pred_rgb = outputs['image'].reshape(B, H, W, 3).permute(0, 3, 1, 2).contiguous()
        loss = self.guidance.train_step(self.text_z, pred_rgb)
        pred_ws = outputs['weights_sum'].reshape(B, 1, H, W)
        loss_opacity = (pred_ws ** 2).mean()
        loss = loss + self.lambda_opacity * loss_opacity
        alphas = (pred_ws).clamp(1e-5, 1 - 1e-5)
        loss_entropy = (- alphas * torch.log2(alphas) - (1 - alphas) * torch.log2(1 - alphas)).mean()
        loss = loss + self.lambda_entropy * loss_entropy
        return pred_rgb, pred_ws, loss

    def train_one_epoch(self, loader):
        total_loss = 0
        for data in loader:
            self.optimizer.zero_grad()
            pred_rgbs, pred_ws, loss = self.train_step(data)
            loss.backward()
            self.optimizer.step()
            loss_val = loss.item()
            total_loss += loss_val
            print(f"{loss_val:.10f}")
        return total_loss / len(loader)


torch.manual_seed(0)
trainer = Trainer(Field(), StableDiffusion())
loader = [{'rays_o': torch.randn(1, 64, 3), 'rays_d': torch.randn(1, 64, 3), 'H': 8, 'W': 8} for _ in range(3)]
for epoch in range(2):
    print(f"{trainer.train_one_epoch(loader):.10f}")
print(f"{sum(p.double().sum().item() for p in trainer.model.parameters()):.12f}")
