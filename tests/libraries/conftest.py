import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: on a shared two-core machine torch's second thread waits for a core (50 ms a batch norm)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
