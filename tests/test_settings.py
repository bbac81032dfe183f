"""Settings: one default each, the same for ``Trainer(...)``, ``Guard(...)`` and the composed config."""
import dataclasses
import inspect
import re

import pytest
import torch
from omegaconf import OmegaConf

from safeloop import ConfigError, Trainer
from safeloop.config import CONFIG_DIR, build, compose
from safeloop.guard.guard import Guard
from safeloop.settings import CheckpointSettings, GuardSettings, Settings, TrainerGroup, names


def keyword_defaults(cls, settings) -> dict:
    """The defaults ``cls``'s signature gives the settings, as a config would hold them (lists, not tuples)."""
    params = inspect.signature(cls).parameters
    missing = [name for name in names(settings) if name not in params]
    assert not missing, f"{cls.__name__} takes no keyword argument {missing}"
    return OmegaConf.to_container(OmegaConf.create({name: params[name].default for name in names(settings)}))


def test_trainer_and_guard_keyword_defaults_are_the_dataclass_defaults():
    assert keyword_defaults(Trainer, Settings) == dataclasses.asdict(Settings())
    assert keyword_defaults(Guard, GuardSettings) == dataclasses.asdict(GuardSettings())


def test_trainer_built_with_defaults_uses_the_checkpoint_and_guard_defaults(tmp_path):
    trainer = Trainer(torch.nn.Linear(1, 1), [0], max_steps=1, device="cpu", run_dir=tmp_path)
    assert (trainer.checkpointer.every, trainer.checkpointer.keep) == (CheckpointSettings.every, CheckpointSettings.keep)
    assert trainer.checkpointer.dir == tmp_path / "checkpoints"  # CheckpointSettings.dir is None
    guard = trainer.guard
    assert GuardSettings(guard.on_reuse, guard.check, guard.trace, guard.warmup, guard.budget) == GuardSettings()
    assert trainer.undo == Settings.undo == "auto"


@pytest.mark.parametrize("group, schema", [("trainer", TrainerGroup), ("guard", GuardSettings),
                                           ("checkpoint", CheckpointSettings)])
def test_composed_groups_hold_the_dataclass_defaults_and_only_real_changes(group, schema):
    """A group's YAML may change a default for the command line's job, never repeat one; nothing else
    in the composed default job (device, logger groups...) changes the group."""
    own = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / "default.yaml"))
    own.pop("defaults")
    defaults = dataclasses.asdict(schema())
    repeated = {key: value for key, value in own.items() if defaults.get(key) == value}
    assert not repeated, f"configs/{group}/default.yaml repeats the dataclass defaults {repeated}"
    assert OmegaConf.to_container(compose()[group]) == {**defaults, **own}


def test_undo_is_checked_with_the_other_settings():
    with pytest.raises(ConfigError) as info:
        Trainer(torch.nn.Linear(1, 1), [0], max_steps=0, device="cpu", undo="x")
    assert info.value.problems == ["max_steps must be a positive integer, got 0",
                                   "undo='x' is not one of auto, full, off"]
    with pytest.raises(ConfigError, match=re.escape("undo='everything' is not one of auto, full, off")):
        build(compose(["trainer.undo=everything", "device=cpu"]))


def test_undo_from_the_command_line():
    assert build(compose(["trainer.undo=full", "device=cpu"])).undo == "full"
    assert build(compose(["device=cpu"])).undo == "auto"


def test_an_unknown_guard_setting_is_named_with_the_known_ones():
    with pytest.raises(ConfigError, match=re.escape(
            "guard has no setting 'chek': use on_reuse, check, trace, warmup, budget, ignore")):
        Trainer(torch.nn.Linear(1, 1), [0], max_steps=1, device="cpu", guard={"chek": "always"})


def construct(**kwargs) -> Trainer:
    args = dict(model=torch.nn.Linear(1, 1), train_data=[0], max_steps=1, device="cpu")
    args.update(kwargs)
    return Trainer(**args)


class NotACallback:
    def __repr__(self):
        return "NotACallback()"


@pytest.mark.parametrize("kwargs, message", [
    ({"guard": {"chek": "always"}}, "guard has no setting 'chek': use on_reuse, check, trace, warmup, budget, ignore"),
    ({"guard": {"budget": 0}}, "guard.budget must be a number in (0, 1] (the share of step time checks may take; "
                               "0.0025 is 0.25%), got 0"),
    ({"guard": {"warmup": -1}}, "guard.warmup must be an integer >= 0, got -1"),
    ({"guard": {"trace": "yes"}}, "guard.trace='yes' is a str; give True or False"),
    ({"guard": 5}, "guard=5 is an int; give a Guard, a GraphGuard, a Mapping[str, Any] or None"),
    ({"grad_clip": "1.0"}, "grad_clip must be a positive number or null, got '1.0'"),
    ({"checkpoint": {"dir": 123}}, "checkpoint.dir=123 is an int; give a string or None"),
    ({"checkpoint": 5}, "checkpoint=5 is an int; give a Mapping[str, Any], True or False or None"),
    ({"resume": 123}, "resume=123 is an int: give auto, or the path of a checkpoint file or directory (a str or Path)"),
    ({"optimizer": 42}, "optimizer=42 is an int; give an Optimizer, a callable or None"),
    ({"callbacks": [NotACallback()]}, "callbacks[0]=NotACallback() is a NotACallback; give a Callback"),
    ({"max_steps": True}, "max_steps must be a positive integer, got True"),
    ({"val_every": 0.5}, "val_every must be a positive integer, got 0.5: it counts optimizer steps, not a fraction of "
                         "a pass (Lightning's val_check_interval): give val_every=math.ceil(f * len(train_data) / "
                         "grad_accum)"),
    ({"loss_weights": {"loss": "2"}}, "loss_weights['loss']='2' is a str; give a number"),
    ({"loggers": "csv"}, "loggers='csv' is a str: give a list of logger names and logger objects (loggers=['csv'])"),
    ({"progress": "no"}, "progress='no' is a str; give True or False"),
    ({"train_data": 5}, "train_data=5 is an int; give an Iterable or None"),
    ({"loss_fn": 5}, "loss_fn=5 is an int; give a callable or None"),
    ({"run_dir": 5}, "run_dir=5 is an int; give a string, a Path or None"),
])
def test_a_bad_keyword_argument_is_a_config_error_naming_it(kwargs, message):
    with pytest.raises(ConfigError) as info:
        construct(**kwargs)
    assert info.value.problems == [message]


def test_every_bad_keyword_argument_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        construct(guard={"budget": 0, "warmup": -1}, grad_clip="1.0", checkpoint={"dir": 123}, resume=123,
                  optimizer=42, callbacks=[NotACallback()], max_steps=True)
    assert len(info.value.problems) == 8 and str(info.value).startswith("invalid configuration:\n  - max_steps must be")


def test_a_zero_guard_budget_from_the_command_line_is_refused_before_training():
    with pytest.raises(ConfigError, match=re.escape("guard.budget must be a number in (0, 1]")):
        build(compose(["guard.budget=0", "guard.warmup=1", "device=cpu"]))


def test_a_misspelt_setting_names_the_closest_one_and_the_settings_stay_attributes():
    with pytest.raises(ConfigError, match=re.escape("Trainer has no setting 'max_stepz': use max_steps, max_epochs")) \
            as info:
        construct(max_stepz=5)
    assert info.value.problems[0].endswith("(did you mean max_steps?)")
    trainer = construct(max_steps=3, grad_clip=1.0)
    assert trainer.settings.max_steps == trainer.max_steps == 3
    trainer.max_steps = 7  # read by a later fit()
    assert trainer.settings.max_steps == 7 and trainer.grad_clip == 1.0
    assert inspect.signature(Trainer).parameters["undo"].default == "auto"
