# Trimmed from huggingface/transformers, examples/pytorch/language-modeling/run_clm_no_trainer.py (without Accelerate):
# gradient accumulation over 3 micro-batches (`loss = loss / gradient_accumulation_steps`), the gradients clipped by
# norm before each update, a linear warmup schedule stepped with the optimizer, zero_grad after it (set_to_none=False
# on odd epochs, as older versions did). Correct: nothing to report.
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(12, 8), nn.Flatten(), nn.Linear(32, 12))
no_decay = ["bias"]
optimizer_grouped_parameters = [
    {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
    {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
]
optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=5e-3)
lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
gradient_accumulation_steps, completed_steps = 3, 0
for epoch in range(2):
    model.train()
    for step in range(6):
        batch = torch.randint(0, 12, (8, 5))
        logits = model(batch[:, :4])
        loss = nn.functional.cross_entropy(logits, batch[:, 4])
        loss = loss / gradient_accumulation_steps
        loss.backward()
        if step % gradient_accumulation_steps == gradient_accumulation_steps - 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=epoch % 2 == 0)
            completed_steps += 1
            print(f"epoch {epoch} step {completed_steps} loss {loss.item() * gradient_accumulation_steps:.6f}")
print(model[2].weight.sum().item())
