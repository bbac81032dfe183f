# watch: --check always
# FreeLB (zhuchen03/FreeLB, huggingface-transformers/examples/run_glue_freelb.py): a perturbation `delta` on the word
# embeddings, made a leaf with `requires_grad_()`, K ascent steps each back-propagating `loss / K` into the parameters'
# accumulated gradients and moving delta along `delta.grad` (then detached: a fresh leaf), the embeddings computed
# again after each ascent (the backward freed their graph), then one clipped optimizer step and `model.zero_grad()`.
import hashlib

import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(20, 8)
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.classifier = nn.Linear(8, 3)

    def forward(self, inputs_embeds, attention_mask, labels):
        hidden = self.encoder(inputs_embeds) * attention_mask.unsqueeze(2)
        logits = self.classifier(hidden.sum(1) / attention_mask.sum(1, keepdim=True))
        return F.cross_entropy(logits, labels), logits


torch.manual_seed(0)
model = Model()
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
adv_steps, adv_lr, adv_init_mag, adv_max_norm = 3, 0.1, 0.05, 0.5
data = [(torch.randint(20, (4, 6)), (torch.arange(6) < torch.randint(3, 7, (4, 1))).long(), torch.randint(3, (4,)))
        for _ in range(5)]
model.zero_grad()
tr_loss = 0.0
for step, (input_ids, attention_mask, labels) in enumerate(data):
    model.train()
    embeds_init = model.word_embeddings(input_ids)
    input_mask = attention_mask.to(embeds_init)
    input_lengths = torch.sum(input_mask, 1)
    delta = torch.zeros_like(embeds_init).uniform_(-1, 1) * input_mask.unsqueeze(2)
    dims = input_lengths * embeds_init.size(-1)
    mag = adv_init_mag / torch.sqrt(dims)
    delta = (delta * mag.view(-1, 1, 1)).detach()
    for astep in range(adv_steps):
        delta.requires_grad_()
        loss, logits = model(delta + embeds_init, attention_mask, labels)
        loss = loss / adv_steps
        tr_loss += loss.item()
        loss.backward()
        if astep == adv_steps - 1:
            break
        delta_grad = delta.grad.clone().detach()
        denorm = torch.norm(delta_grad.view(delta_grad.size(0), -1), dim=1).view(-1, 1, 1)
        denorm = torch.clamp(denorm, min=1e-8)
        delta = (delta + adv_lr * delta_grad / denorm).detach()
        delta_norm = torch.norm(delta.view(delta.size(0), -1).float(), p=2, dim=1).detach()
        exceed_mask = (delta_norm > adv_max_norm).to(embeds_init)
        reweights = (adv_max_norm / delta_norm * exceed_mask + (1 - exceed_mask)).view(-1, 1, 1)
        delta = (delta * reweights).detach()
        embeds_init = model.word_embeddings(input_ids)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    model.zero_grad()
    print(f"step {step} loss {tr_loss!r}")
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
