"""Shared by the AsyncIOHandle tests (test_aio_*.py): sizes, a tensor's bytes, random bytes, and the
``backend`` (every backend, forced through the env var) and ``handle`` fixtures, which the test
files import by name."""
import pytest
import torch

from zeroinf.io import AsyncIOHandle
from zeroinf.io import backends as io_backends


MiB = 1 << 20
BACKENDS = list(io_backends.BACKENDS)


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _rand_bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Force each backend through the env var, as users would."""
    why = io_backends.backend_reasons(request.param)
    if why:
        pytest.skip(f"backend {request.param} unavailable: {'; '.join(why)}")
    monkeypatch.setenv("ZEROINF_AIO_BACKEND", request.param)
    return request.param


@pytest.fixture
def handle(backend):
    h = AsyncIOHandle(block_size=256 * 1024, queue_depth=4)
    assert h.backend == backend
    yield h
    h.close()
