# Trimmed from the fine-tuning loop posted in openai/CLIP issue #57 ("Training CLIP on custom data"): weights kept in
# float16 (clip.model.convert_weights), switched to float32 through `.data` (parameters and gradients) between the
# backward and the optimizer step, then back to float16 (convert_models_to_fp32 / convert_weights), the contrastive
# loss over logits_per_image and logits_per_text. Correct: nothing to report.
import torch
from torch import nn


class CLIP(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual, self.text = nn.Linear(10, 6), nn.Linear(7, 6)
        self.logit_scale = nn.Parameter(torch.tensor(2.659))

    def forward(self, image, text):
        i = self.visual(image.type(self.visual.weight.dtype)).float()
        t = self.text(text.type(self.text.weight.dtype)).float()
        i, t = i / i.norm(dim=1, keepdim=True), t / t.norm(dim=1, keepdim=True)
        logits_per_image = self.logit_scale.exp() * i @ t.t()
        return logits_per_image, logits_per_image.t()


def convert_weights(model):  # clip.model.convert_weights, for the linear layers
    for l in model.modules():
        if isinstance(l, nn.Linear):
            l.weight.data = l.weight.data.half()
            l.bias.data = l.bias.data.half()


def convert_models_to_fp32(model):
    for p in model.parameters():
        p.data = p.data.float()
        p.grad.data = p.grad.data.float()


torch.manual_seed(0)
model = CLIP()
convert_weights(model)
loss_img, loss_txt = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=5e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.2)
for step in range(4):
    optimizer.zero_grad()
    images, texts = torch.randn(8, 10), torch.randn(8, 7)
    logits_per_image, logits_per_text = model(images, texts)
    ground_truth = torch.arange(8, dtype=torch.long)
    total_loss = (loss_img(logits_per_image, ground_truth) + loss_txt(logits_per_text, ground_truth)) / 2
    total_loss.backward()
    convert_models_to_fp32(model)
    optimizer.step()
    convert_weights(model)
    print(f"step {step} loss {total_loss.item():.6f}")
print(model.visual.weight.float().sum().item())
