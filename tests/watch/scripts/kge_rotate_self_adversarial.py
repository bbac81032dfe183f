# RotatE as DeepGraphLearning/KnowledgeGraphEmbedding (2e440e0) trains it: codes/model.py (`KGEModel` with RotatE's
# score, entity and relation tables as plain Parameters read by `torch.index_select`, `train_step` as a staticmethod:
# self-adversarial negative weights detached, subsampling weights, `next(train_iterator)`), codes/dataloader.py
# (`TrainDataset` drawing filtered negatives with NumPy, `BidirectionalOneShotIterator` taking head-batch and
# tail-batch in turn) and codes/run.py (Adam over the parameters that require grad, made again with a tenth of the
# learning rate at the warm-up step, the logs kept as `.item()` floats). Twenty random triples, eight steps; the
# other scores, logging and checkpoints left out; `np.in1d` (deprecated) as `np.isin`, the frequency and true-triple
# dictionaries built with `setdefault`/`get` to the same values. Correct: nothing to report.
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class KGEModel(nn.Module):
    def __init__(self, model_name, nentity, nrelation, hidden_dim, gamma,
                 double_entity_embedding=False, double_relation_embedding=False):
        super(KGEModel, self).__init__()
        self.model_name = model_name
        self.nentity = nentity
        self.nrelation = nrelation
        self.hidden_dim = hidden_dim
        self.epsilon = 2.0
        self.gamma = nn.Parameter(torch.Tensor([gamma]), requires_grad=False)
        self.embedding_range = nn.Parameter(torch.Tensor([(self.gamma.item() + self.epsilon) / hidden_dim]),
                                            requires_grad=False)
        self.entity_dim = hidden_dim * 2 if double_entity_embedding else hidden_dim
        self.relation_dim = hidden_dim * 2 if double_relation_embedding else hidden_dim
        self.entity_embedding = nn.Parameter(torch.zeros(nentity, self.entity_dim))
        nn.init.uniform_(tensor=self.entity_embedding, a=-self.embedding_range.item(), b=self.embedding_range.item())
        self.relation_embedding = nn.Parameter(torch.zeros(nrelation, self.relation_dim))
        nn.init.uniform_(tensor=self.relation_embedding, a=-self.embedding_range.item(),
                         b=self.embedding_range.item())

    def forward(self, sample, mode='single'):
        if mode == 'single':
            batch_size, negative_sample_size = sample.size(0), 1
            head = torch.index_select(self.entity_embedding, dim=0, index=sample[:, 0]).unsqueeze(1)
            relation = torch.index_select(self.relation_embedding, dim=0, index=sample[:, 1]).unsqueeze(1)
            tail = torch.index_select(self.entity_embedding, dim=0, index=sample[:, 2]).unsqueeze(1)
        elif mode == 'head-batch':
            tail_part, head_part = sample
            batch_size, negative_sample_size = head_part.size(0), head_part.size(1)
            head = torch.index_select(self.entity_embedding, dim=0, index=head_part.view(-1)).view(
                batch_size, negative_sample_size, -1)
            relation = torch.index_select(self.relation_embedding, dim=0, index=tail_part[:, 1]).unsqueeze(1)
            tail = torch.index_select(self.entity_embedding, dim=0, index=tail_part[:, 2]).unsqueeze(1)
        elif mode == 'tail-batch':
            head_part, tail_part = sample
            batch_size, negative_sample_size = tail_part.size(0), tail_part.size(1)
            head = torch.index_select(self.entity_embedding, dim=0, index=head_part[:, 0]).unsqueeze(1)
            relation = torch.index_select(self.relation_embedding, dim=0, index=head_part[:, 1]).unsqueeze(1)
            tail = torch.index_select(self.entity_embedding, dim=0, index=tail_part.view(-1)).view(
                batch_size, negative_sample_size, -1)
        else:
            raise ValueError('mode %s not supported' % mode)
        return self.RotatE(head, relation, tail, mode)

    def RotatE(self, head, relation, tail, mode):
        pi = 3.14159265358979323846
        re_head, im_head = torch.chunk(head, 2, dim=2)
        re_tail, im_tail = torch.chunk(tail, 2, dim=2)
        phase_relation = relation / (self.embedding_range.item() / pi)
        re_relation = torch.cos(phase_relation)
        im_relation = torch.sin(phase_relation)
        if mode == 'head-batch':
            re_score = re_relation * re_tail + im_relation * im_tail
            im_score = re_relation * im_tail - im_relation * re_tail
            re_score = re_score - re_head
            im_score = im_score - im_head
        else:
            re_score = re_head * re_relation - im_head * im_relation
            im_score = re_head * im_relation + im_head * re_relation
            re_score = re_score - re_tail
            im_score = im_score - im_tail
        score = torch.stack([re_score, im_score], dim=0)
        score = score.norm(dim=0)
        score = self.gamma.item() - score.sum(dim=2)
        return score

    @staticmethod
    def train_step(model, optimizer, train_iterator, args):
        model.train()
        optimizer.zero_grad()
        positive_sample, negative_sample, subsampling_weight, mode = next(train_iterator)
        negative_score = model((positive_sample, negative_sample), mode=mode)
        if args.negative_adversarial_sampling:
            # In self-adversarial sampling, we do not apply back-propagation on the sampling weight
            negative_score = (F.softmax(negative_score * args.adversarial_temperature, dim=1).detach()
                              * F.logsigmoid(-negative_score)).sum(dim=1)
        else:
            negative_score = F.logsigmoid(-negative_score).mean(dim=1)
        positive_score = model(positive_sample)
        positive_score = F.logsigmoid(positive_score).squeeze(dim=1)
        if args.uni_weight:
            positive_sample_loss = - positive_score.mean()
            negative_sample_loss = - negative_score.mean()
        else:
            positive_sample_loss = - (subsampling_weight * positive_score).sum() / subsampling_weight.sum()
            negative_sample_loss = - (subsampling_weight * negative_score).sum() / subsampling_weight.sum()
        loss = (positive_sample_loss + negative_sample_loss) / 2
        if args.regularization != 0.0:
            # Use L3 regularization for ComplEx and DistMult
            regularization = args.regularization * (
                model.entity_embedding.norm(p=3) ** 3 + model.relation_embedding.norm(p=3).norm(p=3) ** 3)
            loss = loss + regularization
            regularization_log = {'regularization': regularization.item()}
        else:
            regularization_log = {}
        loss.backward()
        optimizer.step()
        log = {**regularization_log, 'positive_sample_loss': positive_sample_loss.item(),
               'negative_sample_loss': negative_sample_loss.item(), 'loss': loss.item()}
        return log


class TrainDataset(Dataset):
    def __init__(self, triples, nentity, nrelation, negative_sample_size, mode):
        self.len = len(triples)
        self.triples = triples
        self.nentity = nentity
        self.nrelation = nrelation
        self.negative_sample_size = negative_sample_size
        self.mode = mode
        self.count = self.count_frequency(triples)
        self.true_head, self.true_tail = self.get_true_head_and_tail(self.triples)

    def __len__(self):
        return self.len

    def __getitem__(self, idx):
        positive_sample = self.triples[idx]
        head, relation, tail = positive_sample
        subsampling_weight = self.count[(head, relation)] + self.count[(tail, -relation - 1)]
        subsampling_weight = torch.sqrt(1 / torch.Tensor([subsampling_weight]))
        negative_sample_list = []
        negative_sample_size = 0
        while negative_sample_size < self.negative_sample_size:
            negative_sample = np.random.randint(self.nentity, size=self.negative_sample_size * 2)
            if self.mode == 'head-batch':
                mask = np.isin(negative_sample, self.true_head[(relation, tail)], assume_unique=True, invert=True)
            else:
                mask = np.isin(negative_sample, self.true_tail[(head, relation)], assume_unique=True, invert=True)
            negative_sample = negative_sample[mask]
            negative_sample_list.append(negative_sample)
            negative_sample_size += negative_sample.size
        negative_sample = np.concatenate(negative_sample_list)[:self.negative_sample_size]
        negative_sample = torch.LongTensor(negative_sample)
        positive_sample = torch.LongTensor(positive_sample)
        return positive_sample, negative_sample, subsampling_weight, self.mode

    @staticmethod
    def collate_fn(data):
        positive_sample = torch.stack([_[0] for _ in data], dim=0)
        negative_sample = torch.stack([_[1] for _ in data], dim=0)
        subsample_weight = torch.cat([_[2] for _ in data], dim=0)
        mode = data[0][3]
        return positive_sample, negative_sample, subsample_weight, mode

    @staticmethod
    def count_frequency(triples, start=4):
        count = {}
        for head, relation, tail in triples:
            count[(head, relation)] = count.get((head, relation), start - 1) + 1
            count[(tail, -relation - 1)] = count.get((tail, -relation - 1), start - 1) + 1
        return count

    @staticmethod
    def get_true_head_and_tail(triples):
        true_head, true_tail = {}, {}
        for head, relation, tail in triples:
            true_tail.setdefault((head, relation), []).append(tail)
            true_head.setdefault((relation, tail), []).append(head)
        true_head = {k: np.array(list(set(v))) for k, v in true_head.items()}
        true_tail = {k: np.array(list(set(v))) for k, v in true_tail.items()}
        return true_head, true_tail


class BidirectionalOneShotIterator(object):
    def __init__(self, dataloader_head, dataloader_tail):
        self.iterator_head = self.one_shot_iterator(dataloader_head)
        self.iterator_tail = self.one_shot_iterator(dataloader_tail)
        self.step = 0

    def __next__(self):
        self.step += 1
        if self.step % 2 == 0:
            data = next(self.iterator_head)
        else:
            data = next(self.iterator_tail)
        return data

    @staticmethod
    def one_shot_iterator(dataloader):
        while True:
            for data in dataloader:
                yield data


torch.manual_seed(0)
np.random.seed(0)
args = argparse.Namespace(negative_adversarial_sampling=True, adversarial_temperature=1.0, uni_weight=False,
                          regularization=0.0, learning_rate=0.01, max_steps=8, warm_up_steps=4, batch_size=5,
                          negative_sample_size=6, hidden_dim=4, gamma=12.0)
nentity, nrelation = 10, 3
train_triples = list({(int(h), int(r), int(t)) for h, r, t in zip(np.random.randint(nentity, size=20),
                                                                  np.random.randint(nrelation, size=20),
                                                                  np.random.randint(nentity, size=20))})
train_triples.sort()
kge_model = KGEModel(model_name='RotatE', nentity=nentity, nrelation=nrelation, hidden_dim=args.hidden_dim,
                     gamma=args.gamma, double_entity_embedding=True, double_relation_embedding=False)
train_dataloader_head = DataLoader(
    TrainDataset(train_triples, nentity, nrelation, args.negative_sample_size, 'head-batch'),
    batch_size=args.batch_size, shuffle=True, num_workers=0, collate_fn=TrainDataset.collate_fn)
train_dataloader_tail = DataLoader(
    TrainDataset(train_triples, nentity, nrelation, args.negative_sample_size, 'tail-batch'),
    batch_size=args.batch_size, shuffle=True, num_workers=0, collate_fn=TrainDataset.collate_fn)
train_iterator = BidirectionalOneShotIterator(train_dataloader_head, train_dataloader_tail)
current_learning_rate = args.learning_rate
optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, kge_model.parameters()), lr=current_learning_rate)
warm_up_steps = args.warm_up_steps
init_step = 0
training_logs = []
for step in range(init_step, args.max_steps):
    log = kge_model.train_step(kge_model, optimizer, train_iterator, args)
    training_logs.append(log)
    if step >= warm_up_steps:
        current_learning_rate = current_learning_rate / 10
        optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, kge_model.parameters()),
                                     lr=current_learning_rate)
        warm_up_steps = warm_up_steps * 3
    print(step, repr(log['loss']), repr(log['positive_sample_loss']), repr(log['negative_sample_loss']))
print(repr(kge_model.entity_embedding.sum().item()), repr(kge_model.relation_embedding.sum().item()))
