"""Building, composing and switching sparsity patterns at run time, and FlexAttention interop.

python examples/02_patterns.py
"""

# %%
import torch

import sparse_attn
from sparse_attn import BlockSparseMask, patterns, reference

device = "cuda" if torch.cuda.is_available() and sparse_attn.cuda_kernels_available() else "cpu"
L = 2048
library = {
    "causal": patterns.causal(L, L, device=device),
    "sliding window 256": patterns.sliding_window(L, 256, device=device),
    "causal window 256": patterns.sliding_window(L, 256, causal=True, device=device),
    "dilated w=512 r=4": patterns.dilated(L, 512, 4, device=device),
    "dilated 2d seg=512 r=2": patterns.dilated_2d(L, 512, 2, device=device),
    "strided 128 / local 64": patterns.strided(L, 128, 64, device=device),
    "longformer w=128 + 8 global": patterns.longformer(L, 128, range(8), device=device),
    "bigbird w=128, 64 global, 2 random": patterns.bigbird(L, 128, 64, 2, seed=0, device=device),
    "random 10%": patterns.random_blocks(L, 0.10, seed=0, device=device),
}

# %% Every pattern is a BlockSparseMask: density, and exactness against the element-mask reference
q, k, v = (torch.randn(1, 4, L, 64, device=device) for _ in range(3))
for name, mask in library.items():
    out = sparse_attn.block_sparse_attention(q, k, v, mask)  # the pattern is switched per call
    ref = reference.block_sparse_attention(q, k, v, mask)[0]
    print(
        f"{name:<36} density {mask.density():6.3f}  partial blocks {mask.partial_masks.shape[0]:3d}  "
        f"max error {(out.double() - ref).abs().max().item():.1e}"
    )

# %% Composition: | is union, & is intersection (exact to the element)
local_causal = patterns.sliding_window(L, 256, device=device) & patterns.causal(L, L, device=device)
same = torch.equal(local_causal.to_dense(), library["causal window 256"].to_dense())
print("sliding_window & causal == causal sliding window:", same)

# %% FlexAttention interop in both directions
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 256) | (q_idx >= kv_idx)


flex_mask = create_block_mask(prefix_lm, None, None, L, L, device=device)
ours = BlockSparseMask.from_flex(flex_mask)
print(
    "from_flex: prefix-LM density",
    round(ours.density(), 3),
    "| round trip exact:",
    torch.equal(BlockSparseMask.from_flex(ours.to_flex_block_mask()).to_dense(), ours.to_dense()),
)
