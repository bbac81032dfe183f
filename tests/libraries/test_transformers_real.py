"""Hugging Face transformers' own training loop (``Trainer.train``: ``_inner_training_loop``, ``_run_epoch``,
``training_step``, ``compute_loss``, accelerate's ``backward`` and ``clip_grad_norm_``, AdamW and the linear schedule),
and peft's LoRA, written against transformers 5.23.0, peft 0.21.2 and torch 2.13 on CPU, with tiny models made from
configs and integer token data (no download): run three ways from the same seeds, bare; under
``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script); and with a
``safeloop.GraphGuard`` put where an HF user can put one (a ``TrainerCallback`` that makes it at ``on_train_begin``,
told the model and the optimizer, or that opens a guard step at ``on_step_begin`` and closes it at ``on_step_end``,
with ``guard.check(loss)`` in a ``compute_loss`` override). Every parameter and buffer, the optimizer's state, the
scheduler's and the losses, gradient norms and learning rates of ``trainer.state.log_history`` must come out bit for
bit the same in every guard mode, with no warning the bare run does not emit itself.

Then the mistakes an HF user makes in a ``compute_loss`` override (a regularizer with a graph built once in
``__init__``, a hidden state kept on ``self`` with its graph, a loss back-propagated inside ``compute_loss`` before the
Trainer back-propagates it again): each stopped before the update it would corrupt, naming the tensor, and the fix the
message advises, written into the same override, trains quiet and right (under ``check="always"``: these runs are
shorter than ``auto``'s 10 warm-up steps, which ``auto`` checks as ``always`` does).
"""
import contextlib
import re
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          Trainer, TrainerCallback, TrainingArguments)

from safeloop import GraphGuard  # noqa: E402
from safeloop.errors import CarriedGraphError, DoubleBackwardError, GraphReuseError  # noqa: E402
from safeloop.watch import Watch  # noqa: E402
from tests.libraries.compare import same  # noqa: E402
from tests.realworld.harness import checks, strict  # noqa: E402

HERE = __file__


@pytest.fixture(autouse=True)
def _quiet(tmp_path, monkeypatch):
    """One torch thread (the machine's cores are shared), a working directory of the test's own (where the guard
    writes its graph pictures), and transformers' logger at errors only (its info lines are not what is compared)."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)
    torch.set_num_threads(threads)


# -- tiny models and token data ----------------------------------------------------------------------------------
VOCAB, LENGTH = 50, 8


def bert():
    return BertForSequenceClassification(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=32, vocab_size=VOCAB,
                                                    max_position_embeddings=LENGTH))


def gpt2():
    return GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=LENGTH))


class Tokens(torch.utils.data.Dataset):
    """``n`` examples of ``LENGTH`` integer tokens as a tokenizer would give them (``input_ids``,
    ``attention_mask``): ``labels`` a class of two (``lm=False``), or the tokens themselves with the last two
    sometimes masked with -100 (padding), so micro-batches count different numbers of items."""

    def __init__(self, n=24, lm=False, seed=3):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(VOCAB, (n, LENGTH), generator=gen)
        self.mask = torch.ones_like(self.ids)
        self.mask[:, -2:][torch.rand(n, 2, generator=gen) < 0.3] = 0
        self.labels = self.ids.masked_fill(self.mask == 0, -100) if lm else torch.randint(2, (n,), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def arguments(out, **kwargs):
    """``TrainingArguments`` of a short CPU run, everything seeded, nothing saved or reported; the defaults
    otherwise (AdamW, a linear schedule, ``max_grad_norm=1.0``)."""
    kwargs = {"max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1, **kwargs}
    return TrainingArguments(output_dir=str(out), report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, seed=11, data_seed=12, **kwargs)


# -- where a user puts a GraphGuard ------------------------------------------------------------------------------
class Checked(Trainer):
    """A ``Trainer`` whose ``compute_loss`` hands its loss (``self.loss``'s: ``Trainer.compute_loss``'s here, a
    user's in the subclasses below) to ``guard.check`` as its last line, before ``training_step`` divides it for
    accumulation and calls ``accelerator.backward`` (transformers trainer.py, ``training_step``)."""

    guard = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = self.loss(model, inputs, return_outputs, num_items_in_batch)
        if self.guard is not None:
            self.guard.check(out[0] if return_outputs else out)
        return out

    def loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class GuardOptimizer(TrainerCallback):
    """Makes the guard when training begins, told the model and the Trainer's optimizer (accelerate's
    ``AcceleratedOptimizer``, followed to the AdamW it wraps): a step ends at each optimizer step."""

    def __init__(self, trainer, check):
        self.trainer, self.check = trainer, check

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.trainer.guard = GraphGuard(model, optimizer, check=self.check)


class GuardSteps(TrainerCallback):
    """A ``with guard.step():`` from ``on_step_begin`` (the first micro-batch of an update) to ``on_step_end``
    (after ``optimizer.step()``, ``lr_scheduler.step()`` and ``model.zero_grad()``)."""

    def __init__(self, trainer, check):
        self.trainer, self.check, self.steps = trainer, check, contextlib.ExitStack()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.trainer.guard = GraphGuard(model, check=self.check)

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.enter_context(self.trainer.guard.step())

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.close()


PLACES = {"optimizer": GuardOptimizer, "steps": GuardSteps}


# -- what every case runs ----------------------------------------------------------------------------------------


TIMES = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def results(trainer):
    """What a run leaves: every parameter and buffer, the optimizer's and the scheduler's state, and the log history
    (losses, gradient norms, learning rates; not its timings)."""
    return {"model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.lr_scheduler.state_dict(),
            "log": [{k: v for k, v in entry.items() if k not in TIMES} for entry in trainer.state.log_history]}


def train(make_model, out, trainer_class=None, place=None, check=None, lm=False, n=24, made=None, **kwargs):
    """``make_model()`` from seed 0 trained by ``trainer_class`` on ``Tokens``; ``place``: a guard put in by the
    ``PLACES`` callback of that name; ``made``: a list the trainer is appended to before training. Returns (results,
    the trainer)."""
    torch.manual_seed(0)
    model = make_model()
    trainer_class = trainer_class or (Trainer if place is None else Checked)
    trainer = trainer_class(model=model, args=arguments(out, **kwargs), train_dataset=Tokens(n, lm=lm))
    if made is not None:
        made.append(trainer)
    if place is not None:
        trainer.add_callback(PLACES[place](trainer, check))
    trainer.train()
    if place is not None:
        trainer.guard.close()
    return results(trainer), trainer


def three_runs(tmp_path, check, make_model=bert, places=("optimizer", "steps"), **kwargs):
    """``train`` bare, under ``Watch`` (this file as the script) and with a guard at each of ``places``, each from the
    same seeds; every result compared with the bare run's, bit for bit, and the guarded runs may warn nothing the
    bare run does not. Returns the bare run's result."""
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref, _ = train(make_model, tmp_path / "bare", **kwargs)
    with strict(own), Watch(GraphGuard(check=check), HERE):
        watched, _ = train(make_model, tmp_path / "watched", **kwargs)
    same(watched, ref)
    for place in places:
        with strict(own):
            guarded, trainer = train(make_model, tmp_path / place, place=place, check=check, **kwargs)
        same(guarded, ref, place)
        assert trainer.guard.steps == trainer.state.global_step, place  # one guard step per update
    torch.manual_seed(0)
    start = make_model().state_dict()
    assert any(not torch.equal(start[k], ref["model"][k]) for k in start), "nothing trained"
    return ref


# -- Trainer's defaults ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("check", checks())
def test_bert_sequence_classification_with_the_defaults(tmp_path, check):
    """``Trainer(model, args, train_dataset).train()`` with the defaults (trainer.py ``_run_epoch``: per update,
    ``training_step`` -> ``compute_loss`` -> ``accelerator.backward``, ``_clip_grad_norm`` at ``max_grad_norm=1.0``,
    ``optimizer.step()``, ``lr_scheduler.step()``, ``model.zero_grad()``): BERT's dropout draws from the global
    generator, so a guard that drew from it would show."""
    ref = three_runs(tmp_path, check)
    assert [e["step"] for e in ref["log"][:-1]] == [1, 2, 3, 4] and all("grad_norm" in e for e in ref["log"][:-1])


@pytest.mark.parametrize("check", checks())
def test_gpt2_causal_lm_with_gradient_accumulation(tmp_path, check):
    """GPT-2 as a causal LM with labels, ``gradient_accumulation_steps=2``: ``get_batch_samples`` prefetches both
    micro-batches and counts ``num_items_in_batch`` (the tokens not -100), which the model's loss divides its sum
    by; ``on_step_begin`` fires at the first micro-batch, ``on_step_end`` after the update."""
    ref = three_runs(tmp_path, check, make_model=gpt2, lm=True, gradient_accumulation_steps=2)
    assert len(ref["log"]) == 5


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("check", checks())
def test_gradient_checkpointing(tmp_path, check, reentrant):
    """``activation_checkpointing=True`` (trainer.py ``_prepare_for_training`` ->
    ``model.activation_checkpointing_enable``): each BERT layer's forward runs again in backward, by
    ``torch.utils.checkpoint`` non-reentrant (transformers' default: saved-tensor hooks) or reentrant (an autograd
    ``Function`` whose backward runs a backward of its own; transformers makes the embeddings' output require grad
    for it). Dropout inside the checkpointed layers replays the generator's state it saved."""
    three_runs(tmp_path, check, activation_checkpointing=True,
               activation_checkpointing_kwargs={"use_reentrant": reentrant})


@pytest.mark.parametrize("check", checks())
def test_label_smoothing(tmp_path, check):
    """``label_smoothing_factor=0.1``: ``compute_loss`` pops the labels and computes the loss by its
    ``LabelSmoother`` from the logits (trainer_pt_utils.py), not the model's own loss."""
    three_runs(tmp_path, check, label_smoothing_factor=0.1)


def lora_bert():
    """peft's ``get_peft_model`` on BERT, ``task_type="SEQ_CLS"``: LoRA (r=2) on the attention's query and value,
    the rest frozen, the classifier trained whole in a ``ModulesToSaveWrapper`` copy."""
    from peft import LoraConfig, get_peft_model
    return get_peft_model(bert(), LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"],
                                             lora_dropout=0.1, task_type="SEQ_CLS"))


def lora_gpt2():
    """peft's ``get_peft_model`` on GPT-2, ``task_type="CAUSAL_LM"``: LoRA (r=2) on the fused ``c_attn``
    (a ``Conv1D``, ``fan_in_fan_out=True``), all else frozen."""
    from peft import LoraConfig, get_peft_model
    return get_peft_model(gpt2(), LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                             lora_dropout=0.1, task_type="CAUSAL_LM"))


@pytest.mark.parametrize("check", checks())
def test_peft_lora_sequence_classification(tmp_path, check):
    """A ``PeftModelForSequenceClassification`` in the Trainer: the optimizer holds only the LoRA matrices and the
    classifier's copy (``create_optimizer`` takes the parameters that require grad); frozen weights still in every
    layer's graph."""
    pytest.importorskip("peft")
    ref = three_runs(tmp_path, check, make_model=lora_bert)
    assert any("lora_B" in k for k in ref["model"])


@pytest.mark.parametrize("check", checks())
def test_peft_lora_causal_lm_with_accumulation_and_checkpointing(tmp_path, check):
    """A ``PeftModelForCausalLM`` with ``gradient_accumulation_steps=2`` and reentrant checkpointing: with the
    embeddings frozen, transformers' ``enable_input_require_grads`` hook makes their output require grad, so the
    reentrant checkpoint's backward reaches the LoRA matrices (trainer.py ``_prepare_for_training``)."""
    pytest.importorskip("peft")
    three_runs(tmp_path, check, make_model=lora_gpt2, lm=True, gradient_accumulation_steps=2,
               activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True})


# -- mistakes in a compute_loss override -------------------------------------------------------------------------
MISTAKE_PLACES = ("watch", "optimizer", "steps")
BEFORE = {}


def before_update(tmp_path, fixed, step):
    """BERT's state dict after ``step - 1`` updates of the bare ``fixed`` class (made once per class and step)."""
    if (fixed, step) not in BEFORE:
        torch.manual_seed(0)
        BEFORE[fixed, step] = bert().state_dict() if step == 1 else \
            train(bert, tmp_path / "before", trainer_class=fixed, max_steps=step - 1)[0]["model"]
    return BEFORE[fixed, step]


def stopped(tmp_path, trainer_class, place, error, match, fixed=None, step=1):
    """``trainer_class`` trained under ``Watch`` (``place`` "watch") or with a guard at ``place``, ``check="always"``:
    ``error`` matching ``match`` at update ``step``, raised before that update's backward: the parameters are the
    ones the bare run of the ``fixed`` class (the same values, without the mistake) leaves after ``step - 1``
    updates (a linear schedule's first learning rate does not depend on ``max_steps``), and no ``.grad`` is set."""
    made = []
    with pytest.raises(error, match=match) as raised:
        if place == "watch":
            with Watch(GraphGuard(check="always"), HERE):
                train(bert, tmp_path / place, trainer_class=trainer_class, made=made)
        else:
            train(bert, tmp_path / place, trainer_class=trainer_class, place=place, check="always", made=made)
    (trainer,) = made
    same({k: v for k, v in trainer.model.state_dict().items()}, before_update(tmp_path, fixed, step), place)
    if fixed is not None:
        assert all(p.grad is None for p in trainer.model.parameters())
    return raised.value


class Anchored(Checked):
    """A regularizer made once in ``__init__`` from the classifier's weight, with its graph: every step's loss reaches
    the same ``LinalgVectorNormBackward0``, whose saved tensors the first backward frees."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.anchor = self.model.classifier.weight.norm()

    def loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().loss(model, inputs, return_outputs, num_items_in_batch) + 1e-3 * self.anchor


class Reanchored(Checked):
    """``Anchored`` with the fix: the regularizer recomputed inside ``compute_loss``."""

    def loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().loss(model, inputs, return_outputs, num_items_in_batch) + 1e-3 * model.classifier.weight.norm()


class Centered(Checked):
    """A running centre of the [CLS] states kept on ``self`` (``mistake``: with its graph), pulled towards by a
    penalty: each step's centre is made from the last one, so its graph reaches every earlier step's."""

    center = None
    mistake = True

    def loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, output_hidden_states=True)
        cls = outputs.hidden_states[-1][:, 0].mean(0)
        self.center = cls if self.center is None else 0.9 * self.center + 0.1 * cls
        if not self.mistake:
            self.center = self.center.detach()
        return outputs.loss + 0.1 * (cls - self.center).pow(2).sum()


class Uncentered(Centered):
    mistake = False


class Consistent(Checked):
    """A consistency penalty between this step's mean [CLS] state and the last step's, kept on ``self.prev_hidden``
    (``mistake``: with its graph) and replaced by this step's before ``compute_loss`` returns: the loss reaches the
    last step's graph, which its backward freed."""

    prev_hidden = None
    mistake = True

    def loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, output_hidden_states=True)
        hidden = outputs.hidden_states[-1][:, 0].mean(0)
        loss = outputs.loss
        if self.prev_hidden is not None:
            loss = loss + 0.1 * (hidden - self.prev_hidden).pow(2).sum()
        self.prev_hidden = hidden if self.mistake else hidden.detach()
        return loss


class Inconsistent(Consistent):
    mistake = False


class Twice(Checked):
    """``loss.backward()`` inside ``compute_loss`` (as in a hand-written loop), then the loss returned, which
    ``training_step`` back-propagates again through ``accelerator.backward``."""

    def loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().loss(model, inputs, return_outputs, num_items_in_batch)
        loss.backward()
        return loss


@pytest.mark.parametrize("place", MISTAKE_PLACES)
def test_regularizer_built_in_init_is_stopped_at_step_one(tmp_path, place):
    """A ``Trainer`` subclass whose ``__init__`` computes a regularizer from the classifier's weight once, with its
    graph, and whose ``compute_loss`` adds it every step: a ``GraphReuseError`` at the first step, before
    ``accelerator.backward``, naming the attribute (``trainer.anchor`` from the script's variables under watch,
    ``self.anchor`` from ``compute_loss``'s) and advising to recompute it inside the loop."""
    err = stopped(tmp_path, Anchored, place, GraphReuseError,
                  r"(?s)step 1, loss 'loss'.*LinalgVectorNormBackward0, built before the step.*held by `[\w.]*anchor`"
                  r".*recompute `[\w.]*anchor` inside the loop", fixed=Reanchored)
    assert err.step == 1


def test_regularizer_recomputed_in_compute_loss_trains_the_same(tmp_path):
    """The advised fix of ``Anchored``: the regularizer computed inside ``compute_loss``; quiet and bit for bit."""
    three_runs(tmp_path, "always", trainer_class=Reanchored)


@pytest.mark.parametrize("place", MISTAKE_PLACES)
def test_running_center_kept_with_its_graph_is_stopped_at_step_two(tmp_path, place):
    """A running centre of hidden states kept on ``self`` without ``.detach()``: the second step's loss reaches the
    first step's graph, which its backward freed; a ``CarriedGraphError`` at step 2 before HF's backward (which
    would fail half-way, "Trying to backward through the graph a second time"), naming ``center`` and advising
    ``center = center.detach()``."""
    stopped(tmp_path, Centered, place, CarriedGraphError,
            r"(?s)step 2, loss 'loss'.*created during an earlier step and held by `[\w.]*center`"
            r".*`([\w.]*center) = \1\.detach\(\)`", fixed=Uncentered, step=2)


def test_running_center_detached_trains_the_same(tmp_path):
    """The advised fix of ``Centered``: the centre stored ``.detach()``ed; quiet and bit for bit."""
    three_runs(tmp_path, "always", trainer_class=Uncentered)


@pytest.mark.parametrize("place", MISTAKE_PLACES)
def test_previous_hidden_kept_with_its_graph_is_stopped_at_step_two(tmp_path, place):
    """The last step's hidden state kept on ``self.prev_hidden`` with its graph, replaced by this step's before
    ``compute_loss`` returns: the loss reaches a graph the last backward freed. A ``CarriedGraphError`` at step 2,
    before HF's backward. (With a ``GraphGuard``, ``guard.check`` used to let it through to that backward's own
    RuntimeError: no variable holds the old state any more, and the guard took the node for one another thread
    made in this step.)"""
    stopped(tmp_path, Consistent, place, CarriedGraphError,
            r"(?s)step 2, loss 'loss'.*MeanBackward1, created during an earlier step.*already freed",
            fixed=Inconsistent, step=2)


@pytest.mark.parametrize("place", MISTAKE_PLACES)
def test_previous_hidden_kept_with_its_graph_is_named(tmp_path, place):
    """The error of ``test_previous_hidden_kept_with_its_graph_is_stopped_at_step_two`` names the state, though
    only the loss reaches the old value by the check (``self.prev_hidden`` holds this step's, made alike from the
    same parameters), and advises its fix, stored ``.detach()``ed where it is set (``Inconsistent``: trains right)."""
    err = stopped(tmp_path, Consistent, place, CarriedGraphError, r"step 2", fixed=Inconsistent, step=2)
    assert re.search(r"kept in `(([\w.]*)prev_hidden)`, which this step then set to its own value \(the loss read "
                     r"the old one\);.*To fix: store it detached where it is set \(`\1 = \.\.\.\.detach\(\)`\)",
                     str(err)), str(err)


def test_previous_hidden_detached_trains_the_same(tmp_path):
    """``Consistent`` fixed: the last hidden state stored ``.detach()``ed; quiet and bit for bit."""
    three_runs(tmp_path, "always", trainer_class=Inconsistent)


@pytest.mark.parametrize("place", MISTAKE_PLACES)
def test_backward_inside_compute_loss_is_stopped(tmp_path, place):
    """``loss.backward()`` inside ``compute_loss``, then ``training_step`` back-propagating the same graph: a
    ``DoubleBackwardError`` at step 1 before HF's backward and before any update (under watch, naming the line of
    the first backward to delete). Its fix, deleting that backward, is ``Trainer.compute_loss`` itself, which
    ``test_bert_sequence_classification_with_the_defaults`` runs."""
    err = stopped(tmp_path, Twice, place, DoubleBackwardError,
                  r"(?s)step 1, loss 'loss'.*already (back-propagated|consumed).*(delete this backward|once)")
    if place == "watch":
        line = Twice.loss.__code__.co_firstlineno + 2
        assert f"test_transformers_real.py:{line}" in str(err)
