# DreamBooth with prior preservation (huggingface/diffusers, examples/dreambooth/train_dreambooth.py) with the text
# encoder trained (--train_text_encoder): the prompt embeddings computed again every step, as the guard's first fix
# for dreambooth_text_embeddings_before_loop says (the embeddings made before the loop are left unused).
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
text_encoder = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
unet = nn.Sequential(nn.Linear(16 + 8, 32), nn.SiLU(), nn.Linear(32, 16))
alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 100), 0)
params_to_optimize = list(unet.parameters()) + list(text_encoder.parameters())
optimizer = torch.optim.AdamW(params_to_optimize, lr=5e-4)
instance_prompt_ids, class_prompt_ids = torch.tensor([1, 2, 3]), torch.tensor([4, 2, 3])
prompt_embeds = torch.stack([text_encoder(instance_prompt_ids).mean(0), text_encoder(class_prompt_ids).mean(0)])
for step in range(4):
    prompt_embeds = torch.stack([text_encoder(instance_prompt_ids).mean(0), text_encoder(class_prompt_ids).mean(0)])
    pixel_values = torch.cat([torch.randn(2, 16), torch.randn(2, 16)])  # instance images, then class images
    encoder_hidden_states = prompt_embeds.repeat_interleave(2, dim=0)
    noise = torch.randn_like(pixel_values)
    timesteps = torch.randint(0, 100, (pixel_values.shape[0],))
    a = alphas_cumprod[timesteps][:, None]
    noisy_model_input = a.sqrt() * pixel_values + (1 - a).sqrt() * noise
    model_pred = unet(torch.cat([noisy_model_input, encoder_hidden_states], 1))
    model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
    target, target_prior = torch.chunk(noise, 2, dim=0)
    loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    prior_loss = F.mse_loss(model_pred_prior.float(), target_prior.float(), reduction="mean")
    loss = loss + 1.0 * prior_loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params_to_optimize, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(step, repr(loss.item()))
print([p.sum().item() for p in params_to_optimize])
