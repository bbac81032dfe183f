"""Validation during ``fit()``, ``trainer.validate()``, ``trainer.test(data)`` and ``trainer.predict(data)`` as public
evaluation code uses them, compared bit for bit with the hand-written loop doing the same thing, or with what
docs/trainer.md promises.

Sources followed (each test names its own): pseudo-labelling with a model's own predictions, in a second fit and
at each pass's start (Lee 2013's Pseudo-Label); Monte Carlo dropout in ``predict_step`` (Lightning-AI/
pytorch-lightning, docs/source-pytorch/deploy/production_basic.rst, ``LitMCdropoutModel``); a frozen BatchNorm
backbone and a linear probe kept in eval mode (facebookresearch/moco, main_lincls.py); EMA weights swapped in
around evaluation (fadel/pytorch_ema) and timm's ``ModelEmaV2`` validated beside the model
(huggingface/pytorch-image-models, timm/utils/model_ema.py); pytorch/examples word_language_model/main.py
``evaluate``; the GLUE tutorial's ``validation_step`` and a metric over the whole set (Lightning-AI/tutorials,
lightning_examples/text-transformers/text-transformers.py; huggingface/transformers,
examples/pytorch/text-classification/run_glue_no_trainer.py); loralib's merging ``Linear`` (microsoft/LoRA,
loralib/layers.py, examples/NLG/src/gpt2_ft.py); Lightning's prediction writer, several test loaders, ``self.log``
in ``validation_step`` and ``trainer.validate()`` after ``fit()`` or after Ctrl-C in a notebook; batches held in a
frozen dataclass or a nested tensor (pytorch/tutorials, prototype_source/nestedtensor.py). Models are a few small
layers on seeded data.

Each case that fails today is a strict xfail whose reason says what goes wrong and where.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import math
import os
import re
import signal
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from safeloop import Callback, ConfigError, ConfigWarning, EarlyStopping, StepError, Trainer

QUIET = dict(device="cpu", progress=False, loggers=())


def classes(n: int, seed: int, k: int = 4) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, generator=gen), torch.randint(0, k, (n,), generator=gen))


class Net(nn.Module):
    """A backbone with BatchNorm and a head with dropout: the two parts evaluation changes."""

    def __init__(self, p: float = 0.3):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Sequential(nn.Dropout(p), nn.Linear(8, 4))

    def forward(self, x):
        return self.head(self.backbone(x))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class Classifier(Trainer):
    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


def hand_epoch(model, optimizer, loader) -> None:
    model.train()
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


# -- pseudo-labelling: predictions of one fit become the targets of the next


def test_pseudo_labels_from_predict_train_a_second_fit_as_the_hand_loop():
    """Pseudo-Label (Lee 2013) as a two-stage script: train on the labelled set, ``predict`` the unlabelled one
    (``model.eval()``, ``torch.no_grad()``, logits of each batch concatenated in order), take the argmax as targets,
    train on. The predictions equal the hand loop's bit for bit, can be used as training data (no inference
    tensors), and the second ``fit()`` ends with the hand loop's weights and BatchNorm statistics."""
    labelled, unlabelled = classes(16, 0), classes(12, 5)
    torch.manual_seed(3)
    model = Net()
    optimizer = sgd(model.parameters())
    for _ in range(2):
        hand_epoch(model, optimizer, DataLoader(labelled, batch_size=4, shuffle=True))
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x) for x, _ in DataLoader(unlabelled, batch_size=5)])
    pseudo = TensorDataset(unlabelled.tensors[0], logits.argmax(1))
    for _ in range(2):
        hand_epoch(model, optimizer, DataLoader(pseudo, batch_size=4, shuffle=True))

    torch.manual_seed(3)
    trainer = Classifier(model=Net(), train_data=DataLoader(labelled, batch_size=4, shuffle=True), optimizer=sgd,
                         max_epochs=2, **QUIET)
    trainer.fit()
    predictions = trainer.predict(DataLoader(unlabelled, batch_size=5))
    assert [len(p) for p in predictions] == [5, 5, 2] and trainer.model.training
    assert torch.equal(torch.cat(predictions), logits)
    assert not any(p.requires_grad or p.is_inference() for p in predictions)
    ours = TensorDataset(unlabelled.tensors[0], torch.cat(predictions).argmax(1))
    trainer.train_data = DataLoader(ours, batch_size=4, shuffle=True)
    trainer.max_epochs = 4
    trainer.fit()
    assert trainer.state.step == 2 * 4 + 2 * 3
    assert same(trainer.model, model)


class Refreshed(Classifier):
    """Self-training that labels the unlabelled set again at each pass's start with the model as it is then."""

    def __init__(self, labelled, unlabelled, **kwargs):
        super().__init__(train_data=DataLoader(labelled, batch_size=7), **kwargs)
        self.labelled, self.unlabelled = labelled, unlabelled

    def on_epoch_start(self):
        logits = torch.cat(self.predict(DataLoader(TensorDataset(self.unlabelled.tensors[0]), batch_size=4)))
        x = torch.cat([self.labelled.tensors[0], self.unlabelled.tensors[0]])
        y = torch.cat([self.labelled.tensors[1], logits.argmax(1)])
        self.train_data = DataLoader(TensorDataset(x, y), batch_size=7, shuffle=True)


def test_pseudo_labels_predicted_at_each_pass_start_inside_fit_train_as_the_hand_loop():
    """The same labelling done inside ``fit()`` (``on_epoch_start`` calls ``self.predict``) and a new shuffled
    loader each pass. docs/trainer.md: inside ``fit()`` an evaluation gives the random generators back, so the hand
    loop labels inside ``torch.random.fork_rng()`` (its DataLoader draws a base seed). Three passes, bit for bit."""
    labelled, unlabelled = classes(16, 0), classes(12, 5)
    torch.manual_seed(3)
    model = Net()
    optimizer = sgd(model.parameters())
    for _ in range(3):
        with torch.random.fork_rng():
            model.eval()
            with torch.no_grad():
                logits = torch.cat([model(x) for (x,) in DataLoader(TensorDataset(unlabelled.tensors[0]),
                                                                      batch_size=4)])
        x = torch.cat([labelled.tensors[0], unlabelled.tensors[0]])
        y = torch.cat([labelled.tensors[1], logits.argmax(1)])
        hand_epoch(model, optimizer, DataLoader(TensorDataset(x, y), batch_size=7, shuffle=True))

    torch.manual_seed(3)
    trainer = Refreshed(labelled, unlabelled, model=Net(), optimizer=sgd, max_epochs=3, **QUIET)
    trainer.fit()
    assert trainer.state.step == 3 * 4
    assert same(trainer.model, model)


# -- Monte Carlo dropout in predict_step


class MCDropout(Trainer):
    """Lightning's ``LitMCdropoutModel`` (docs/source-pytorch/deploy/production_basic.rst): a dropout module beside
    the model, put in train mode in ``predict_step``, averaged over ``mc_iteration`` forwards; the prediction
    returned as a dict with the input's index, as a ``predict_step`` returning several things."""

    def __init__(self, mc_iteration: int, **kwargs):
        super().__init__(**kwargs)
        self.dropout = nn.Dropout()
        self.mc_iteration = mc_iteration

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.dropout(self.model(x)), y)

    def predict_step(self, batch):
        x, index = batch
        self.dropout.train()
        pred = torch.vstack([self.dropout(self.model(x)).unsqueeze(0) for _ in range(self.mc_iteration)]).mean(dim=0)
        return {"pred": pred, "index": index}


def test_mc_dropout_predictions_outside_fit_draw_as_the_hand_loop_and_differ_between_calls():
    """docs/trainer.md, Test and predict: outside ``fit()`` predictions draw from the global generators as a
    hand-written loop would, and two ``predict()`` calls draw different masks. The model's own BatchNorm is in
    eval mode (running statistics), each batch's dict comes back in order, and the model is in train mode after."""
    data = TensorDataset(classes(10, 2).tensors[0], torch.arange(10))
    net = Net(p=0.0)
    with torch.no_grad():  # statistics that differ from the batch's own
        net(classes(32, 9).tensors[0] * 3 + 1)
    model, dropout = copy.deepcopy(net), nn.Dropout()
    torch.manual_seed(11)
    model.eval()
    hand = []
    with torch.no_grad():
        for _ in range(2):
            hand.append([torch.vstack([dropout(model(x)).unsqueeze(0) for _ in range(3)]).mean(dim=0)
                         for x, _ in DataLoader(data, batch_size=4)])

    trainer = MCDropout(3, model=net, train_data=[], max_steps=1, **QUIET)
    torch.manual_seed(11)
    first = trainer.predict(DataLoader(data, batch_size=4))
    second = trainer.predict(DataLoader(data, batch_size=4))
    assert [o["index"].tolist() for o in first] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(torch.equal(a, o["pred"]) for a, o in zip(hand[0], first))
    assert all(torch.equal(a, o["pred"]) for a, o in zip(hand[1], second))
    assert not torch.equal(first[0]["pred"], second[0]["pred"])
    assert all(m.training for m in net.modules())


# -- a frozen backbone kept in eval mode, validated during fit


class FrozenBackbone(Classifier):
    """main_lincls.py's protocol for part of the model: the backbone's parameters frozen and its BatchNorm kept in
    eval mode (set once, in ``on_fit_start``), the head trained with its dropout."""

    def on_fit_start(self):
        self.model.backbone.eval()

    def configure_optimizers(self):
        return sgd([p for p in self.model.parameters() if p.requires_grad])


def hand_validate(model, loader) -> float:
    """pytorch/examples imagenet/main.py ``validate``: eval mode, no_grad, the loss averaged over samples; each
    module's own mode given back after, and inside ``fork_rng`` (docs/trainer.md, Validation)."""
    modes = [m.training for m in model.modules()]
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.random.fork_rng():
        for x, y in loader:
            total += F.cross_entropy(model(x), y).item() * x.size(0)
            count += x.size(0)
    for m, training in zip(model.modules(), modes):
        m.training = training
    return total / count


def frozen_backbone() -> tuple[nn.Module, list]:
    """The hand loops' model (seed 3): the backbone frozen and in eval mode, the head training; its trained
    parameters."""
    torch.manual_seed(3)
    model = Net()
    model.backbone.requires_grad_(False)
    model.train()
    model.backbone.eval()
    return model, [p for p in model.parameters() if p.requires_grad]


def test_frozen_backbone_statistics_do_not_move_through_validations_during_fit():
    """Validation every 3 steps, mid-pass (5 batches a pass), two passes: the backbone stays in eval mode after
    each validation (its BatchNorm statistics equal the initial ones at the end), the head's dropout trains, and
    the weights and each validation's loss equal the hand loop's bit for bit."""
    train, val = classes(20, 0), DataLoader(classes(10, 1), batch_size=4)
    model, params = frozen_backbone()
    stats = copy.deepcopy(model.backbone.state_dict())
    optimizer = sgd(params)
    hand, step = [], 0
    for _ in range(2):
        for x, y in DataLoader(train, batch_size=4, shuffle=True):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1
            if step % 3 == 0:
                hand.append(hand_validate(model, val))

    torch.manual_seed(3)
    net = Net()
    net.backbone.requires_grad_(False)
    trainer = FrozenBackbone(model=net, train_data=DataLoader(train, batch_size=4, shuffle=True), val_data=val,
                             val_every=3, max_epochs=2, **QUIET)
    trainer.fit()
    assert same(trainer.model, model)
    assert all(torch.equal(v, stats[k]) for k, v in net.backbone.state_dict().items())
    assert not any(m.training for m in net.backbone.modules()) and net.head.training and net.head[0].training
    assert [s for s, _ in trainer.state.val_history] == [0, 3, 6, 9, 10]
    assert [m["val_loss"] for _, m in trainer.state.val_history[1:4]] == hand


# -- EMA weights swapped in around each validation


class SwappedEMA(FrozenBackbone):
    """fadel/pytorch_ema's ``ExponentialMovingAverage`` (``update``: ``s -= (1 - decay) * (s - p)``; ``store``,
    ``copy_to``, ``restore`` around evaluation), written out; ``validate()`` overridden to evaluate the averaged
    weights, as its README's ``with ema.average_parameters():`` around the evaluation does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shadow = [p.detach().clone() for p in self.model.parameters() if p.requires_grad]

    def on_step_end(self, losses):
        with torch.no_grad():
            for s, p in zip(self.shadow, [p for p in self.model.parameters() if p.requires_grad]):
                s.sub_((1.0 - 0.9) * (s - p))

    def validate(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        stored = [p.detach().clone() for p in params]
        with torch.no_grad():
            for s, p in zip(self.shadow, params):
                p.copy_(s)
        try:
            return super().validate()
        finally:
            with torch.no_grad():
                for s, p in zip(stored, params):
                    p.copy_(s)


def test_ema_weights_swapped_in_around_validate_train_and_score_as_the_hand_loop():
    """The model trains on its own weights (bit for bit as the hand loop), and each validation scores the shadow
    weights: the same losses as the hand loop's ``store``, ``copy_to``, validate, ``restore``."""
    train, val = classes(20, 0), DataLoader(classes(10, 1), batch_size=4)
    model, params = frozen_backbone()
    shadow = [p.detach().clone() for p in params]
    optimizer = sgd(params)
    hand, step = [], 0
    for _ in range(2):
        for x, y in DataLoader(train, batch_size=4, shuffle=True):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            with torch.no_grad():
                for s, p in zip(shadow, params):
                    s.sub_((1.0 - 0.9) * (s - p))
            step += 1
            if step % 3 == 0:
                stored = [p.detach().clone() for p in params]
                with torch.no_grad():
                    for s, p in zip(shadow, params):
                        p.copy_(s)
                hand.append(hand_validate(model, val))
                with torch.no_grad():
                    for s, p in zip(stored, params):
                        p.copy_(s)

    torch.manual_seed(3)
    net = Net()
    net.backbone.requires_grad_(False)
    trainer = SwappedEMA(model=net, train_data=DataLoader(train, batch_size=4, shuffle=True), val_data=val,
                         val_every=3, max_epochs=2, **QUIET)
    trainer.fit()
    assert same(trainer.model, model)
    assert all(torch.equal(a, b) for a, b in zip(trainer.shadow, shadow))
    assert [m["val_loss"] for _, m in trainer.state.val_history[1:4]] == hand


# -- pytorch/examples word_language_model: sequence-first batches, a hidden state carried across them


class RNNModel(nn.Module):
    """word_language_model/model.py ``RNNModel`` (LSTM): encoder, LSTM, decoder, ``log_softmax`` over the
    flattened output; ``init_hidden(bsz)``."""

    def __init__(self, ntoken=10, ninp=4, nhid=6):
        super().__init__()
        torch.manual_seed(0)
        self.ntoken, self.nhid = ntoken, nhid
        self.encoder, self.rnn = nn.Embedding(ntoken, ninp), nn.LSTM(ninp, nhid)
        self.decoder, self.drop = nn.Linear(nhid, ntoken), nn.Dropout(0.2)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(input)), hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return weight.new_zeros(1, bsz, self.nhid), weight.new_zeros(1, bsz, self.nhid)


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def get_batch(source, i, bptt=4):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)


class WordLM(Trainer):
    """main.py's ``evaluate`` as ``validation_step``: the hidden state carried from batch to batch (made at the
    pass's first batch, let go in ``on_validation_end``), each batch weighed by its sequence length, returned as
    ``(loss, len(data))`` for these sequence-first batches as docs/trainer.md says."""

    hidden = None

    def validation_step(self, batch):
        data, targets = batch
        if self.hidden is None:
            self.hidden = self.model.init_hidden(data.size(1))
        output, hidden = self.model(data, self.hidden)
        self.hidden = repackage_hidden(hidden)
        return F.nll_loss(output, targets), len(data)

    def on_validation_end(self, metrics):
        self.hidden = None


def test_word_language_model_evaluate_matches_validate_and_test_bit_for_bit():
    """main.py's ``evaluate(data_source)``: ``total_loss += len(data) * criterion(output, targets).item()`` over
    chunks of ``bptt`` (4, 4, 4 and a last one of 2), divided by ``len(data_source) - 1``: ``val_loss`` and
    ``test_loss`` equal it exactly, with dropout off and the hidden state carried as there; the model is back in
    train mode after each."""
    gen = torch.Generator().manual_seed(4)
    val_source = torch.randint(0, 10, (15, 3), generator=gen)  # batchify(corpus.valid, eval_batch_size=3)
    test_source = torch.randint(0, 10, (11, 3), generator=gen)
    model = RNNModel()

    def evaluate(data_source):
        model.eval()
        total_loss, hidden = 0.0, model.init_hidden(3)
        with torch.no_grad():
            for i in range(0, data_source.size(0) - 1, 4):
                data, targets = get_batch(data_source, i)
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
                total_loss += len(data) * F.nll_loss(output, targets).item()
        return total_loss / (len(data_source) - 1)

    def chunks(source):
        return [get_batch(source, i) for i in range(0, source.size(0) - 1, 4)]

    trainer = WordLM(model=RNNModel(), train_data=[], val_data=chunks(val_source), max_steps=1, **QUIET)
    assert trainer.validate() == {"val_loss": evaluate(val_source)}
    assert trainer.test(chunks(test_source)) == {"test_loss": evaluate(test_source)}
    assert trainer.model.training and trainer.state.val_history[0][0] == 0


# -- timm's ModelEmaV2 returned from modules(), under bf16-true


class ModelEma(Classifier):
    """timm's ``ModelEmaV2``: a deep copy of the model, put in eval mode once, made in ``__init__`` (docs/trainer.md:
    ``modules()`` is read as ``fit()`` sets up, so the modules it returns are made in ``__init__``), moved towards
    the model after each step over the state dict's entries, and validated beside the model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ema = copy.deepcopy(self.model).eval()

    def modules(self):
        return {"model": self.model, "ema": self.ema}

    def on_step_end(self, losses):
        with torch.no_grad():
            for e, m in zip(self.ema.state_dict().values(), self.model.state_dict().values()):
                e.copy_(0.9 * e + 0.1 * m)

    def validation_step(self, batch):
        x, y = batch
        return {"loss": F.cross_entropy(self.model(x), y), "ema": F.cross_entropy(self.ema(x), y)}


def test_ema_in_modules_is_validated_under_bf16_true_as_the_cast_copy():
    """Lightning's ``bf16-true`` casts the whole LightningModule, an EMA copy kept on it included. Here the copy the
    docs say to make in ``__init__`` is validated beside the model: ``val_ema`` equals the loss of the EMA cast to
    bfloat16 as the model is, after the same two steps."""
    trainer = ModelEma(model=Net(p=0.0), train_data=DataLoader(classes(12, 0), batch_size=4),
                       val_data=DataLoader(classes(8, 1), batch_size=4), val_every=2, max_steps=2,
                       precision="bf16-true", optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **QUIET)
    trainer.fit()
    ema = copy.deepcopy(trainer.ema).bfloat16().eval()
    with torch.no_grad():
        losses = [F.cross_entropy(ema(x.bfloat16()), y).item() * len(y) for x, y in trainer.val_data]
    assert trainer.state.val_history[-1] == (2, {"val_loss": trainer.state.val_history[-1][1]["val_loss"],
                                                 "val_ema": sum(losses) / 8})


# -- the GLUE tutorial's validation: loss per batch, a metric over every prediction


class Glue(Classifier):
    """text-transformers.py's ``GLUETransformer``, reduced: ``validation_step`` computes the loss and the predictions;
    the accuracy is computed over the whole set at the pass's end (the tutorial's ``validation_epoch_end``, here
    ``on_validation_end(metrics)`` as docs/trainer.md's Lightning table says)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.outputs: list[dict] = []

    def validation_step(self, batch):
        x, labels = batch
        logits = self.model(x)
        val_loss = F.cross_entropy(logits, labels)
        self.outputs.append({"preds": torch.argmax(logits, axis=1), "labels": labels})
        return val_loss

    def on_validation_end(self, metrics):
        preds = torch.cat([o["preds"] for o in self.outputs])
        labels = torch.cat([o["labels"] for o in self.outputs])
        metrics["accuracy"] = float((preds == labels).sum()) / len(labels)  # evaluate's accuracy: correct / total
        self.outputs.clear()


def test_glue_validation_metric_over_every_prediction_matches_run_glue_no_trainer():
    """run_glue_no_trainer.py's eval: ``model.eval()``, each batch's predictions and references added to the metric,
    ``metric.compute()`` over all of them (accuracy = correct / total); 11 samples in batches of 4, 4, 3. The
    accuracy (added in the hook) and the per-sample mean loss equal the hand evaluation's exactly, in
    ``val_history`` after 3 steps and in what a later ``validate()`` returns; the collected outputs are cleared."""
    val = DataLoader(classes(11, 1), batch_size=4)
    torch.manual_seed(3)
    model = Net()
    optimizer = sgd(model.parameters())
    for x, y in DataLoader(classes(12, 0), batch_size=4):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.eval()
    preds, refs, total = [], [], 0.0
    with torch.no_grad():
        for x, y in val:
            logits = model(x)
            total += F.cross_entropy(logits, y).item() * len(y)
            preds.append(logits.argmax(-1))
            refs.append(y)
    accuracy = float((torch.cat(preds) == torch.cat(refs)).sum()) / 11

    torch.manual_seed(3)
    trainer = Glue(model=Net(), train_data=DataLoader(classes(12, 0), batch_size=4), val_data=val, max_steps=3,
                   val_every=3, optimizer=sgd, **QUIET)
    trainer.fit()
    step, metrics = trainer.state.val_history[-1]
    assert step == 3 and metrics == {"val_loss": total / 11, "accuracy": accuracy}
    assert trainer.validate() == {"val_loss": total / 11, "accuracy": accuracy}
    assert trainer.outputs == [] and trainer.model.training


class GlueDict(Glue):
    """The tutorial's ``validation_step`` as written there: it returns the loss with the predictions and labels."""

    def validation_step(self, batch):
        x, labels = batch
        logits = self.model(x)
        val_loss = F.cross_entropy(logits, labels)
        preds = torch.argmax(logits, axis=1)
        self.outputs.append({"preds": preds, "labels": labels})
        return {"loss": val_loss, "preds": preds, "labels": labels}


def test_glue_validation_step_returning_predictions_is_told_which_entry_is_no_loss():
    """Porting the tutorial's ``return {"loss": val_loss, "preds": preds, "labels": labels}`` as it is: the error
    names the entry ``preds`` and its shape, as a non-scalar loss from ``training_step`` is named."""
    trainer = GlueDict(model=Net(), train_data=DataLoader(classes(12, 0), batch_size=4),
                       val_data=DataLoader(classes(11, 1), batch_size=4), max_steps=2, val_every=1, optimizer=sgd,
                       **QUIET)
    with pytest.raises(StepError, match=r"'preds'.*shape \(4,\)"):
        trainer.fit()


# -- a linear probe that keeps the whole model in eval mode, fitted twice


class Probe(Classifier):
    """main_lincls.py's ``train()``: ``model.eval()`` at each epoch's start, on purpose (BatchNorm statistics are
    part of the pre-trained model); only the last layer trains."""

    def on_epoch_start(self):
        self.model.eval()

    def configure_optimizers(self):
        return sgd(self.model.head.parameters())


def test_linear_probe_eval_mode_set_in_on_epoch_start_stays_quiet_in_a_second_fit():
    """docs/trainer.md, Mistakes that would otherwise be silent: eval mode the run's own code sets (MoCo's
    ``main_lincls.py`` calls ``model.eval()`` at each epoch's start) is not reported. Training goes on in a second
    ``fit()`` (docs: a later fit goes on from this one), validating every pass: both fits are quiet, the
    statistics never move and the weights equal the hand loop's."""
    train, val = classes(16, 0), DataLoader(classes(8, 1), batch_size=4)
    torch.manual_seed(3)
    model = Net()
    stats = copy.deepcopy(model.backbone.state_dict())
    optimizer = sgd(model.head.parameters())
    for _ in range(2):
        model.eval()
        for x, y in DataLoader(train, batch_size=4, shuffle=True):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    torch.manual_seed(3)
    trainer = Probe(model=Net(), train_data=DataLoader(train, batch_size=4, shuffle=True), val_data=val,
                    val_every=4, max_epochs=1, **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        trainer.fit()
        trainer.max_epochs = 2
        trainer.fit()
    assert trainer.state.step == 8
    assert all(torch.equal(v, stats[k]) for k, v in trainer.model.backbone.state_dict().items())
    assert same(trainer.model, model)


# -- trainer.validate() in a notebook after Ctrl-C stopped the fit


class CtrlC(Classifier):
    """A Jupyter interrupt (SIGINT) arriving once, while step ``at`` runs (tests/test_failures_real.py's)."""

    at: int | None = None

    def training_step(self, batch):
        if self.state.step + 1 == self.at:
            self.at = None
            os.kill(os.getpid(), signal.SIGINT)
        return super().training_step(batch)

    def validation_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


def test_validate_after_ctrl_c_is_not_counted_by_early_stopping_and_the_fit_goes_on():
    """docs/trainer.md, Early stopping: a ``trainer.validate()`` of your own counts when a hook calls it during the
    steps, "not outside ``fit()``". In a notebook, Ctrl-C stops the fit after step 3 (docs/checkpoints.md: the run
    stops cleanly); the user looks at the metrics twice with ``trainer.validate()``, then calls ``fit()`` again to go
    on. It trains to ``max_steps`` with the weights and early-stopping state of the run that was never stopped."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    data = classes(32, 0)

    def run(interrupt: bool):
        torch.manual_seed(0)
        stopping = EarlyStopping(patience=2)
        trainer = CtrlC(model=nn.Linear(3, 4), train_data=DataLoader(data, batch_size=4),
                        val_data=DataLoader(data, batch_size=8), val_every=1, max_steps=8,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.01), callbacks=[stopping], **QUIET)
        if interrupt:
            trainer.at = 3
            trainer.fit()
            assert (trainer.state.step, trainer.stop_signal) == (3, signal.SIGINT)
            looked = [trainer.validate(), trainer.validate()]
            assert looked[0] == looked[1] == trainer.state.val_history[3][1]
        trainer.fit()
        return trainer, stopping

    never, stopping = run(False)
    assert (never.state.step, stopping.wait, stopping.best_step) == (8, 0, 8)
    trainer, stopping = run(True)
    assert (trainer.state.step, stopping.wait, stopping.best_step) == (8, 0, 8)
    assert same(trainer.model, never.model)


# -- LoRA layers that merge their weights in eval mode


class LoRALinear(nn.Linear):
    """microsoft/LoRA, loralib/layers.py ``Linear`` (``fan_in_fan_out`` and ``lora_dropout`` left out): the frozen
    weight plus ``B @ A * scaling``; its ``train(mode)`` merges ``B @ A`` into the weight on ``eval()`` and takes
    it out again on ``train()`` (``merge_weights=True``, the default), and its forward adds the low-rank path only
    while unmerged."""

    def __init__(self, in_features: int, out_features: int, r: int = 2, lora_alpha: int = 4):
        super().__init__(in_features, out_features)
        self.r, self.scaling, self.merge_weights, self.merged = r, lora_alpha / r, True, False
        self.lora_A = nn.Parameter(self.weight.new_zeros((r, in_features)))
        self.lora_B = nn.Parameter(self.weight.new_zeros((out_features, r)))
        self.weight.requires_grad = False
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def train(self, mode: bool = True):
        nn.Linear.train(self, mode)
        if mode:
            if self.merge_weights and self.merged:
                self.weight.data -= (self.lora_B @ self.lora_A) * self.scaling
                self.merged = False
        else:
            if self.merge_weights and not self.merged:
                self.weight.data += (self.lora_B @ self.lora_A) * self.scaling
                self.merged = True

    def forward(self, x):
        if self.r > 0 and not self.merged:
            result = F.linear(x, self.weight, bias=self.bias)
            result += (x @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)) * self.scaling
            return result
        return F.linear(x, self.weight, bias=self.bias)


def lora_net() -> nn.Module:
    """Two LoRA layers, ``mark_only_lora_as_trainable`` (loralib/utils.py, bias="none") applied."""
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(3, 8), nn.Tanh(), LoRALinear(8, 4))
    for name, p in model.named_parameters():
        if "lora_" not in name:
            p.requires_grad = False
    return model


class LoRA(Classifier):
    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.1)


def test_lora_layers_merged_by_validation_are_unmerged_for_training():
    """microsoft/LoRA examples/NLG/src/gpt2_ft.py: ``evaluate`` calls ``model.eval()`` (merging) and training goes
    on after ``model.train()`` (unmerging). The same run with ``val_data``, validating before training and every 2
    steps: each validation loss and the weights (the frozen ones moved by rounding at each merge) bit for bit."""
    data = classes(16, 0)
    val = DataLoader(data, batch_size=8)
    model = lora_net()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    def evaluate():
        model.eval()
        total = 0.0
        with torch.no_grad():
            for x, y in val:
                total += F.cross_entropy(model(x), y).item() * len(y)
        model.train()
        return total / 16

    hand = [evaluate()]
    for step, (x, y) in enumerate(DataLoader(data, batch_size=4), 1):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step % 2 == 0:
            hand.append(evaluate())

    trainer = LoRA(model=lora_net(), train_data=DataLoader(data, batch_size=4), val_data=val, val_every=2,
                   max_steps=4, **QUIET)
    trainer.fit()
    assert [m["val_loss"] for _, m in trainer.state.val_history] == hand
    assert not trainer.model[0].merged and same(trainer.model, model)


# -- a Lightning prediction writer kept in a predict-only script


class BatchWriter(Callback):
    """Lightning's ``BasePredictionWriter`` with ``write_interval="batch"`` (src/lightning/pytorch/callbacks/
    prediction_writer.py: its ``on_predict_batch_end`` calls ``write_on_batch_end``), and the docs' ``CustomWriter``
    saving each batch's prediction to ``<output_dir>/<batch_idx>.pt``, ported as a safeloop ``Callback``."""

    def __init__(self, output_dir):
        self.output_dir = output_dir

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        torch.save(outputs, os.path.join(self.output_dir, f"{batch_idx}.pt"))


def test_a_lightning_prediction_writer_is_refused_by_predict_as_by_fit(tmp_path):
    """docs/trainer.md, Coming from Lightning: a callback that keeps one of Lightning's names safeloop never calls
    is a ``ConfigError`` naming safeloop's way. ``fit()`` says so; so does ``predict()`` in a script that only
    predicts with trained weights (no fit), rather than returning the predictions with no file written."""
    data = DataLoader(TensorDataset(classes(10, 2).tensors[0]), batch_size=4)
    writer = BatchWriter(str(tmp_path))
    fitted = Classifier(model=Net(), train_data=DataLoader(classes(8, 0), batch_size=4), max_steps=1, optimizer=sgd,
                        callbacks=[writer], **QUIET)
    with pytest.raises(ConfigError, match="on_predict_batch_end"):
        fitted.fit()
    loaded = Classifier(model=Net(), train_data=[], max_steps=1, callbacks=[writer], **QUIET)
    with pytest.raises(ConfigError, match="on_predict_batch_end"):
        loaded.predict(data)
    assert not list(tmp_path.iterdir())


# -- a batch held in a frozen dataclass


@dataclasses.dataclass(frozen=True)
class Batch:
    """A typed batch as training code written without Lightning keeps it: immutable, tensors as fields."""

    x: torch.Tensor
    y: torch.Tensor


def collate(samples) -> Batch:
    xs, ys = zip(*samples)
    return Batch(torch.stack(xs), torch.stack(ys))


class TypedBatches(Trainer):
    def training_step(self, batch):
        return F.cross_entropy(self.model(batch.x), batch.y)


def test_validation_counts_the_samples_of_a_frozen_dataclass_batch():
    """docs/trainer.md, Validation: a batch's samples are the leading size of its first tensor "in any nesting of
    tuples, lists, dicts and dataclasses". Batches of a frozen dataclass (10 samples in 4, 4, 2) train, and their
    ``val_loss`` is the mean over the samples, as the hand evaluation computes it."""
    data = classes(10, 1)
    val = DataLoader(data, batch_size=4, collate_fn=collate)
    trainer = TypedBatches(model=Net(), train_data=DataLoader(classes(8, 0), batch_size=4, collate_fn=collate),
                           val_data=val, max_steps=2, val_every=2, optimizer=sgd, **QUIET)
    trainer.fit()
    model = copy.deepcopy(trainer.model).eval()
    with torch.no_grad():
        total = sum(F.cross_entropy(model(b.x), b.y).item() * len(b.y) for b in val)
    assert trainer.state.val_history[-1] == (2, {"val_loss": total / 10})


# -- trainer.validate() after fit(), with the default metrics file


def test_validate_after_fit_with_the_default_metrics_file_returns_and_logs_its_metrics(tmp_path):
    """Lightning's evaluation docs (docs/source-pytorch/common/evaluation_intermediate.rst): ``trainer.fit(model)``,
    then ``trainer.validate(model, dataloaders=...)``. Here with a run directory and the default loggers (csv):
    ``validate()`` returns the metrics of the trained weights (those of the fit's last validation) and, as
    docs/trainer.md says, logs them: ``metrics.csv`` holds them at the fit's last step."""
    trainer = Classifier(model=Net(), train_data=DataLoader(classes(12, 0), batch_size=4),
                         val_data=DataLoader(classes(10, 1), batch_size=4), max_steps=3, optimizer=sgd,
                         device="cpu", progress=False, run_dir=tmp_path)
    trainer.fit()
    last = trainer.state.val_history[-1]
    assert trainer.validate() == last[1] and trainer.state.val_history[-1] == last
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = [row for row in csv.reader(f) if row[1] == "val_loss"]
    assert rows[-1] == ["3", "val_loss", f"{last[1]['val_loss']:.6g}"]


# -- Lightning's several test loaders passed to test()


def test_several_test_loaders_are_refused_as_several_validation_loaders_are():
    """Lightning's ``trainer.test(model, dataloaders=[test_a, test_b])`` (docs/source-pytorch/common/
    evaluation_intermediate.rst), ported as docs/trainer.md's table says, ``trainer.test([test_a, test_b])``: the
    same ``ConfigError`` as ``val_data=[a, b]``, naming the list of DataLoaders and what to pass instead: for test and
    predict, one call per loader (Lightning's list or dict gives one result per loader), not one loader over them
    all."""
    test_a = DataLoader(classes(8, 1), batch_size=4)
    test_b = DataLoader(classes(6, 2), batch_size=3)
    with pytest.raises(ConfigError, match="val_data is a list of 2 DataLoaders"):
        Classifier(model=Net(), train_data=DataLoader(classes(8, 0), batch_size=4), val_data=[test_a, test_b],
                   max_steps=1, optimizer=sgd, **QUIET)
    trainer = Classifier(model=Net(), train_data=DataLoader(classes(8, 0), batch_size=4), max_steps=1, optimizer=sgd,
                         **QUIET)
    with pytest.raises(ConfigError, match=re.escape("test data is a list of 2 DataLoaders") + ".*" + re.escape(
            "for the metrics of each, as Lightning's loaders give them: trainer.test(loader) for each loader")):
        trainer.test([test_a, test_b])
    with pytest.raises(ConfigError, match=re.escape("predict data is a list of 2 DataLoaders") + ".*" + re.escape(
            "for the predictions of each, as Lightning's loaders give them: trainer.predict(loader) for each loader")):
        trainer.predict([test_a, test_b])
    # Lightning's dict of loaders by name: iterated, a dict gives its names, which test_step would get as batches
    with pytest.raises(ConfigError, match=re.escape("test data is a dict of 2 DataLoaders")):
        trainer.test({"a": test_a, "b": test_b})
    with pytest.raises(ConfigError, match=re.escape("predict data is a dict of 2 DataLoaders")):
        trainer.predict({"a": test_a, "b": test_b})
    assert trainer.test(test_b) == trainer.test([batch for batch in test_b])  # what the advice gives: the loader's own


# -- self.log of a per-sample tensor in validation_step


class PerSampleAccuracy(Classifier):
    """Lightning's ``self.log("val_acc", acc)`` in ``validation_step`` (docs/source-pytorch/extensions/logging.rst),
    with the accuracy left per sample (``.mean()`` forgotten)."""

    def validation_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.log("val_acc", (out.argmax(1) == y).float())
        return F.cross_entropy(out, y)


def test_self_log_of_a_per_sample_tensor_in_validation_step_is_refused_by_name():
    """docs/trainer.md: ``self.log(name, value)`` in ``validation_step`` logs a number per batch, averaged over the
    samples; a value that is no number is refused with a ``ConfigError`` saying what to log instead (as Lightning's
    "the tensor must have a single element"). A per-sample tensor is named in that error."""
    trainer = PerSampleAccuracy(model=Net(), train_data=DataLoader(classes(8, 0), batch_size=4),
                                val_data=DataLoader(classes(8, 1), batch_size=4), max_steps=1, optimizer=sgd,
                                **QUIET)
    with pytest.raises(ConfigError, match="val_acc"):
        trainer.fit()


# -- batches of variable-length sequences as nested tensors


class Pooled(nn.Module):
    """pytorch/tutorials prototype_source/nestedtensor.py: ``nn.Linear`` applied to a nested tensor of sequences of
    different lengths, then padded (``torch.nested.to_padded_tensor``) and summed over time for a classifier."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.head = nn.Linear(3, 8), nn.Linear(8, 4)

    def forward(self, nt):
        return self.head(torch.nested.to_padded_tensor(torch.relu(self.proj(nt)), 0.0).sum(1))


def sequences(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.nested.nested_tensor([torch.randn(n, 3, generator=gen) for n in lengths])
    return x, torch.randint(0, 4, (len(lengths),), generator=gen)


def test_validation_counts_the_sequences_of_a_nested_tensor_batch():
    """docs/trainer.md, Validation: each batch counts as many samples as the leading size of its first tensor. A
    batch ``(nested tensor of 3 sequences, labels)``, as the nested-tensor tutorial builds one, trains; validated
    (3, 3 and 2 sequences), ``val_loss`` is the mean over the 8 sequences, as the hand evaluation computes it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage.*")
        val = [sequences([2, 5, 3], 1), sequences([4, 1, 2], 2), sequences([3, 3], 3)]
        trainer = Classifier(model=Pooled(), train_data=[sequences([2, 4, 1], 0)], val_data=val, max_steps=1,
                             val_every=1, optimizer=sgd, **QUIET)
        trainer.fit()
    with torch.no_grad():
        total = sum(F.cross_entropy(trainer.model(x), y).item() * len(y) for x, y in val)
    assert trainer.state.val_history[-1] == (1, {"val_loss": total / 8})


def test_predict_refuses_a_dataset_of_single_samples_as_fit_does():
    """docs/trainer.md's example, ``torch.cat(trainer.predict(DataLoader(TensorDataset(x_new), batch_size=256)))``,
    with the DataLoader forgotten: the same ``ConfigError`` as ``train_data=TensorDataset(...)`` gives (or
    batches of samples), rather than ten outputs of shape (4,) that concatenate to a (40,) tensor."""
    x_new = classes(10, 2).tensors[0]
    with pytest.raises(ConfigError, match="Dataset of single samples"):
        Classifier(model=Net(), train_data=TensorDataset(x_new, x_new), max_steps=1, optimizer=sgd, **QUIET)
    trainer = Classifier(model=nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4)), train_data=[],
                         max_steps=1, optimizer=sgd, **QUIET)
    try:
        predictions = torch.cat(trainer.predict(TensorDataset(x_new)))
    except ConfigError as err:
        assert "Dataset of single samples" in str(err)
    else:
        assert predictions.shape == (10, 4)
