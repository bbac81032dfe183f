"""The PyTorch profiler tutorial's loop (pytorch/tutorials, intermediate_source/tensorboard_profiler_tutorial.py):
the training loop inside `with torch.profiler.profile(schedule=...) as prof:` at module level, `prof.step()` each
batch, `break` after wait + warmup + active steps, and the step itself in a function `train(data)`. A linear
classifier on random data; the trace is handed to a function that keeps nothing."""
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
criterion = torch.nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
train_loader = [(torch.randn(4, 8), torch.randint(3, (4,))) for _ in range(8)]


def train(data):
    inputs, labels = data[0], data[1]
    outputs = model(inputs)
    loss = criterion(outputs, labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: None,
        record_shapes=True, acc_events=True) as prof:
    for step, batch_data in enumerate(train_loader):
        prof.step()
        if step >= 1 + 1 + 3:
            break
        print(step, train(batch_data).item())
for p in model.parameters():
    print(p.sum().item())
