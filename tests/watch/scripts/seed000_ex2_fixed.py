# Seed 000, code example 2, with `second_loss.backward()` uncommented, on plain input data: a
# new forward pass builds a new graph, so the second backward is fine.
import torch


def forward_pass(input_tensor, model):
    return model(input_tensor)

def train_loop(input_data, target_data, model, optimizer):
    loss = forward_pass(input_data, model)
    loss.backward() # First backprop
    optimizer.step()
    optimizer.zero_grad()

    # Later on, for other training purposes
    # The second_loss uses the original input data, which will reuse the original graph.
    second_loss = forward_pass(input_data, model)
    # This triggers the 'backward second time' error
    second_loss.backward()


# added to run it
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Tanh(), torch.nn.Flatten(0))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
input_data = torch.randn(1, 4)  # plain data, no graph
for epoch in range(3):
    train_loop(input_data, None, model, optimizer)
    print(f"epoch {epoch}: weight sum {model[0].weight.sum().item():.6f}")
