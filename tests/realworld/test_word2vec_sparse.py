"""Skip-gram word2vec with sparse gradients: Andras7/word2vec-pytorch, word2vec/model.py at commit
36b93a503e8b3b5448abbc0e18f2a6bd3e017fc9 (``SkipGramModel``) and word2vec/trainer.py at commit
815f7bbe7a49ba03035890d2c3f4379a8562a37b (``Word2VecTrainer.train``).

Both embeddings are ``nn.Embedding(sparse=True)``: backward leaves sparse COO gradients on them, which only
``optim.SparseAdam`` takes. The context embedding starts at zero and is looked up twice per step (positive and
negative words). Every iteration (pass over the data) builds a new SparseAdam and a ``CosineAnnealingLR`` over
the pass, and the scheduler is stepped before each update (PyTorch warns about that order at its first step).

Changes for a seconds-long test: a vocabulary of 10 words, embeddings of 4 (100), batches of 6 pairs with 3
negatives each (from ``Word2vecDataset.collate``; the corpus reader replaced by seeded random ids), 2 iterations
(3) of 3 batches; no tqdm, printing or saving.

The port clears SparseAdam's state and puts back its learning rate at each pass's start (``on_epoch_start``), where
the source makes a new one, and steps its own scheduler in ``on_step_start``.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn import init

from safeloop import Trainer

from .harness import checks, compare

EMB_SIZE, EMB_DIMENSION, BATCH, NEGS, ITERATIONS, BATCHES, INITIAL_LR = 10, 4, 6, 3, 2, 3, 0.01


# -- word2vec/model.py --------------------------------------------------------------------------------------
class SkipGramModel(nn.Module):

    def __init__(self, emb_size, emb_dimension):
        super(SkipGramModel, self).__init__()
        self.emb_size = emb_size
        self.emb_dimension = emb_dimension
        self.u_embeddings = nn.Embedding(emb_size, emb_dimension, sparse=True)
        self.v_embeddings = nn.Embedding(emb_size, emb_dimension, sparse=True)

        initrange = 1.0 / self.emb_dimension
        init.uniform_(self.u_embeddings.weight.data, -initrange, initrange)
        init.constant_(self.v_embeddings.weight.data, 0)

    def forward(self, pos_u, pos_v, neg_v):
        emb_u = self.u_embeddings(pos_u)
        emb_v = self.v_embeddings(pos_v)
        emb_neg_v = self.v_embeddings(neg_v)

        score = torch.sum(torch.mul(emb_u, emb_v), dim=1)
        score = torch.clamp(score, max=10, min=-10)
        score = -F.logsigmoid(score)

        neg_score = torch.bmm(emb_neg_v, emb_u.unsqueeze(2)).squeeze()
        neg_score = torch.clamp(neg_score, max=10, min=-10)
        neg_score = -torch.sum(F.logsigmoid(-neg_score), dim=1)

        return torch.mean(score + neg_score)


# -- word2vec/trainer.py ------------------------------------------------------------------------------------
def word_pairs(model):
    gen = torch.Generator().manual_seed(6)
    return [(torch.randint(EMB_SIZE, (BATCH,), generator=gen), torch.randint(EMB_SIZE, (BATCH,), generator=gen),
             torch.randint(EMB_SIZE, (BATCH, NEGS), generator=gen)) for _ in range(BATCHES)]


def word2vec_hand(skip_gram_model, dataloader):
    device = torch.device("cpu")
    for iteration in range(ITERATIONS):

        optimizer = optim.SparseAdam(skip_gram_model.parameters(), lr=INITIAL_LR)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, len(dataloader))

        running_loss = 0.0
        for i, sample_batched in enumerate(dataloader):

            if len(sample_batched[0]) > 1:
                pos_u = sample_batched[0].to(device)
                pos_v = sample_batched[1].to(device)
                neg_v = sample_batched[2].to(device)

                scheduler.step()
                optimizer.zero_grad()
                loss = skip_gram_model.forward(pos_u, pos_v, neg_v)
                loss.backward()
                optimizer.step()

                running_loss = running_loss * 0.9 + loss.item() * 0.1


class Word2VecTrainer(Trainer):
    def configure_optimizers(self):
        return optim.SparseAdam(self.model.parameters(), lr=INITIAL_LR)

    def on_epoch_start(self):
        optimizer = self.optimizers["optimizer"]
        optimizer.state.clear()  # a new SparseAdam, as each iteration of the source
        optimizer.param_groups[0]["lr"] = INITIAL_LR
        optimizer.param_groups[0].pop("initial_lr", None)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, BATCHES)  # len(dataloader)

    def on_step_start(self):
        self.scheduler.step()

    def training_step(self, batch):
        pos_u, pos_v, neg_v = batch
        return self.model(pos_u, pos_v, neg_v)


@pytest.mark.parametrize("check", checks())
def test_skip_gram_with_sparse_embeddings_and_sparse_adam(check):
    compare(lambda: SkipGramModel(EMB_SIZE, EMB_DIMENSION), word2vec_hand, Word2VecTrainer, word_pairs, check,
            steps=ITERATIONS * BATCHES)
