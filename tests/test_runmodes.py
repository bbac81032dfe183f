"""The deterministic, compile and profile settings: what each does while fit runs."""
import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from safeloop import ConfigError, GraphLifecycleError, Trainer


def data(n=32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def trainer(cls=Trainer, **settings) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return cls(model=model, train_data=data(), max_steps=3, device="cpu", progress=False, loggers=(),
               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **settings)


def test_deterministic_algorithms_are_on_while_fit_runs_and_as_they_were_after():
    seen = []
    run = trainer(deterministic=True)
    run.on_step_end = lambda losses: seen.append(torch.are_deterministic_algorithms_enabled())
    assert not torch.are_deterministic_algorithms_enabled()
    run.fit()
    assert seen == [True, True, True]
    assert not torch.are_deterministic_algorithms_enabled()


def test_profile_writes_a_chrome_trace_of_the_steps_to_the_run_directory(tmp_path):
    trainer(run_dir=tmp_path, profile=2, checkpoint=False).fit()  # step 1 warms up, steps 2 and 3 are traced
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"aten::addmm", "aten::mse_loss", "Optimizer.step#SGD.step"} <= names
    assert sum(1 for n in names if str(n).startswith("ProfilerStep#")) == 2


@pytest.mark.parametrize("profile, problem", [
    (-1, "profile=-1: give the number of steps to trace (profile=3), or {active: N, wait: W, warmup: U}, or null"),
    ({"steps": 3}, "profile={'steps': 3}: give the number of steps to trace (profile=3), or {active: N, wait: W, "
                   "warmup: U}, or null (active > 0, the others >= 0)")])
def test_a_bad_profile_setting_says_what_to_give(profile, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)):
        trainer(profile=profile)


def test_profile_without_a_run_directory_says_where_its_trace_would_go():
    with pytest.raises(ConfigError, match=re.escape("profile=2 writes its trace to the run directory: pass "
                                                    "run_dir=...")):
        trainer(profile=2).fit()


class Carried(Trainer):
    """Adds a term computed in step 1 to every later loss: a graph reused across steps."""

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        if self.state.step == 0:
            self.kept = self.model(x).mean()
        return loss + (self.kept if self.reuse else 0)


def test_compile_trains_as_the_eager_model_checkpoints_clean_keys_and_the_guard_still_catches_reuse(tmp_path):
    eager, compiled = trainer(Carried), trainer(Carried, compile=True, run_dir=tmp_path, guard={"check": "always"})
    eager.reuse = compiled.reuse = False
    eager.fit()
    compiled.fit()
    # bit-identical on this CPU for this model, but inductor may fuse and reorder float operations: a tolerance
    for a, b in zip(eager.model.parameters(), compiled.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    saved = torch.load(compiled.checkpointer.last, weights_only=True)
    assert list(saved["modules"]["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    compiled.reuse, compiled.max_steps = True, 6
    with pytest.raises(GraphLifecycleError, match=re.escape("graph built before the step is reused (step 4")):
        compiled.fit()
