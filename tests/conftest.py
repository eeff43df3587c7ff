import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_report_header(config):
    return f"torch {torch.__version__}, threads {torch.get_num_threads()}, ZEROINF_CACHE={os.environ.get('ZEROINF_CACHE', '(default)')}"
