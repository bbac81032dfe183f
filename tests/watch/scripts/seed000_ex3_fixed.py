# Seed 000, code example 3 as written: gradients edited between backward and step.
import torch


def forward_pass(input_tensor, model):
    return model(input_tensor)

def manual_grad_manipulation(input_data, target_data, model, optimizer):
  loss = forward_pass(input_data, model)
  loss.backward()
  
  for param in model.parameters():
     if param.grad is not None: # Check if the gradient exists. 
      param.grad *= 2.0 # Manually modify existing gradients

  optimizer.step()
  optimizer.zero_grad()
  # Attempting to backpropagate again will result in the error.
  #loss.backward()


# added to run it
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Tanh(), torch.nn.Flatten(0))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3):
    manual_grad_manipulation(torch.randn(1, 4), None, model, optimizer)
    print(f"iteration {i}: weight sum {model[0].weight.sum().item():.6f}")
