"""``zeroinf train --compare``: the run's steps replayed with plain PyTorch (:class:`PlainEngine`,
no offload, every rank's rows in one process) and the two loss curves held against
:data:`COMPARE_ATOL`."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

from zeroinf.cli.train_plain import PlainEngine

__all__ = ["COMPARE_ATOL", "replay"]

#: largest allowed |loss(offload) - loss(reference)| per step for --compare, by training dtype.
#: fp32: both runs do the same fp32 math in a different order, so rounding differences only
#: (grown over 20-40 steps of a chaotic optimisation); bf16/fp16: the offloaded model computes in
#: 16 bits like the reference, but reductions and casts may differ in order (measured: 1e-3 over
#: 20 steps of the tiny model in bf16).
COMPARE_ATOL = {"fp32": 2e-3, "bf16": 0.03, "fp16": 0.03}


def replay(a, mcfg, batches, grad_accum: int, world: int, records: List[dict], dtype: str, reference: dict,
           out: Path) -> Optional[Tuple[bool, dict, List[float]]]:
    """Replay the logged ``records`` (each step at its logged ``lr``) on a :class:`PlainEngine`
    built with ``reference`` (its keyword arguments) over the model ``mcfg`` as ``--seed`` and
    ``--init`` build it, and print the table of both losses. Returns ``(within COMPARE_ATOL[dtype],
    compare.json's dict, the reference losses)``, or None after a Ctrl-C (said in one line on
    stderr: the run's own outputs in ``out`` are complete)."""
    from zeroinf.data import Batches
    from zeroinf.models import build_model
    ref_batches = Batches(batches.tokens, batches.seq_len, batches.micro_batch, batches.seed)
    engine = PlainEngine(build_model(mcfg, a.seed, a.init), data_parallel=False, **reference)
    from tqdm import tqdm
    ref = []
    t0 = time.perf_counter()
    bar = tqdm(records, desc="--compare: replaying without offload", unit="step", dynamic_ncols=True,
               file=sys.stderr)
    try:
        for r in bar:
            step = r["step"]
            engine.set_lr(r["lr"])
            losses = []
            for micro in range(grad_accum):
                x = ref_batches.get(step, micro, world_size=world, rows=slice(None))
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach().float()))
            ref.append(sum(losses) / len(losses))
    except KeyboardInterrupt:
        bar.close()
        print(f"zeroinf train: --compare interrupted after replaying {len(ref)} of {len(records)} steps; "
              f"the run's own outputs in {out} are complete", file=sys.stderr, flush=True)
        return None
    finally:
        bar.close()
    ref_s = (time.perf_counter() - t0) / max(1, len(records))
    diffs = [abs(r["loss"] - x) for r, x in zip(records, ref)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    tol = COMPARE_ATOL[dtype]
    print(f"\n--compare: this run vs plain PyTorch (torch.optim.AdamW, {dtype}, no offload)")
    print(f"{'step':>6} {'this run':>10} {'no offload':>11} {'|diff|':>10}")
    stride = max(1, len(records) // 20)
    for i, (r, x, d) in enumerate(zip(records, ref, diffs)):
        if i % stride == 0 or i == len(records) - 1 or i == worst:
            print(f"{r['step']:6d} {r['loss']:10.5f} {x:11.5f} {d:10.2e}")
    ok = diffs[worst] <= tol
    print(f"largest difference {diffs[worst]:.3e} at step {records[worst]['step']} "
          f"(allowed {tol:g} for {dtype}): {'PASS' if ok else 'FAIL'}; "
          f"reference {ref_s:.3f} s/step", flush=True)
    return ok, {"dtype": dtype, "atol": tol, "max_abs_diff": diffs[worst], "loss": [r["loss"] for r in records],
                "reference": ref}, ref
