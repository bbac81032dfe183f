"""on_nonfinite="error" (or "skip") fails at the first step of a model with a complex parameter (a Fourier
neural operator's spectral weights, dtype=torch.cfloat): the Trainer's finite check calls
torch._amp_foreach_non_finite_check_and_unscale_, which has no complex kernel. torch.isfinite works on complex.
Run: python repros/complex_gradients_nonfinite_check.py"""
import torch
from safeloop import Trainer


class Spectral(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = torch.nn.Parameter(torch.rand(3, dtype=torch.cfloat))

    def forward(self, x):
        return torch.fft.irfft(torch.fft.rfft(x) * self.weights, n=x.size(-1))


torch.manual_seed(0)
model = Spectral()
data = [(torch.randn(2, 4), torch.randn(2, 4))]
print("torch.isfinite on the gradient works:", torch.isfinite(torch.rand(3, dtype=torch.cfloat)).all().item())
Trainer(model=model, train_data=data, optimizer=torch.optim.Adam(model.parameters()), max_steps=1, device="cpu",
        progress=False, loggers=(), on_nonfinite="error").fit()
# StepError ... NotImplementedError: "_amp_foreach_non_finite_check_and_unscale_cpu" not implemented for 'ComplexFloat'
