"""Small models for the stage-3 tests (4 transformer blocks, vocab 37, width 16)."""
import torch
from torch import nn
import torch.nn.functional as F

V, D = 37, 16


class Block(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True, bias=False)  # the key bias has a zero gradient: noise Adam would amplify
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        h = self.ln(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + a
        return x + self.ff(x)


class TinyLM(nn.Module):
    """Embedding, 4 blocks, final norm, head. ``order`` picks which blocks run (a block index
    may repeat: a block called twice); ``tied`` shares the head weight with the embedding;
    ``foreign`` makes block 2 also read block 0's first linear weight."""

    def __init__(self, n=4, tied=False, foreign=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        if foreign:
            self.blocks[2].register_forward_hook(self._foreign_hook)
        self.order = list(range(n))

    def _foreign_hook(self, mod, args, out):
        w = self.blocks[0].ff[0].weight  # [2D, D], owned by another unit
        return out + 0.1 * F.linear(out, w)[..., :D]

    def forward(self, idx):
        x = self.emb(idx)
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(self.norm(x))


def batch(seed, b=2, t=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, t), generator=g), torch.randint(0, V, (b, t), generator=g)


def loss_fn(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def full_params(mgr):
    """Every parameter of a stage-3 manager's model, read back from its partitions (one rank):
    ``{name: tensor of the parameter's full shape}``."""
    out = {}
    for g in mgr.groups():
        t = torch.empty(g.shard_numel, dtype=g.dtype)
        mgr.read_param_shard(g, t)
        for s in g.slots:
            out[s.name] = t[s.offset:s.offset + s.numel].view(s.shape).clone()
    return out
