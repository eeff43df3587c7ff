"""Shared by the tests of stage 3's optimizer step run inside the backward
(test_stage3_in_backward_*.py): an engine with the optimizer in backward on or off, several
sub-groups per flat group, and a function run on a thread of its own with a time limit."""
import threading

import zeroinf
from stage3_engine_helpers import _config


def _engine(path, model, in_backward, tiers=("nvme", "nvme"), zero=None, **extra):
    path.mkdir(exist_ok=True)
    cfg = _config(*tiers, path, sub_group_size=700, **(zero or {}))  # several sub-groups per flat group
    cfg["zeroinf"] = {"optimizer_in_backward": in_backward, "overlap_step": in_backward}
    cfg.update(extra)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    return engine


def _in_thread(fn, timeout=120):
    """Run ``fn`` on a thread of its own; re-raise its error, fail if it has not returned in
    ``timeout`` seconds (a hang)."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn.__name__} still running after {timeout} s"
    if "error" in out:
        raise out["error"]
