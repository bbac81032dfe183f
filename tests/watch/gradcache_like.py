"""A stand-in for sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (GradCache,
``base/losses/gradcache.py``) in plain torch, outside the script under watch as the library's loss is: its backwards
are called from a library's line, and watch places them at the script's line that calls the loss."""
import torch
from torch import nn


def grad_cache(model, queries, docs, mini=2):
    """sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (GradCache) in plain torch: embeddings made
    under ``no_grad`` as leaves; the in-batch softmax loss back-propagated chunk by chunk into them (each chunk's scores
    against one ``torch.cat`` of all of them, which saves nothing); then a leaf loss whose hook embeds each chunk
    again with its graph and back-propagates the cached gradients. Returns the leaf loss."""
    chunks = [(queries[i:i + mini], docs[i:i + mini]) for i in range(0, len(queries), mini)]
    with torch.no_grad():
        reps = [(model(q).detach().requires_grad_(), model(d).detach().requires_grad_()) for q, d in chunks]
    all_q, all_d = torch.cat([q for q, _ in reps]), torch.cat([torch.cat([d for _, d in reps])])
    total = 0.0
    for i in range(0, len(queries), mini):
        scores = nn.functional.normalize(all_q[torch.arange(i, i + mini)], dim=-1) @ \
            nn.functional.normalize(all_d, dim=-1).T * 20.0
        part = nn.functional.cross_entropy(scores, torch.arange(i, i + mini)) * mini / len(queries)
        part.backward()
        total += part.detach()
    cache = [(q.grad, d.grad) for q, d in reps]

    def replay(grad):
        with torch.enable_grad():  # off in backward
            for (q, d), (gq, gd) in zip(chunks, cache):
                surrogate = torch.dot(model(q).flatten(), gq.flatten()) + torch.dot(model(d).flatten(), gd.flatten())
                surrogate.backward(grad)  # a backward inside a backward, as the library's hook runs it

    loss = total.detach().requires_grad_()
    loss.register_hook(replay)
    return loss

