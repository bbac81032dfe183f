# Seed 000, code example 1 as written: one backward per loss.
import torch


# Assume forward_pass() calculates a loss based on input, and returns the loss Tensor
def forward_pass(input_tensor, model):
    return model(input_tensor) # Simplified model representation

def train_step(input_data, target_data, model, optimizer):
    loss = forward_pass(input_data, model) # Compute the loss
    loss.backward() # Backpropagate gradients

    optimizer.step() # Update model parameters
    optimizer.zero_grad() # Reset the gradients

    # Error: We attempt to backward again on the same loss, will trigger "Trying to backward through the graph a second time" error
    # loss.backward()


# added to run it: a model whose output is the loss, data, an optimizer
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Tanh(), torch.nn.Flatten(0))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3):
    train_step(torch.randn(1, 4), None, model, optimizer)
    print(f"iteration {i}: weight sum {model[0].weight.sum().item():.6f}")
