"""Peak resident memory of a stage-3 run with parameters and optimizer on NVMe (a subprocess of
test_stage3_engine_buffers.py). Prints one JSON line: parameter count, resident growth in bytes."""
import json
import math
import resource
import sys
import tempfile

import torch
from torch import nn

import zeroinf
from stage3_models import Block, batch, loss_fn

width, blocks, path, buf_elems = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 37)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {
           "stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": buf_elems,
           "offload_param": {"device": "nvme", "nvme_path": tempfile.mkdtemp(dir=path), "buffer_count": 2,
                             "buffer_size": buf_elems, "max_in_cpu": 0},
           "offload_optimizer": {"device": "nvme", "nvme_path": tempfile.mkdtemp(dir=path), "buffer_count": 3,
                                 "pipeline_read": True, "pipeline_write": True}}}
torch.manual_seed(0)
x, y = batch(0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with zeroinf.Init(config=cfg):
    model = LM()
from zeroinf.runtime.stage3.init import init_shapes  # noqa: E402

params = sum(math.prod(s) for s in init_shapes(model).values())
engine, *_ = zeroinf.initialize(model=model, config=cfg)
for step in range(2):
    x, y = batch(step)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
engine.close()
print(json.dumps({"params": params, "growth": peak - before}))
