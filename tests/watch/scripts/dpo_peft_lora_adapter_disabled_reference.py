"""DPO of a LoRA-adapted policy whose reference is the same model with its adapters disabled, as TRL's DPOTrainer
does for a PEFT model without ref_model (huggingface/trl, trl/trainer/dpo_trainer.py: null_ref_context, with
torch.no_grad() around compute_ref_log_probs), the base weights frozen and only the lora_ parameters given to the
optimizer (huggingface/peft's LoraLayer forward). The DPO loss of eric-mitchell/direct-preference-optimization's
trainers.py; a 2-layer GPT with LoRA on its attention's input projection, random token ids."""
import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
vocab, dim, block = 16, 16, 8


class LoraLinear(nn.Linear):
    """peft's LoraLayer for nn.Linear (huggingface/peft, src/peft/tuners/lora/layer.py: result = base_layer(x) +
    lora_B(lora_A(dropout(x))) * scaling, skipped while the adapters are disabled)."""

    def __init__(self, in_features, out_features, r=4, lora_alpha=8):
        super().__init__(in_features, out_features)
        self.lora_A, self.lora_B = nn.Linear(in_features, r, bias=False), nn.Linear(r, out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling, self.disable_adapters = lora_alpha / r, False

    def forward(self, x):
        result = super().forward(x)
        if self.disable_adapters:
            return result
        return result + self.lora_B(self.lora_A(x)) * self.scaling


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(dim), LoraLinear(dim, 3 * dim), nn.Linear(dim, dim)
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


@contextlib.contextmanager
def disable_adapter(model):
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.disable_adapters = True
    try:
        yield
    finally:
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module.disable_adapters = False


policy = GPT()
for name, param in policy.named_parameters():
    param.requires_grad = "lora_" in name
optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
for step in range(4):
    batch = get_batch()
    policy_chosen_logps, policy_rejected_logps = concatenated_forward(policy, batch)
    with torch.no_grad(), disable_adapter(policy):
        reference_chosen_logps, reference_rejected_logps = concatenated_forward(policy, batch)
    losses, chosen_rewards, rejected_rewards = preference_loss(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, beta=0.1)
    loss = losses.mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(step, repr(loss.item()), (chosen_rewards > rejected_rewards).float().tolist())
print([p.sum().item() for p in policy.parameters()])
