"""``zeroinf train``'s plain PyTorch engine: the ``--engine torch`` baseline and the ``--compare``
reference, with the engine's interface."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import torch

from zeroinf.checkpoint import save_atomically, write_latest

__all__ = ["PlainEngine"]


class PlainEngine:
    """Plain PyTorch with the engine's interface: the ``--engine torch`` baseline and the
    ``--compare`` reference.

    ``torch.optim.AdamW(foreach=False)`` (``Adam`` with L2 decay when ``adamw`` is false) over fp32
    parameters. In ``bf16``/``fp16`` the model is
    cast to that dtype and the optimizer steps fp32 master copies, written back with ``.to(dtype)``
    (the mixed-precision recipe of the ZeRO paper, without loss scaling: fp16 here is for
    comparison on short runs only). ``backward`` divides the loss by ``grad_accum`` as DeepSpeed
    does; ``step`` updates at every ``grad_accum``-th call, after clipping the global gradient norm
    to ``clip`` (``torch.nn.utils.clip_grad_norm_``, 0 = off). Under ``torch.distributed`` with
    ``data_parallel`` it is plain data parallel: each gradient is all-reduced and divided by the
    world size before clipping (the ``--compare`` reference runs on rank 0 alone, without).
    """

    def __init__(self, model: torch.nn.Module, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw: bool = True, clip: float = 0.0, norm_type: float = 2.0,
                 grad_accum: int = 1, dtype: str = "fp32", device: str = "cpu", data_parallel: bool = True):
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        trainable = [p for p in model.parameters() if p.requires_grad]
        # master weights are fp32 copies taken before the cast, so they start exact
        master = [p.detach().to(device=device, dtype=torch.float32, copy=True) for p in trainable]
        self.module = model.to(device=device, dtype=self.dtype)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if self.dtype == torch.float32:
            self.master = self.params
        else:
            self.master = [m.requires_grad_(True) for m in master]
        del master
        opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
        self.optimizer = opt_cls(self.master, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                 foreach=False)
        self.clip, self.norm_type, self.grad_accum, self.data_parallel = clip, norm_type, grad_accum, data_parallel
        self.device = torch.device(device)
        self.global_steps, self.micro_steps, self._norm = 0, 0, None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.grad_accum:
            return
        if self.data_parallel and torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
            for p in self.params:             # plain data parallel: average the gradients
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(world)
        if self.master is not self.params:
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.master, self.clip if self.clip > 0 else float("inf"),
                                              norm_type=self.norm_type)
        self._norm = float(norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not self.params:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
                    p.grad = None
        self.global_steps += 1

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def get_lr(self) -> List[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        return self._norm

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    def stats(self) -> Dict[str, float]:
        return {}

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = True) -> None:
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        state = {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "master": [m.detach() for m in self.master] if self.master is not self.params else [],
                 "global_steps": self.global_steps, "micro_steps": self.micro_steps}
        save_atomically(state, str(path / "plain_engine.pt"))
        if save_latest:
            write_latest(str(save_dir), tag)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None) -> None:
        """Load ``load_dir/tag`` (``tag`` None: the one named in ``load_dir/latest``, as DeepSpeed)."""
        tag = tag or (Path(load_dir) / "latest").read_text().strip()
        state = torch.load(Path(load_dir) / tag / "plain_engine.pt", weights_only=True)
        self.module.load_state_dict(state["module"])
        with torch.no_grad():
            for m, saved in zip(self.master if self.master is not self.params else [], state["master"]):
                m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.global_steps, self.micro_steps = state["global_steps"], state["micro_steps"]

