"""Engine checkpoints: save, load (resume bit-exact) and consolidate into one fp32 state dict.

Layout of ``<dir>/<tag>/`` (every file loads with ``torch.load(weights_only=True)``)::

    optim_rank{r}_{group}_{sub}.pt   one per sub-group of rank r: key, master, exp_avg, exp_avg_sq
                                     (fp32; the moments bf16 with offload_optimizer.state_dtype bf16)
    rng_rank{r}.pt                   rank r's RNG states (python, numpy, torch CPU, CUDA)
    model_states.pt                  written by rank 0 *last*: the module's state dict, step counters,
                                     loss scaler, LR scheduler, param-group hyper-parameters, the
                                     flat layout (for consolidate) and the caller's client_state
    <dir>/latest                     the tag of the last complete save

Each rank writes only files carrying its rank in the name, into ``<dir>/<tag>.saving``, which is
renamed onto ``<dir>/<tag>`` once complete: ranks saving at once never collide, and saving the
same tag twice replaces it whole, or (if the second save fails) not at all. The
optimizer state is streamed: one sub-group at a time is read from its tier (NVMe swap files
included) and written, never the whole partition at once. ``model_states.pt`` is written after a
barrier, so a folder without it is an incomplete save and is refused at load.

The package by job: :mod:`.files` (names, atomic writes, checked reads, ``latest``),
:mod:`.saveload` (save and load an engine), :mod:`.consolidation` (one fp32 state dict),
:mod:`.verify` (checks before a load changes anything), :mod:`.ranks` (agreement between ranks),
:mod:`.module_state` (the module's state and flat layout), :mod:`.rng` (RNG states).
"""
from .consolidation import consolidate
from .files import CheckpointError, save_atomically, write_latest
from .module_state import frozen_names
from .saveload import load, load_weights, save

__all__ = ["save", "load", "consolidate", "frozen_names", "CheckpointError"]
