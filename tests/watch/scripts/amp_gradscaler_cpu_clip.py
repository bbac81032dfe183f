# Trimmed from pytorch/tutorials, recipes_source/recipes/amp_recipe.py ("Inspecting/modifying gradients" with
# gradient clipping), on CPU: torch.amp.GradScaler("cpu") around float16 autocast, scaler.unscale_ then
# clip_grad_norm_, scaler.step, scaler.update; one batch made inf so that its step is skipped and the scale halved.
# Correct: nothing to report.
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
loss_fn = nn.MSELoss()
for epoch in range(5):
    input, target = torch.randn(16, 8), torch.randn(16, 8)
    if epoch == 2:
        input[0, 0] = float("inf")  # overflow: the scaler skips this step
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        output = net(input)
        loss = loss_fn(output, target)
    scaler.scale(loss).backward()
    # Unscales the gradients of optimizer's assigned params in-place
    scaler.unscale_(opt)
    # Since the gradients of optimizer's assigned params are now unscaled, clips as usual.
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.1)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    print(f"epoch {epoch} loss {loss.float().item():.4f} norm {norm.item():.4f} scale {scaler.get_scale()}")
print(net[0].weight.sum().item())
