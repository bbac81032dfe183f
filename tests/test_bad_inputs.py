"""Bad input, every kind a user can give, and what each gets: a safeloop error that names the key (or
the thing) at fault and says what to do, never a traceback from deep inside torch or Hydra, and
nothing lost. The count of each outcome is what the README's Reliability section reports."""
import re
import shutil
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from safeloop import CheckpointError, ConfigError, NonFiniteError, NoGraphError, StepError, Trainer
from safeloop.checkpoint import Checkpointer
from safeloop.config import build, compose

BASE = ["trainer.max_steps=2", "trainer.val_every=null", "trainer.progress=false", "device=cpu"]
ADVICE = re.compile(r"give|must|choose|options|did you mean|drop|fix|is not|needs|asks for|no such|takes|lists every")

# command-line overrides -> the error they get (each message names the key and says what to do)
OVERRIDES = [
    ('trainer.max_steps=abc', ConfigError),
    ('trainer.max_steps=-5', ConfigError),
    ('trainer.max_steps=0', ConfigError),
    ('trainer.max_steps=1.5', ConfigError),
    ('trainer.max_epochs=-1', ConfigError),
    ('trainer.val_every=0', ConfigError),
    ('trainer.val_every=-3', ConfigError),
    ('trainer.val_every=abc', ConfigError),
    ('trainer.grad_accum=0', ConfigError),
    ('trainer.grad_accum=-2', ConfigError),
    ('trainer.grad_accum=x', ConfigError),
    ('trainer.grad_clip=-1', ConfigError),
    ('trainer.grad_clip=abc', ConfigError),
    ('trainer.grad_clip=0', ConfigError),
    ('trainer.precision=64', ConfigError),
    ('trainer.precision=fp16', ConfigError),
    ('trainer.precision=16', ConfigError),
    ('trainer.device=tpu', ConfigError),
    ('trainer.device=cuda:7', ConfigError),
    ('trainer.log_every=0', ConfigError),
    ('trainer.log_every=-1', ConfigError),
    ('trainer.multi_loss=mean', ConfigError),
    ('trainer.loss_weights=5', ConfigError),
    ('trainer.loss_weights={loss:abc}', ConfigError),
    ('trainer.loggers=[wandb]', ConfigError),
    ('trainer.loggers=csv', ConfigError),
    ('trainer.progress=maybe', ConfigError),
    ('trainer.resume=/nonexistent/ckpt.pt', ConfigError),
    ('trainer.on_nonfinite=ignore', ConfigError),
    ('trainer.max_skipped=-1', ConfigError),
    ('trainer.max_skipped=abc', ConfigError),
    ('trainer.find_unused_parameters=perhaps', ConfigError),
    ('trainer.undo=partial', ConfigError),
    ('trainer.undo=null', ConfigError),
    ('trainer.maxsteps=5', ConfigError),
    ('trainer._target_=nothere.Trainer', ConfigError),
    ('trainer._target_=torch.nn.Linear', ConfigError),
    ('trainer.precision=null', ConfigError),
    ('trainer.on_nonfinite=null', ConfigError),
    ('guard.check=sometimes', ConfigError),
    ('guard.check=null', ConfigError),
    ('guard.on_reuse=ignore', ConfigError),
    ('guard.warmup=-1', ConfigError),
    ('guard.warmup=abc', ConfigError),
    ('guard.budget=0', ConfigError),
    ('guard.budget=2', ConfigError),
    ('guard.budget=abc', ConfigError),
    ('guard.ignore=[carry]', ConfigError),
    ('guard.ignore=reuse', ConfigError),
    ('guard.chek=always', ConfigError),
    ('checkpoint.every=0', ConfigError),
    ('checkpoint.every=-1', ConfigError),
    ('checkpoint.every=abc', ConfigError),
    ('checkpoint.keep=0', ConfigError),
    ('checkpoint.keep=-2', ConfigError),
    ('checkpoint.dir=/proc/forbidden', CheckpointError),
    ('checkpoint.evry=5', ConfigError),
    ('optimizer.lr=abc', ConfigError),
    ('optimizer.lr=-1', ConfigError),
    ('optimizer.lr=null', ConfigError),
    ('optimizer.betas=[0.9]', ConfigError),
    ('optimizer.betas=abc', ConfigError),
    ('optimizer.weight_decay=-0.1', ConfigError),
    ('optimizer.momentum=0.9', ConfigError),
    ('optimizer._target_=torch.optim.Nothere', ConfigError),
    ('optimizer=adamm', ConfigError),
    ('optimizer=null', ConfigError),
    ('model.hidden=abc', ConfigError),
    ('model.hidden=0', ConfigError),
    ('model.hidden=-4', ConfigError),
    ('model.depth=0', ConfigError),
    ('model.in_dim=0', ConfigError),
    ('model.hiden=64', ConfigError),
    ('model._target_=nothere.Model', ConfigError),
    ('model=mlpp', ConfigError),
    ('data.batch_size=0', ConfigError),
    ('data.batch_size=-1', ConfigError),
    ('data.batch_size=abc', ConfigError),
    ('data.n_train=0', ConfigError),
    ('data.n_train=-10', ConfigError),
    ('data.n_val=-1', ConfigError),
    ('data.seed=abc', ConfigError),
    ('data=regresion', ConfigError),
    ('scheduler=abc', ConfigError),
    ('scheduler._target_=torch.optim.lr_scheduler.StepLR', ConfigError),
    ('seed=abc', ConfigError),
    ('seed=1.5', ConfigError),
    ('device=tpu', ConfigError),
    ('device=cuda', ConfigError),
    ('experiment=gann', ConfigError),
    ('debug=defualt', ConfigError),
    ('logger=wandb', ConfigError),
    ('recipe.nothere=1', ConfigError),
    ('+trainer.foo=1', ConfigError),
    ('trainer.max_steps=', ConfigError),
]
# accepted on purpose: a valid value of the right type, whatever it looks like
ACCEPTED = [
    "trainer.loss_weights={loss:-1}",  # a negative weight is gradient ascent on that loss (adversarial terms)
    "trainer.resume=auto",  # nothing to resume yet: the run starts, as documented
    "guard.trace=yes",  # YAML's yes is true: anomaly mode on (PyTorch warns that it is slow)
    "checkpoint.dir=123",  # on the command line 123 is a directory name
    "seed=-1",  # any integer seeds torch
]


def key_of(override: str) -> str:
    """What the message must name: the key's last part (``max_steps``), or the group (``optimizer``)."""
    return override.split("=", 1)[0].lstrip("+~").rsplit(".", 1)[-1]


@pytest.mark.parametrize("override, error", OVERRIDES, ids=[o for o, _ in OVERRIDES])
def test_a_bad_override_is_one_clear_error_naming_its_key(tmp_path, monkeypatch, override, error):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as info:
        build(compose([*BASE, f"checkpoint.dir={tmp_path / 'ckpt'}", override])).fit()
    message = str(info.value)
    assert re.search(re.escape(key_of(override)), message), message
    assert ADVICE.search(message), message
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step-*.pt"))  # nothing written


@pytest.mark.parametrize("override", ACCEPTED)
def test_a_valid_but_unusual_override_trains(tmp_path, monkeypatch, override):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        assert build(compose([*BASE, f"checkpoint.dir={tmp_path / 'ckpt'}", override])).fit().step == 2


def test_data_that_does_not_fit_the_model_is_named_at_the_first_validation_with_nothing_trained(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = build(compose([*BASE, "data.in_dim=3"]))  # the model still takes model.in_dim=16 inputs
    before = [p.clone() for p in trainer.model.parameters()]
    with pytest.raises(StepError, match=re.escape("validation at step 0 failed on batch 1 of val_data (training is "
                                                  "unchanged): RuntimeError: mat1 and mat2 shapes cannot be "
                                                  "multiplied (64x3 and 16x64)")):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
