import pytest
import torch

import sparse_attn

HAS_CUDA = torch.cuda.is_available() and sparse_attn.cuda_kernels_available()


def pytest_configure(config):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of sparse_attn")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    # A test taking `device` runs on the CPU, and on CUDA (marked `cuda`) when available.
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)], scope="function"
        )
