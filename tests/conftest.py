import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_mode_left_on():
    """Fail the test after which a stage-3 forward's torch-function mode or saved-tensor hooks
    stay on process-wide (a failed read in a root pre-hook left them on once, and a later test
    saw them)."""
    from torch.overrides import _get_current_function_mode_stack
    yield
    modes = _get_current_function_mode_stack()
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    for m in modes:  # leave the next test a clean process either way
        m.__exit__(None, None, None)
    assert not modes and hooks is None, f"left on after the test: modes {modes}, saved-tensor hooks {hooks}"


def pytest_report_header(config):
    return f"torch {torch.__version__}, threads {torch.get_num_threads()}, ZEROINF_CACHE={os.environ.get('ZEROINF_CACHE', '(default)')}"
