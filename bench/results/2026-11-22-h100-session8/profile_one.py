"""One launch of the default ping-pong tree-verify kernel at bs 16 / P 2048 (for a profiler;
``explore_tree_verify.make`` inputs), after one warm-up launch."""
import torch

import specattn.triton_kernels.attention as A
from explore_tree_verify import make

a = make(16, 2048)
q, k, v, rtt, rpi, seq, qo, tm, n = a
for _ in range(2):
    A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, 1, sm90=True, check_bounds=False)
torch.cuda.synchronize()
