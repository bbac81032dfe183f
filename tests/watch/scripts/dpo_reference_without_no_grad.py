"""dpo_reference_no_grad_each_step.py (eric-mitchell/direct-preference-optimization, trainers.py) with the reference
model's log-probabilities computed without torch.no_grad(): the reference is a deepcopy of the policy that no optimizer
holds, so each backward also fills its .grad, which nothing reads. Wasted work, not a wrong update: quiet, as
distillation_teacher_not_frozen.py, and bit for bit the correct run."""
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
    return (per_token_logps * loss_mask).sum(-1)


def concatenated_forward(model, batch):
    all_logits = model(torch.cat([batch["chosen"], batch["rejected"]])).to(torch.float32)
    all_logps = _get_batch_logps(all_logits, torch.cat([batch["chosen_labels"], batch["rejected_labels"]]))
    n = batch["chosen"].shape[0]
    return all_logps[:n], all_logps[n:]


def preference_loss(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps,
                    beta):
    pi_logratios = policy_chosen_logps - policy_rejected_logps
    ref_logratios = reference_chosen_logps - reference_rejected_logps
    logits = pi_logratios - ref_logratios
    losses = -F.logsigmoid(beta * logits)
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


def get_batch(prompt_len=3):
    chosen, rejected = torch.randint(0, vocab, (2, block)), torch.randint(0, vocab, (2, block))
    rejected[:, :prompt_len] = chosen[:, :prompt_len]
    chosen_labels, rejected_labels = chosen.clone(), rejected.clone()
    chosen_labels[:, :prompt_len] = -100
    rejected_labels[:, :prompt_len] = -100
    return {"chosen": chosen, "rejected": rejected, "chosen_labels": chosen_labels, "rejected_labels": rejected_labels}


policy = GPT()
reference_model = copy.deepcopy(policy)
reference_model.eval()
optimizer = torch.optim.RMSprop(policy.parameters(), lr=1e-3)
gradient_accumulation_steps = 2
for example_counter in range(4):
    policy.train()
    for microbatch_idx in range(gradient_accumulation_steps):
        batch = get_batch()
        policy_chosen_logps, policy_rejected_logps = concatenated_forward(policy, batch)
        reference_chosen_logps, reference_rejected_logps = concatenated_forward(reference_model, batch)
        losses, chosen_rewards, rejected_rewards = preference_loss(
            policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, beta=0.1)
        reward_accuracies = (chosen_rewards > rejected_rewards).float()
        loss = losses.mean()
        (loss / gradient_accumulation_steps).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 10.0)
    optimizer.step()
    optimizer.zero_grad()
    print(example_counter, repr(loss.item()), repr(grad_norm.item()), reward_accuracies.tolist())
print([p.sum().item() for p in policy.parameters()])
