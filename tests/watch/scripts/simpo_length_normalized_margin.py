"""SimPO (princeton-nlp/SimPO, scripts/simpo_trainer.py: concatenated_forward with average_log_prob=True, simpo_loss):
no reference model; the length-normalised log-probabilities of chosen and rejected from one concatenated forward,
the margin gamma/beta subtracted, rewards reported detached, and its optional SFT term on the chosen sequences.
A plain loop instead of the Trainer; a 2-layer GPT on random token ids."""
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
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def _get_batch_logps(logits, labels):
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels[labels == -100] = 0
    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)


def concatenated_forward(model, batch):
    all_logits = model(torch.cat([batch["chosen"], batch["rejected"]])).to(torch.float32)
    all_logps = _get_batch_logps(all_logits, torch.cat([batch["chosen_labels"], batch["rejected_labels"]]))
    n = batch["chosen"].shape[0]
    return all_logps[:n], all_logps[n:]


def simpo_loss(policy_chosen_logps, policy_rejected_logps, beta=2.0, gamma_beta_ratio=0.25, label_smoothing=0.0):
    pi_logratios = policy_chosen_logps - policy_rejected_logps
    logits = pi_logratios - gamma_beta_ratio
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    chosen_rewards = beta * policy_chosen_logps.detach()
    rejected_rewards = beta * policy_rejected_logps.detach()
    return losses, chosen_rewards, rejected_rewards


def get_batch(prompt_len=3):
    chosen, rejected = torch.randint(0, vocab, (2, block)), torch.randint(0, vocab, (2, block))
    rejected[:, :prompt_len] = chosen[:, :prompt_len]
    chosen_labels, rejected_labels = chosen.clone(), rejected.clone()
    chosen_labels[:, :prompt_len] = -100
    rejected_labels[:, :prompt_len] = -100
    return {"chosen": chosen, "rejected": rejected, "chosen_labels": chosen_labels, "rejected_labels": rejected_labels}


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
sft_weight = 0.1
for step in range(5):
    batch = get_batch()
    policy_chosen_logps, policy_rejected_logps = concatenated_forward(model, batch)
    losses, chosen_rewards, rejected_rewards = simpo_loss(policy_chosen_logps, policy_rejected_logps)
    loss = losses.mean() - sft_weight * policy_chosen_logps.mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, repr(loss.item()), (chosen_rewards > rejected_rewards).float().tolist(),
          (chosen_rewards - rejected_rewards).mean().item())
print([p.sum().item() for p in model.parameters()])
