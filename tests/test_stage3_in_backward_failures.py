"""Stage 3's optimizer step run inside the backward (``"zeroinf": {"optimizer_in_backward": true}``,
[Note: optimizer in backward] in zeroinf/runtime/stage3/in_backward.py): the cases it cannot
follow refused with errors that say why, and failures part-way (a failed backward or worker, an
interrupt at any line of the update's start or after autograd, a hook that waits for the update):
the engine goes on, or every later call reports the failed step, and nothing hangs."""
import subprocess
import sys
import textwrap

import pytest
import torch

from stage3_models import TinyLM, batch, loss_fn
from stage3_engine_helpers import _run
from stage3_in_backward_helpers import _engine, _in_thread
from zeroinf.config import ConfigError, parse_config
from zeroinf.runtime.stage3.in_backward import OptimizerInBackwardError
from zeroinf.runtime.stage3.overlap import StepFailedError


def test_a_worker_failing_before_its_first_update_fails_the_step_instead_of_hanging(tmp_path, monkeypatch):
    """The worker's first call (its thread cap) raised outside the code that reports a failure
    to the step gate: the thread died and the backward waited for it forever (helper-47 t04)."""
    import zeroinf.runtime.stage3.in_backward as ib

    def fail(n):
        raise RuntimeError("injected cap failure")

    monkeypatch.setattr(ib, "limit_thread_parallelism", fail)
    engine = _engine(tmp_path, TinyLM(), True, ("none", "none"))
    x, y = batch(0)

    def train():
        with pytest.raises(StepFailedError) as info:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        assert "injected cap failure" in repr(info.value.__cause__) + str(info.value)

    _in_thread(train)
    with pytest.raises(StepFailedError):
        engine.close()


@pytest.mark.parametrize("key,value,says", [
    ("stage", 2, "needs zero_optimization.stage 3, got 2"),
    ("gradient_accumulation_steps", 2, "needs gradient_accumulation_steps 1, got 2"),
    ("gradient_clipping", 1.0, "cannot clip"),
    ("fp16", {"enabled": True}, "fp16 is enabled"),
])
def test_config_refuses_what_needs_every_gradient_first(key, value, says):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "zeroinf": {"optimizer_in_backward": True}}
    if key == "stage":
        cfg["zero_optimization"]["stage"] = value
    else:
        cfg[key] = value
    with pytest.raises(ConfigError) as info:
        parse_config(cfg)
    assert info.value.key_path == "zeroinf.optimizer_in_backward" and says in str(info.value)
    cfg["zeroinf"]["optimizer_in_backward"] = False
    parse_config(cfg)  # the same config is fine without it
    assert parse_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                         "zeroinf": {"optimizer_in_backward": True}}).zeroinf.optimizer_in_backward


def test_backward_and_step_must_alternate(tmp_path):
    engine = _engine(tmp_path, TinyLM(), True, ("none", "cpu"))
    with pytest.raises(RuntimeError, match="needs an engine.backward"):
        engine.step()
    x, y = batch(1)
    engine.backward(loss_fn(engine(x), y))
    with pytest.raises(RuntimeError, match="called twice without"):
        engine.backward(loss_fn(engine(x), y))
    engine.step()  # the first backward's step is whole
    _run(engine, 1, start=2)
    assert engine.global_steps == 2
    engine.close()


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("injected backward failure")


def test_a_failed_backward_fails_the_step_and_every_later_call(tmp_path):
    """The backward raises after the later blocks' groups were handed over (some may be
    stepped): the error reaches the caller, and the engine refuses to go on from weights that
    are part old, part new."""
    model = TinyLM()
    model.blocks[0].register_forward_hook(lambda mod, args, out: _FailBackward.apply(out))
    engine = _engine(tmp_path, model, True)
    x, y = batch(1)
    with pytest.raises(ValueError, match="injected backward failure"):
        engine.backward(loss_fn(engine(x), y))
    with pytest.raises(StepFailedError) as info:
        engine.backward(loss_fn(engine(x), y))
    assert "the backward failed" in str(info.value.__cause__)
    for _ in range(2):  # every later wait raises it again, the step that would close it too
        with pytest.raises(StepFailedError):
            engine.synchronize()
    with pytest.raises(StepFailedError):
        engine.step()
    with pytest.raises(StepFailedError):
        engine.close()  # releases everything, then reports the failure
    assert engine._closed and engine.sub_optimizer._swapper is None


class _DetachedRead(torch.nn.Module):
    """Reads block 3's first linear weight without a gradient, before block 3 runs: its
    backward needs that weight after block 3's backward completed the weight's gradient."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        x = self.model.emb(idx)
        w = self.model.blocks[3].ff[0].weight
        x = x + 0.1 * torch.nn.functional.linear(x, w.detach())[..., :x.shape[-1]]
        for b in self.model.blocks:
            x = b(x)
        return self.model.head(self.model.norm(x))


def test_a_unit_needed_after_its_update_began_is_an_error(tmp_path):
    engine = _engine(tmp_path, _DetachedRead(TinyLM()), True, ("none", "cpu"))
    x, y = batch(1)
    with pytest.raises(OptimizerInBackwardError, match="needed again in the backward"):
        engine.backward(loss_fn(engine(x), y))
    with pytest.raises(StepFailedError):
        engine.close()


def test_a_checkpoint_between_backward_and_step_is_refused(tmp_path):
    """The backward has already applied the update while the step counter has not moved: such a
    checkpoint resumed to a run that applied that step twice (1.8e-2 off after one more step)."""
    engine = _engine(tmp_path / "swap", TinyLM(), True)
    _run(engine, 2)
    engine.save_checkpoint(str(tmp_path / "ck"), tag="two")
    x, y = batch(3)
    engine.backward(loss_fn(engine(x), y))
    for call in (lambda: engine.save_checkpoint(str(tmp_path / "ck"), tag="mid"),
                 lambda: engine.load_checkpoint(str(tmp_path / "ck"), tag="two")):
        with pytest.raises(RuntimeError, match="between engine.backward.. and engine.step"):
            call()
    assert not (tmp_path / "ck" / "mid").exists()
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ck"), tag="three")
    assert engine.global_steps == 3
    engine.close()


def _script(tmp_path, body: str, timeout: int = 240) -> str:
    """Run ``body`` (after the imports every script here needs) in a fresh interpreter with a
    time limit, so that a hang fails the test instead of stopping the suite; returns stdout."""
    head = f"""
        import copy, sys, torch
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        import zeroinf
        from stage3_models import TinyLM, batch, loss_fn
        from stage3_engine_helpers import _config, _run, _state
        from zeroinf.runtime.stage3.overlap import StepFailedError
        def engine(path, model, in_backward=True):
            import os
            os.makedirs(path, exist_ok=True)
            cfg = _config("nvme", "nvme", path, sub_group_size=700)
            cfg["zeroinf"] = {{"optimizer_in_backward": in_backward}}
            return zeroinf.initialize(model=model, config=cfg)[0]
    """
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(head) + textwrap.dedent(body))
    try:
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                              cwd=str(tmp_path))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the script hung ({timeout} s): {(e.stdout or '')[-2000:]}") from None
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_waiting_for_the_update_inside_the_backward_raises_instead_of_hanging(tmp_path):
    """A signal handler or hook on the backward's thread that waits for the update (a save on
    preemption, engine.close()) waited forever: the update needs the rest of that backward."""
    out = _script(tmp_path, f"""
        e = engine({str(tmp_path / "a")!r}, TinyLM())
        _run(e, 1)
        seen = []
        def wait_inside(grad):
            for call in (e.synchronize, e.module.state_dict, e.step):
                try:
                    call()
                    seen.append("waited")
                except RuntimeError as err:
                    seen.append("inside engine.backward" in str(err))
            return grad
        x, y = batch(2)
        logits = e(x)
        logits.register_hook(wait_inside)
        e.backward(loss_fn(logits, y))
        e.step()
        _run(e, 1, start=3)  # the step went on
        print("SYNC", seen, e.global_steps)
        e2 = engine({str(tmp_path / "b")!r}, TinyLM())
        _run(e2, 1)
        def close_inside(grad):
            try:
                e2.close()
            except StepFailedError:
                seen.append("close reported the failed step")
            return grad
        logits = e2(x)
        logits.register_hook(close_inside)
        try:
            e2.backward(loss_fn(logits, y))
        except Exception as err:  # the backward goes on after the hook with everything released
            seen.append(type(err).__name__)
        print("CLOSE", seen[3:], e2._closed, e2.sub_optimizer._swapper is None)
    """)
    assert "SYNC [True, True, True] 3" in out, out
    # close released everything (nothing had been handed over yet: no failed step to report), and
    # the rest of the backward then met the closed engine
    assert "CLOSE ['RuntimeError'] True True" in out, out


@pytest.mark.parametrize("where,in_backward", [("loss.float", True), ("first backward node", True),
                                               ("inside block 3", True), ("inside block 3", False)])
def test_a_failure_before_any_gradient_leaves_the_engine_usable(tmp_path, where, in_backward):
    """The common skip-the-batch-on-OOM loop: a backward that fails before any gradient was
    reduced updated nothing, so the engine goes on, equal to a run that never saw that batch.
    (It used to fail every later call; failing between the update's start and autograd, it hung.
    Inside block 3 the head's and final norm's gradients exist but nothing was reduced: they were
    left in the flat gradient buffers and added into the next backward's, in both engines: all
    36 weights off by up to 6e-2 five steps later.)"""
    out = _script(tmp_path, f"""
        class BadFloat(torch.Tensor):
            def float(self):
                raise KeyboardInterrupt("interrupted before autograd")
        def oom(grad):
            raise RuntimeError("out of memory (injected)")
        ref = TinyLM()
        a = engine({str(tmp_path / "a")!r}, copy.deepcopy(ref), {in_backward!r})
        b = engine({str(tmp_path / "b")!r}, copy.deepcopy(ref), {in_backward!r})
        _run(a, 2); _run(b, 2)
        x, y = batch(99)
        try:
            if {where!r} == "loss.float":
                b.backward(loss_fn(b(x), y).as_subclass(BadFloat))
            elif {where!r} == "first backward node":
                logits = b(x)
                logits.register_hook(oom)
                b.backward(loss_fn(logits, y))
            else:
                h = b.module.blocks[3].register_forward_hook(lambda m, a, out: out.register_hook(oom) and None)
                logits = b(x)
                h.remove()
                b.backward(loss_fn(logits, y))
        except BaseException as err:
            print("FAILED", type(err).__name__)
        la, lb = _run(a, 5, start=3), _run(b, 5, start=3)
        sa, sb = _state(a), _state(b)
        print("EQUAL", la == lb, all(torch.equal(sa[k], sb[k]) for k in sa), a.global_steps, b.global_steps)
        a.close(); b.close()
    """)
    assert "FAILED" in out and "EQUAL True True 7 7" in out, out


def test_an_interrupt_at_any_line_of_the_updates_start_neither_hangs_nor_corrupts(tmp_path):
    """Ctrl-C (KeyboardInterrupt, injected with sys.settrace) at each line of the path that
    starts the update: engine.backward, _start_backward_step, start_backward_step and
    BackwardStep.start. After each, training goes on (or every call reports the failed step)
    and close() returns: no worker is left waiting for gradients that never come (the
    tester's t45/t64: the process never exited). An interrupt after the backward was whole
    leaves the update applied and uncounted: the next backward says to call step() first."""
    out = _script(tmp_path, f"""
        import threading
        import zeroinf.runtime.engine as eng
        import zeroinf.runtime.stage3.engine_glue as glue
        import zeroinf.runtime.stage3.in_backward as ib
        funcs = [eng.ZeroEngine.backward, eng.ZeroEngine._start_backward_step,
                 glue.Stage3EngineParams.start_backward_step, ib.BackwardStep.start]
        results = []
        n = 0
        for fn in funcs:
            code = fn.__code__
            lines = sorted({{ln for _s, _e, ln in code.co_lines() if ln is not None and ln > code.co_firstlineno}})
            for line in lines:
                e = engine({str(tmp_path)!r} + f"/s{{n}}", TinyLM(), True)
                n += 1
                _run(e, 1)
                armed = [True]
                def local(frame, event, arg):
                    if event == "line" and frame.f_lineno == line and armed[0]:
                        armed[0] = False
                        raise KeyboardInterrupt
                    return local
                def tracer(frame, event, arg):
                    return local if frame.f_code is code else None
                sys.settrace(tracer)
                try:
                    x, y = batch(2)
                    e.backward(loss_fn(e(x), y))
                    e.step()
                except KeyboardInterrupt:
                    pass
                finally:
                    sys.settrace(None)
                try:
                    _run(e, 1, start=3)
                    res = "continues"
                except StepFailedError:
                    res = "failed"
                except RuntimeError as err:  # interrupted after the backward was whole: step() closes it
                    if "called twice" not in str(err):
                        raise
                    e.step()
                    _run(e, 1, start=3)
                    res = "stepped, continues"
                try:
                    e.close()
                except StepFailedError:
                    pass
                alive = [t.name for t in threading.enumerate() if t.name.startswith("zeroinf-optimizer")]
                results.append((fn.__name__, line, armed[0], res, alive))
        print("CASES", len(results))
        print("BAD", [r for r in results if r[4]])
        print("HIT", sum(not r[2] for r in results))
    """, timeout=400)
    assert "BAD []" in out, out
    cases = int(out.split("CASES ")[1].split()[0])
    hit = int(out.split("HIT ")[1].split()[0])
    assert cases > 30 and hit > 25, out


def test_an_interrupt_right_after_autograd_fails_the_step(tmp_path):
    """Every gradient was handed over and the worker may finish, but the step was not counted
    and the persistent unit not refreshed: it used to go on silently with stale persistent
    weights (and a checkpoint mixing steps); now every later call reports the failed step."""
    engine = _engine(tmp_path, TinyLM(), True)
    _run(engine, 2)
    end = engine.params.end_backward_step

    def interrupted():
        engine.params._worker.join(timeout=60)  # the worker got every group and finished them
        raise KeyboardInterrupt
    engine.params.end_backward_step = interrupted
    x, y = batch(3)
    with pytest.raises(KeyboardInterrupt):
        engine.backward(loss_fn(engine(x), y))
    engine.params.end_backward_step = end
    with pytest.raises(StepFailedError):
        engine.step()
    with pytest.raises(StepFailedError):
        engine.save_checkpoint(str(tmp_path / "ck"))
    with pytest.raises(StepFailedError):
        engine.close()
