"""TRL's RewardTrainer.compute_loss (huggingface/trl, trl/trainer/reward_trainer.py): the chosen and rejected
sequences scored by a sequence-classification head (the last token's hidden state), the pairwise loss
-logsigmoid(rewards_chosen - rewards_rejected - margin), plus center_rewards_coefficient * (chosen + rejected)**2;
accuracy of the detached rewards printed. A 2-layer GPT trunk with a scalar head on random token ids."""
import copy

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
vocab, dim, block = 16, 16, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f, self.score = nn.LayerNorm(dim), nn.Linear(dim, 1, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        return self.score(self.ln_f(x))[:, -1, 0]



model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
center_rewards_coefficient = 0.01
for step in range(5):
    inputs = {"input_ids_chosen": torch.randint(0, vocab, (4, block)),
              "input_ids_rejected": torch.randint(0, vocab, (4, block)),
              "margin": torch.rand(4)}
    rewards_chosen = model(inputs["input_ids_chosen"])
    rewards_rejected = model(inputs["input_ids_rejected"])
    if "margin" in inputs:
        loss = -nn.functional.logsigmoid(rewards_chosen - rewards_rejected - inputs["margin"]).mean()
    else:
        loss = -nn.functional.logsigmoid(rewards_chosen - rewards_rejected).mean()
    if center_rewards_coefficient is not None:
        loss += center_rewards_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)
    accuracy = (rewards_chosen.detach() > rewards_rejected.detach()).float().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, repr(loss.item()), accuracy.item())
print([p.sum().item() for p in model.parameters()])
