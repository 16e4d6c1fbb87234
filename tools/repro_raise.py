"""A rejected argument must raise a Python exception, not crash (see PERF_LOG/notes)."""

import torch

import sparse_attn  # noqa: F401  (registers the ops)

k = torch.randn(1, 1, 64, 64)
try:
    torch.ops.sparse_attn.flash_fwd(torch.randn(64), k, k, None, False, -1, -1)
except RuntimeError as e:
    print("raised OK:", str(e).splitlines()[0])
