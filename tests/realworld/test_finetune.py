"""Fine-tuning a sequence classifier as Hugging Face's example does: huggingface/transformers,
examples/pytorch/text-classification/run_glue_no_trainer.py (commit a22a4378d97d06b7a1d9abad6e0086d30fdea199),
its linear schedule from src/transformers/optimization.py (``get_linear_schedule_with_warmup``), which
``get_scheduler("linear", ...)`` returns. A tiny BERT-like encoder stands in for the pretrained model."""
import argparse
import math
from dataclasses import dataclass
from functools import partial

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from safeloop import Trainer

from .harness import checks, compare, fixed

VOCAB, SEQ, D, LABELS, BATCHES = 13, 6, 8, 3, 5

# The script's arguments. 5 batches a pass and accumulation 2: ceil(5 / 2) = 3 updates a pass, so
# max_train_steps=5 gives num_train_epochs = 2 and the second pass stops at its `break`, mid-pass.
ARGS = argparse.Namespace(learning_rate=1e-2, weight_decay=0.1, gradient_accumulation_steps=2, max_train_steps=5,
                          num_warmup_steps=1)
# The batches the source runs before its `break`: a whole pass (updates after batches 0, 2, 4), then
# batches 0-2 of the next (updates after 0 and 2): the port's max_steps, a step being one micro-batch.
MICRO_BATCHES = BATCHES + 3


# -- the model: embeddings with a `LayerNorm` attribute (so "LayerNorm.weight" matches as in BERT), one
#    encoder layer, BERT's pooler and a classification head with CrossEntropyLoss ---------------------------
@dataclass
class SequenceClassifierOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, D, padding_idx=0)
        self.position_embeddings = nn.Embedding(SEQ, D)
        self.LayerNorm = nn.LayerNorm(D)  # BERT's name: the source's no_decay list matches it
        self.dropout = nn.Dropout(0.1)

    def forward(self, input_ids):
        x = self.word_embeddings(input_ids) + self.position_embeddings(torch.arange(input_ids.size(1)))
        return self.dropout(self.LayerNorm(x))


class TinyBertForSequenceClassification(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = Embeddings()
        layer = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=16, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.pooler = nn.Linear(D, D)
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(D, LABELS)

    def forward(self, input_ids, attention_mask, labels):
        hidden = self.encoder(self.embeddings(input_ids), src_key_padding_mask=attention_mask == 0)
        pooled = torch.tanh(self.pooler(hidden[:, 0]))  # the first ([CLS]) token, as BERT's pooler
        logits = self.classifier(self.dropout(pooled))
        loss = nn.CrossEntropyLoss()(logits.view(-1, LABELS), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)


def glue_batches(n=BATCHES):
    """Padded token batches as DataCollatorWithPadding makes them: ids, attention mask (0 on padding), labels."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        lengths = torch.randint(2, SEQ + 1, (4,), generator=gen)
        attention_mask = (torch.arange(SEQ) < lengths[:, None]).long()
        input_ids = torch.randint(1, VOCAB, (4, SEQ), generator=gen) * attention_mask  # pad id 0
        out.append({"input_ids": input_ids, "attention_mask": attention_mask,
                    "labels": torch.randint(LABELS, (4,), generator=gen)})
    return out


# -- the source's optimizer and schedule --------------------------------------------------------------------
def grouped_adamw(model, args):
    # Split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)


def _get_linear_schedule_with_warmup_lr_lambda(current_step, *, num_warmup_steps, num_training_steps):
    # transformers is not a dependency: its get_scheduler("linear", ...), as optimization.py defines it
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    lr_lambda = partial(_get_linear_schedule_with_warmup_lr_lambda, num_warmup_steps=num_warmup_steps,
                        num_training_steps=num_training_steps)
    return LambdaLR(optimizer, lr_lambda)


# -- the hand-written loop: main()'s training loop, one process. Left out: Accelerator (prepare() changes
#    nothing in one process without mixed precision; accelerator.backward(loss) is loss.backward(), as it
#    divides by the Accelerator's own gradient_accumulation_steps, 1 here), tracking, checkpointing and
#    resuming, the tqdm bar, each pass's evaluation (no_grad, eval mode: no parameter or RNG touched) and
#    push_to_hub. The DataLoader's shuffle is left out: the batches are a fixed list. -------------------------
def glue_hand(model, train_dataloader, args=ARGS):
    optimizer = grouped_adamw(model, args)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, args.num_warmup_steps, args.max_train_steps)
    completed_steps = 0
    for epoch in range(num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / args.gradient_accumulation_steps
            loss.backward()  # accelerator.backward(loss)
            # step counts from 0: a pass's first update takes its first batch alone, the rest pairs
            # (huggingface/transformers#15801), and the pass's last batch always ends an update
            if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1

            if completed_steps >= args.max_train_steps:
                break


# -- the port. safeloop's grad_accum=2 groups a pass's batches (2, 2, 1), not the source's (1, 2, 2), so the
#    port keeps the source's condition in manual mode: a safeloop step is one micro-batch, and self.step()
#    is optimizer.step(), lr_scheduler.step(), optimizer.zero_grad() --------------------------------------------
class GlueFinetune(Trainer):
    automatic = False

    def configure_optimizers(self):
        return grouped_adamw(self.model, ARGS)

    def configure_schedulers(self, optimizers):
        return {name: get_linear_schedule_with_warmup(opt, ARGS.num_warmup_steps, ARGS.max_train_steps)
                for name, opt in optimizers.items()}

    def training_step(self, batch):
        step = self.state.batch_in_epoch - 1  # the source's enumerate() index within the pass
        loss = self.model(**batch).loss / ARGS.gradient_accumulation_steps
        self.backward(loss)
        if step % ARGS.gradient_accumulation_steps == 0 or step == len(self.train_data) - 1:
            self.step()
        return loss


@pytest.mark.parametrize("check", checks())
def test_glue_finetune_with_gradient_accumulation(check):
    compare(TinyBertForSequenceClassification, glue_hand, GlueFinetune, fixed(glue_batches()), check,
            steps=MICRO_BATCHES)
