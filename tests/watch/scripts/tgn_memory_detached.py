# Temporal graph network (pyg-team/pytorch_geometric examples/tgn.py, its TGNMemory, IdentityMessage, LastAggregator,
# TimeEncoder and LastNeighborLoader from torch_geometric/nn/models/tgn.py, ported in small): a memory of every node,
# a buffer, is read by each batch through a GRU over the messages stored by the last batch; `update_state` writes the
# GRU's new memory of the batch's nodes into the buffer in place, with its graph, before the backward; after the
# optimizer step `memory.detach()` (`self.memory.detach_()`) cuts it, so the next batch starts from its values.
# TransformerConv is replaced by one linear layer over the same inputs.
import torch
from torch.nn import GRUCell, Linear


class TimeEncoder(torch.nn.Module):
    def __init__(self, out_channels):
        super().__init__()
        self.out_channels = out_channels
        self.lin = Linear(1, out_channels)

    def forward(self, t):
        return self.lin(t.view(-1, 1)).cos()


class IdentityMessage(torch.nn.Module):
    def __init__(self, raw_msg_dim, memory_dim, time_dim):
        super().__init__()
        self.out_channels = raw_msg_dim + 2 * memory_dim + time_dim

    def forward(self, z_src, z_dst, raw_msg, t_enc):
        return torch.cat([z_src, z_dst, raw_msg, t_enc], dim=-1)


class LastAggregator(torch.nn.Module):
    def forward(self, msg, index, t, dim_size):
        argmax = torch.full((dim_size,), msg.size(0), dtype=torch.long)
        for i in range(msg.size(0)):  # the last message of each node (torch_geometric's scatter_argmax)
            if argmax[index[i]] == msg.size(0) or t[i] >= t[argmax[index[i]]]:
                argmax[index[i]] = i
        out = msg.new_zeros((dim_size, msg.size(-1)))
        mask = argmax < msg.size(0)
        out[mask] = msg[argmax[mask]]
        return out


class TGNMemory(torch.nn.Module):
    def __init__(self, num_nodes, raw_msg_dim, memory_dim, time_dim, message_module, aggregator_module):
        super().__init__()
        self.num_nodes, self.raw_msg_dim = num_nodes, raw_msg_dim
        self.msg_s_module, self.msg_d_module = message_module, IdentityMessage(raw_msg_dim, memory_dim, time_dim)
        self.aggr_module = aggregator_module
        self.time_enc = TimeEncoder(time_dim)
        self.gru = GRUCell(message_module.out_channels, memory_dim)
        self.register_buffer('memory', torch.empty(num_nodes, memory_dim))
        self.register_buffer('last_update', torch.empty(num_nodes, dtype=torch.long))
        self.register_buffer('_assoc', torch.empty(num_nodes, dtype=torch.long))
        self.reset_state()

    def reset_state(self):
        self.memory.zero_()
        self.last_update.zero_()
        i = self.memory.new_empty((0,), dtype=torch.long)
        msg = self.memory.new_empty((0, self.raw_msg_dim))
        self.msg_s_store = {j: (i, i, i, msg) for j in range(self.num_nodes)}
        self.msg_d_store = {j: (i, i, i, msg) for j in range(self.num_nodes)}

    def detach(self):
        """Detaches the memory from gradient computation."""
        self.memory.detach_()

    def forward(self, n_id):
        return self._get_updated_memory(n_id)

    def update_state(self, src, dst, t, raw_msg):
        n_id = torch.cat([src, dst]).unique()
        self._update_memory(n_id)
        self._update_msg_store(src, dst, t, raw_msg, self.msg_s_store)
        self._update_msg_store(dst, src, t, raw_msg, self.msg_d_store)

    def _update_memory(self, n_id):
        memory, last_update = self._get_updated_memory(n_id)
        self.memory[n_id] = memory
        self.last_update[n_id] = last_update

    def _get_updated_memory(self, n_id):
        self._assoc[n_id] = torch.arange(n_id.size(0))
        msg_s, t_s, src_s, dst_s = self._compute_msg(n_id, self.msg_s_store, self.msg_s_module)
        msg_d, t_d, src_d, dst_d = self._compute_msg(n_id, self.msg_d_store, self.msg_d_module)
        idx = torch.cat([src_s, src_d], dim=0)
        msg = torch.cat([msg_s, msg_d], dim=0)
        t = torch.cat([t_s, t_d], dim=0)
        aggr = self.aggr_module(msg, self._assoc[idx], t, n_id.size(0))
        memory = self.gru(aggr, self.memory[n_id])
        last_update = torch.zeros(self.num_nodes, dtype=torch.long).scatter_reduce(0, idx, t, 'amax')[n_id]
        return memory, last_update

    def _update_msg_store(self, src, dst, t, raw_msg, msg_store):
        n_id, perm = src.sort()
        n_id, count = n_id.unique_consecutive(return_counts=True)
        for i, idx in zip(n_id.tolist(), perm.split(count.tolist())):
            msg_store[i] = (src[idx], dst[idx], t[idx], raw_msg[idx])

    def _compute_msg(self, n_id, msg_store, msg_module):
        src, dst, t, raw_msg = list(zip(*[msg_store[i] for i in n_id.tolist()]))
        src, dst, t, raw_msg = torch.cat(src), torch.cat(dst), torch.cat(t), torch.cat(raw_msg)
        t_enc = self.time_enc((t - self.last_update[src]).to(raw_msg.dtype))
        return msg_module(self.memory[src], self.memory[dst], raw_msg, t_enc), t, src, dst


class LastNeighborLoader:
    def __init__(self, num_nodes, size):
        self.size = size
        self.neighbors = torch.empty((num_nodes, size), dtype=torch.long)
        self.e_id = torch.empty((num_nodes, size), dtype=torch.long)
        self._assoc = torch.empty(num_nodes, dtype=torch.long)
        self.reset_state()

    def __call__(self, n_id):
        neighbors, nodes, e_id = self.neighbors[n_id], n_id.view(-1, 1).repeat(1, self.size), self.e_id[n_id]
        mask = e_id >= 0
        neighbors, nodes, e_id = neighbors[mask], nodes[mask], e_id[mask]
        n_id = torch.cat([n_id, neighbors]).unique()
        self._assoc[n_id] = torch.arange(n_id.size(0))
        return n_id, torch.stack([self._assoc[neighbors], self._assoc[nodes]]), e_id

    def insert(self, src, dst):
        neighbors, nodes = torch.cat([src, dst]), torch.cat([dst, src])
        e_id = torch.arange(self.cur_e_id, self.cur_e_id + src.size(0)).repeat(2)
        self.cur_e_id += src.numel()
        nodes, perm = nodes.sort()
        neighbors, e_id = neighbors[perm], e_id[perm]
        n_id = nodes.unique()
        self._assoc[n_id] = torch.arange(n_id.numel())
        dense_id = torch.arange(nodes.size(0)) % self.size + self._assoc[nodes].mul_(self.size)
        dense_e_id = e_id.new_full((n_id.numel() * self.size,), -1)
        dense_e_id[dense_id] = e_id
        dense_neighbors = e_id.new_empty(n_id.numel() * self.size)
        dense_neighbors[dense_id] = neighbors
        e_id = torch.cat([self.e_id[n_id, :self.size], dense_e_id.view(-1, self.size)], dim=-1)
        neighbors = torch.cat([self.neighbors[n_id, :self.size], dense_neighbors.view(-1, self.size)], dim=-1)
        e_id, perm = e_id.topk(self.size, dim=-1)
        self.e_id[n_id] = e_id
        self.neighbors[n_id] = torch.gather(neighbors, 1, perm)

    def reset_state(self):
        self.cur_e_id = 0
        self.e_id.fill_(-1)


class GraphAttentionEmbedding(torch.nn.Module):
    def __init__(self, in_channels, out_channels, msg_dim, time_enc):
        super().__init__()
        self.time_enc = time_enc
        self.lin = Linear(in_channels + msg_dim + time_enc.out_channels, out_channels)

    def forward(self, x, last_update, edge_index, t, msg):
        rel_t_enc = self.time_enc((last_update[edge_index[0]] - t).to(x.dtype))
        edge_attr = torch.cat([rel_t_enc, msg], dim=-1)
        h = torch.zeros(x.size(0), edge_attr.size(1)).index_add(0, edge_index[1], edge_attr)
        return self.lin(torch.cat([x, h], dim=-1))


class LinkPredictor(torch.nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.lin_src, self.lin_dst = Linear(in_channels, in_channels), Linear(in_channels, in_channels)
        self.lin_final = Linear(in_channels, 1)

    def forward(self, z_src, z_dst):
        return self.lin_final((self.lin_src(z_src) + self.lin_dst(z_dst)).relu())


torch.manual_seed(0)
num_nodes, msg_dim, events, batch_size = 8, 3, 40, 8
src, dst = torch.randint(0, 4, (events,)), torch.randint(4, num_nodes, (events,))
t, msg = torch.arange(events), torch.randn(events, msg_dim)
memory_dim = time_dim = embedding_dim = 6
memory = TGNMemory(num_nodes, msg_dim, memory_dim, time_dim,
                   message_module=IdentityMessage(msg_dim, memory_dim, time_dim), aggregator_module=LastAggregator())
gnn = GraphAttentionEmbedding(memory_dim, embedding_dim, msg_dim, memory.time_enc)
link_pred = LinkPredictor(embedding_dim)
neighbor_loader = LastNeighborLoader(num_nodes, size=3)
params = list(dict.fromkeys([*memory.parameters(), *gnn.parameters(), *link_pred.parameters()]))  # the source: a set
optimizer = torch.optim.Adam(params, lr=0.01)
criterion = torch.nn.BCEWithLogitsLoss()
assoc = torch.empty(num_nodes, dtype=torch.long)

for epoch in range(2):
    memory.reset_state()
    neighbor_loader.reset_state()
    for i in range(0, events, batch_size):
        b_src, b_dst, b_t, b_msg = (x[i:i + batch_size] for x in (src, dst, t, msg))
        b_neg = torch.randint(4, num_nodes, (b_src.size(0),))
        optimizer.zero_grad()
        n_id, edge_index, e_id = neighbor_loader(torch.cat([b_src, b_dst, b_neg]).unique())
        assoc[n_id] = torch.arange(n_id.size(0))
        z, last_update = memory(n_id)
        z = gnn(z, last_update, edge_index, t[e_id], msg[e_id])
        pos_out = link_pred(z[assoc[b_src]], z[assoc[b_dst]])
        neg_out = link_pred(z[assoc[b_src]], z[assoc[b_neg]])
        loss = criterion(pos_out, torch.ones_like(pos_out))
        loss += criterion(neg_out, torch.zeros_like(neg_out))
        memory.update_state(b_src, b_dst, b_t, b_msg)
        neighbor_loader.insert(b_src, b_dst)
        loss.backward()
        optimizer.step()
        memory.detach()
        print(f"epoch {epoch} batch {i // batch_size}: loss {loss.item()!r}")
print(f"checksum {sum(p.double().sum() for p in params).item()!r}")
