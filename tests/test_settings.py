"""Settings: one default each, the same for ``Trainer(...)``, ``Guard(...)`` and the composed config."""
import dataclasses
import inspect
import re

import pytest
import torch
from omegaconf import OmegaConf

from safeloop import ConfigError, Guard, Trainer
from safeloop.config import CONFIG_DIR, build, compose
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
            "guard has no setting 'chek': use on_reuse, check, trace, warmup, budget")):
        Trainer(torch.nn.Linear(1, 1), [0], max_steps=1, device="cpu", guard={"chek": "always"})
