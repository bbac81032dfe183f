# Skip-gram word2vec with negative sampling as Andras7/word2vec-pytorch (36b93a5) writes it: word2vec/model.py
# (`SkipGramModel`: two `nn.Embedding(sparse=True)`, the context table looked up twice, for the positive and the
# negative words) and word2vec/trainer.py (`Word2VecTrainer.train`: a new `optim.SparseAdam` and `CosineAnnealingLR`
# each pass, the scheduler stepped before the update, the running loss through `loss.item()`); the batches of
# `Word2vecDataset.collate` drawn at random; sizes shrunk, two passes of four batches. Sparse COO gradients every step.
# Correct: nothing to report.
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn import init

# the source steps the scheduler before the update, which PyTorch warns of at the first step
warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")


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


torch.manual_seed(0)
emb_size, emb_dimension, iterations, initial_lr = 12, 5, 2, 0.05
skip_gram_model = SkipGramModel(emb_size, emb_dimension)
device = torch.device("cpu")
dataloader = [(torch.randint(emb_size, (8,)), torch.randint(emb_size, (8,)), torch.randint(emb_size, (8, 4)))
              for _ in range(4)]

for iteration in range(iterations):

    print("Iteration: " + str(iteration + 1))
    optimizer = optim.SparseAdam(skip_gram_model.parameters(), lr=initial_lr)
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
            print(i, repr(loss.item()), repr(running_loss))
print(repr(sum(p.sum() for p in skip_gram_model.parameters()).item()))
