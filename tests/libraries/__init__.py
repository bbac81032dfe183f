"""Training loops owned by other libraries (pytorch-ignite's Engine, accelerate's Accelerator, mmengine's OptimWrapper
and Runner, opacus, transformers' Trainer with peft, pyro's SVI, gpytorch, skorch, pytorch-metric-learning,
torch-geometric, torchdiffeq, stable-baselines3, higher, zuko, normflows, torchmetrics, x-transformers, TorchRL,
poutyne, torch-ema, ema-pytorch, vector-quantize-pytorch, torchsde, kornia, diffusers, pytorch-optimizer, schedulefree,
torch-optimizer), run bare, under ``safeloop.watch`` and with ``safeloop.GraphGuard``: the library's own code, not a
copy. Each file is skipped unless its library is installed: ``pip install pytorch-ignite accelerate mmengine-lite
opencv-python-headless opacus transformers peft pyro-ppl gpytorch skorch pytorch-metric-learning torch-geometric
torchdiffeq stable-baselines3 gymnasium higher zuko normflows torchmetrics x-transformers torchrl poutyne torch-ema
ema-pytorch vector-quantize-pytorch torchsde kornia diffusers pytorch-optimizer schedulefree torch-optimizer`` after
``pip install torch==2.13.0``.
"""
