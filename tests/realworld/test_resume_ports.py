"""Ports of the other real-world cases, stopped midway and resumed from the checkpoint on disk by a new Trainer
(``resume="auto"``), against the same port run straight through: every parameter and buffer bit for bit.

Where a port keeps state on the Trainer, it saves it as docs/checkpoints.md says (``on_save_checkpoint`` /
``on_load_checkpoint``). JEM's replay buffer and labelled stream, CycleGAN's image pools (made in ``on_fit_start``,
which runs after ``on_load_checkpoint``: put back there), AWD-LSTM's hidden state and DINO's iteration counter are
saved so. Each resumes bit-identical, as timm's Lookahead and davda54/sam's ``SAM`` do with nothing saved by hand.
What these cases showed, each fixed:

- ``SAM.state_dict()`` leaves out its base SGD's momentum: checkpoints keep a wrapper's inner optimizers too;
- AWD-LSTM's data iterable draws its window lengths from NumPy's global generator: the interrupted epoch is drawn
  again from every global RNG state it started with, not torch's alone;
- DINO assigns its learning rate and weight decay from NumPy arrays (``param_group["lr"] = lr_schedule[it]``): the
  ``numpy.float64`` is saved as a Python number, where it made every checkpoint unloadable;
- JEM as ported keeps its replay buffer, a plain tensor written in place every step, on the Trainer without saving
  it: each save names it (``ConfigWarning``), as it names a module kept there.
"""
import itertools
import random
import re
import warnings

import numpy as np
import pytest
import torch

from safeloop import ConfigWarning

from . import test_awd_lstm as awd, test_dino as dino, test_gans as gans, test_jem as jem, test_sam as sam
from . import test_timm_lookahead as la
from .harness import assert_same, batches, bn_classifier, fixed, labelled


def straight_and_resumed(tmp_path, make_model, trainer, data, steps, stop, **kwargs):
    """The port run to ``steps``, and run to ``stop`` then resumed to ``steps`` by a new Trainer; each run starts
    as in a fresh process: the model built from the seed, the RNGs seeded. Persistent DataLoader workers are shut
    down after each run."""
    def run(directory, max_steps, resume=None):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        model = make_model()
        torch.manual_seed(1)
        t = trainer(model=model, train_data=data(model), max_steps=max_steps, device="cpu", progress=False,
                    loggers=(), checkpoint={"dir": str(tmp_path / directory)}, resume=resume, **kwargs)
        t.fit()
        if getattr(t.train_data, "_iterator", None) is not None:  # persistent workers
            t.train_data._iterator._shutdown_workers()
        return t
    straight = run("straight", steps)
    run("stopped", stop)
    resumed = run("stopped", steps, resume="auto")
    assert resumed.state.step == steps
    return straight, resumed


# -- davda54/sam ----------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("error")
def test_sam_resumed_midway_keeps_the_base_optimizers_momentum(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, sam.make_net, sam.SAMTrainer, sam.cifar,
                                             sam.EPOCHS * sam.PER_EPOCH, 1, optimizer=sam.make_optimizer)
    assert_same(resumed.model, straight.model)


# -- salesforce/awd-lstm-lm -------------------------------------------------------------------------------------
class AWDTrainer(awd.AWDTrainer):
    """The hidden state is set by ``on_epoch_start``, which a run resumed mid-pass does not call again: saved
    as the TBPTT recipe saves it."""

    def on_save_checkpoint(self, checkpoint):
        checkpoint["awd"] = {"hidden": self.hidden}

    def on_load_checkpoint(self, checkpoint):
        self.hidden = checkpoint["awd"]["hidden"]


@pytest.mark.filterwarnings("error")
def test_awd_lstm_resumed_mid_epoch_reads_the_same_windows(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, awd.make_model, AWDTrainer,
                                             lambda model: awd.Windows(awd.corpus(model)), awd.steps(), 1,
                                             optimizer=awd.make_optimizer, grad_clip=awd.args.clip)
    assert_same(resumed.model, straight.model)



# -- facebookresearch/dino --------------------------------------------------------------------------------------
class DINOTrainer(dino.DINOTrainer):
    """The port's iteration counter ``it`` indexes the schedules: saved by hand (the teacher, the loss's
    ``center`` buffer and the student are in the model)."""

    def on_save_checkpoint(self, checkpoint):
        checkpoint["dino"] = {"it": self.it}

    def on_load_checkpoint(self, checkpoint):
        self.it = checkpoint["dino"]["it"]


class FloatScheduleDINOTrainer(DINOTrainer):
    """The same schedules as Python floats (``tolist()``: the same values)."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        self.lr_schedule, self.wd_schedule, self.momentum_schedule = (
            s.tolist() for s in (self.lr_schedule, self.wd_schedule, self.momentum_schedule))
        return optimizer


def dino_runs(tmp_path, trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=re.escape("`torch.nn.utils.weight_norm` is deprecated"))
        return straight_and_resumed(tmp_path, dino.make_dino, trainer, lambda nets: dino.crops(),
                                    dino.EPOCHS * dino.PER_EPOCH, 2, max_epochs=dino.EPOCHS)


def test_dino_resumed_midway_with_its_numpy_schedules(tmp_path):
    straight, resumed = dino_runs(tmp_path, DINOTrainer)
    assert_same(resumed.model, straight.model)


def test_dino_resumed_midway_with_the_schedules_as_floats(tmp_path):
    """What fails above is the NumPy scalars alone: as floats, the teacher's EMA, the centre and the
    last layer's frozen first epoch go on as in the run that never stopped."""
    straight, resumed = dino_runs(tmp_path, FloatScheduleDINOTrainer)
    assert_same(resumed.model, straight.model)


# -- wgrathwohl/JEM ---------------------------------------------------------------------------------------------
class JEMTrainer(jem.JEM):
    """The replay buffer (a plain tensor on the Trainer) and the position in the cycled labelled batches, which
    ``training_step`` draws one a step, saved by hand."""

    def on_save_checkpoint(self, checkpoint):
        checkpoint["jem"] = {"replay_buffer": self.replay_buffer, "labelled_drawn": self.state.step}

    def on_load_checkpoint(self, checkpoint):
        self.replay_buffer.copy_(checkpoint["jem"]["replay_buffer"])
        self.labelled = itertools.islice(self.train_data.labelled(), checkpoint["jem"]["labelled_drawn"], None)


@pytest.mark.filterwarnings("error")
def test_jem_resumed_with_its_replay_buffer_and_labelled_stream_saved_by_hand(tmp_path):
    args = jem.make_args("batch")
    straight, resumed = straight_and_resumed(tmp_path, lambda: jem.get_model(args), JEMTrainer,
                                             lambda model: jem.Cifar(args), jem.STEPS, 3)
    assert_same(resumed.model, straight.model)
    assert torch.equal(resumed.replay_buffer, straight.replay_buffer)


def test_jem_as_ported_is_warned_that_checkpoints_miss_its_replay_buffer(tmp_path):
    args = jem.make_args(None)
    torch.manual_seed(0)
    model = jem.get_model(args)
    trainer = jem.JEM(model=model, train_data=jem.Cifar(args), max_steps=2, device="cpu", progress=False,
                      loggers=(), checkpoint={"dir": str(tmp_path)})
    with pytest.warns(ConfigWarning, match="replay_buffer"):
        trainer.fit()


# -- junyanz/pytorch-CycleGAN-and-pix2pix ------------------------------------------------------------------------
class CycleGANTrainer(gans.CycleGAN):
    """The two image pools of past fakes (lists of tensors and a count, on the Trainer) saved by hand. The port
    makes them in ``on_fit_start``, which runs after ``on_load_checkpoint``: the loaded pools are put back there."""

    saved = None

    def on_fit_start(self):
        super().on_fit_start()
        if self.saved is not None:
            for name, pool in (("A", self.fake_A_pool), ("B", self.fake_B_pool)):
                pool.num_imgs, pool.images = self.saved[name]["num_imgs"], list(self.saved[name]["images"])

    def on_save_checkpoint(self, checkpoint):
        checkpoint["pools"] = {name: {"num_imgs": pool.num_imgs, "images": list(pool.images)}
                               for name, pool in (("A", self.fake_A_pool), ("B", self.fake_B_pool))}

    def on_load_checkpoint(self, checkpoint):
        self.saved = checkpoint["pools"]


@pytest.mark.filterwarnings("error")
def test_cyclegan_resumed_with_its_image_pools_saved_by_hand(tmp_path):
    """Manual mode with two optimizers, resumed once the pools are full: the fakes handed back and replaced are
    drawn from Python's ``random``, whose state the checkpoint puts back."""
    straight, resumed = straight_and_resumed(tmp_path, gans.cyclegan, CycleGANTrainer,
                                             fixed(batches(6, (2, 3, 8, 8), (2, 3, 8, 8))), 6, 3)
    assert_same(resumed.model, straight.model)


# -- timm's Lookahead -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop", [4, 5], ids=["at_an_epoch_end", "mid_epoch"])
@pytest.mark.filterwarnings("error")
def test_timm_lookahead_resumed(tmp_path, stop):
    """A wrapper whose ``state_dict()`` is its base AdamW's, slow weights and step counts in the param groups
    included, and an ``on_epoch_end`` sync: resumed at a pass's end (the sync ran before the save) and within a
    pass whose lookahead cycle (k=3) is half done."""
    straight, resumed = straight_and_resumed(tmp_path, bn_classifier, la.LookaheadTrainer,
                                             fixed(labelled(la.BATCHES)), la.EPOCHS * la.BATCHES, stop)
    assert_same(resumed.model, straight.model)
