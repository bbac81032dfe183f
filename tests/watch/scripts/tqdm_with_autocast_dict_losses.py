"""A segmentation loop at module level in the shape of torchvision's references/segmentation/train.py
(pytorch/vision): the epochs inside `with tqdm(total=...) as pbar:`, the forward under torch.autocast, the model's
"out" and "aux" heads' losses in a dict comprehension, `loss = losses["out"] + 0.5 * losses["aux"]`, and
`pbar.update(1)` after each optimizer step. bf16 autocast on CPU, a tiny two-head model on random pixels."""
import torch
import torch.nn as nn
from tqdm import tqdm

torch.manual_seed(0)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.out, self.aux = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 5, 1), nn.Conv2d(4, 5, 1)

    def forward(self, x):
        f = self.body(x).relu()
        return {"out": self.out(f), "aux": self.aux(f)}


model = TwoHeads()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
data_loader = [(torch.randn(2, 3, 8, 8), torch.randint(5, (2, 8, 8))) for _ in range(3)]
with tqdm(total=2 * len(data_loader), disable=True) as pbar:
    for epoch in range(2):
        for image, target in data_loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = model(image)
                losses = {name: nn.functional.cross_entropy(x.float(), target, ignore_index=255)
                          for name, x in output.items()}
                loss = losses["out"] + 0.5 * losses["aux"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            pbar.update(1)
            print(epoch, loss.item())
for p in model.parameters():
    print(p.sum().item())
