import os
import sys

# Triton kernels run on CPU through the interpreter; it must be set before anything imports triton.
os.environ.setdefault('TRITON_INTERPRET', '1')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# pytest-xdist (pytest.ini): one thread per worker and per run it starts
if os.environ.get('PYTEST_XDIST_WORKER'):
    os.environ['OMP_NUM_THREADS'] = '1'
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)  # CI machines have 2 cores; more threads only contend


def pytest_collection_modifyitems(items):
    """The tests marked slow first, the rest in their order: pytest-xdist deals the list out in
    order, and a minute-long test dealt last runs alone after the other worker has finished."""
    items.sort(key=lambda item: item.get_closest_marker('slow') is None)
