# CoOp's prompt learner (coop_prompt_learner.py) with the prompts' fixed tokens embedded without torch.no_grad(): the
# buffers keep the embedding's graph, which every step's prompts go through; the second backward fails.
import torch
from torch import nn
from torch.nn import functional as F

D, L, N_CTX, N_CLS = 8, 6, 2, 3


class Clip(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_embedding = nn.Embedding(20, D)
        self.positional_embedding = nn.Parameter(torch.randn(L, D) * 0.01)
        self.transformer = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0), 1,
                                                 enable_nested_tensor=False)
        self.ln_final = nn.LayerNorm(D)
        self.text_projection = nn.Parameter(torch.randn(D, D) * D ** -0.5)
        self.visual = nn.Sequential(nn.Flatten(), nn.Linear(12, D))
        self.logit_scale = nn.Parameter(torch.ones([]) * 2.65)


class TextEncoder(nn.Module):
    def __init__(self, clip_model):
        super().__init__()
        self.transformer = clip_model.transformer
        self.positional_embedding = clip_model.positional_embedding
        self.ln_final = clip_model.ln_final
        self.text_projection = clip_model.text_projection

    def forward(self, prompts, tokenized_prompts):
        x = prompts + self.positional_embedding
        x = self.transformer(x.permute(1, 0, 2)).permute(1, 0, 2)
        x = self.ln_final(x)
        return x[torch.arange(x.shape[0]), tokenized_prompts.argmax(dim=-1)] @ self.text_projection


class PromptLearner(nn.Module):
    def __init__(self, clip_model):
        super().__init__()
        ctx_vectors = torch.empty(N_CTX, D)
        nn.init.normal_(ctx_vectors, std=0.02)
        self.ctx = nn.Parameter(ctx_vectors)  # to be optimized
        tokenized_prompts = torch.stack([torch.tensor([1, 2, 2, 3 + c, 19, 0]) for c in range(N_CLS)])
        embedding = clip_model.token_embedding(tokenized_prompts)  # Bug: its graph kept in the buffers
        self.register_buffer("token_prefix", embedding[:, :1, :])  # SOS
        self.register_buffer("token_suffix", embedding[:, 1 + N_CTX:, :])  # CLS, EOS
        self.tokenized_prompts = tokenized_prompts

    def forward(self):
        ctx = self.ctx.unsqueeze(0).expand(N_CLS, -1, -1)
        return torch.cat([self.token_prefix, ctx, self.token_suffix], dim=1)


class CustomCLIP(nn.Module):
    def __init__(self, clip_model):
        super().__init__()
        self.prompt_learner = PromptLearner(clip_model)
        self.tokenized_prompts = self.prompt_learner.tokenized_prompts
        self.image_encoder = clip_model.visual
        self.text_encoder = TextEncoder(clip_model)
        self.logit_scale = clip_model.logit_scale

    def forward(self, image):
        image_features = self.image_encoder(image)
        text_features = self.text_encoder(self.prompt_learner(), self.tokenized_prompts)
        image_features = image_features / image_features.norm(dim=-1, keepdim=True)
        text_features = text_features / text_features.norm(dim=-1, keepdim=True)
        return self.logit_scale.exp() * image_features @ text_features.t()


torch.manual_seed(0)
clip_model = Clip()
model = CustomCLIP(clip_model)
for name, param in model.named_parameters():
    if "prompt_learner" not in name:
        param.requires_grad_(False)
optim = torch.optim.SGD(model.prompt_learner.parameters(), lr=0.002, momentum=0.9, weight_decay=5e-4)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, 2)
for epoch in range(2):
    model.train()
    for batch_idx in range(2):
        image, label = torch.randn(4, 3, 4), torch.randint(N_CLS, (4,))
        output = model(image)
        loss = F.cross_entropy(output, label)
        optim.zero_grad()
        loss.backward()
        optim.step()
        print(f"{loss.item():.6f} {(output.argmax(1) == label).float().mean().item():.2f}")
    sched.step()
print(" ".join(f"{v:.6f}" for v in model.prompt_learner.ctx.flatten().tolist()))
