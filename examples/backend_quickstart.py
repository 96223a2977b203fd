"""A backend driven as an engine drives it: prefill two requests (EXTEND), verify a 4-token
draft tree per request (TARGET_VERIFY), check the output against attention written by hand.
Usage: python examples/backend_quickstart.py [BACKEND [DEVICE]]  (default: torch_reference cpu)
"""
import sys

import torch

from specattn.backends import (AttentionLayer, ForwardBatch, ForwardMode, KVAllocator,
                               MHATokenToKVPool, ReqToTokenPool, create_backend, pack_tree_mask)

name = sys.argv[1] if len(sys.argv) > 1 else "torch_reference"
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
torch.manual_seed(0)
layer = AttentionLayer.mha(layer_id=0, num_heads=8, num_kv_heads=2, head_dim=64)  # GQA 4:1
req_pool = ReqToTokenPool(size=4, max_context_len=64, device=device)
kv_pool = MHATokenToKVPool(size=256, page_size=1, dtype=torch.float32, head_num=2, head_dim=64,
                           layer_num=1, device=device)
allocator = KVAllocator(size=256, device=device)
backend = create_backend(name, req_pool, kv_pool)
rows, P, D = req_pool.alloc(2), [5, 3], 4  # request rows, prompt lengths, draft tokens


def forward(batch):  # random q/k/v for the batch's tokens; the backend writes k/v into the pool
    q, k, v = (torch.randn(batch.num_tokens, h, 64, device=device) for h in (8, 2, 2))
    backend.init_forward_metadata(batch)
    return q, backend.forward(q, k, v, layer, batch)


# 1. Prefill.  prefix_lens = KV committed BEFORE the forward; req_to_token gets the slots first.
slots = allocator.alloc(sum(P))
req_pool.write(rows[0], 0, slots[:P[0]])
req_pool.write(rows[1], 0, slots[P[0]:])
forward(ForwardBatch.extend(rows, prefix_lens=[0, 0], extend_lens=P, out_cache_loc=slots))

# 2. Verify a tree per request: root 0, its children 1 and 2, and 3 under 1.
sees = torch.eye(D, dtype=torch.bool, device=device)  # sees[j, m]: draft j attends to draft m
for j, parent in [(1, 0), (2, 0), (3, 1)]:
    sees[j] |= sees[parent]
slots = allocator.alloc(2 * D)
for i, r in enumerate(rows):
    req_pool.write(r, P[i], slots[i * D:(i + 1) * D])
assert backend.supports(ForwardMode.TARGET_VERIFY, graph=False, kind=layer.kind)
q, out = forward(ForwardBatch.fixed(
    ForwardMode.TARGET_VERIFY, rows, prefix_lens=P, num_tokens_per_req=D, out_cache_loc=slots,
    positions=torch.cat([p + sees.sum(1) - 1 for p in P]),          # prefix length + depth
    tree_mask=pack_tree_mask(sees).expand(2, D, 1).contiguous()))  # int32 [bs, D, words]

# 3. By hand: draft j of request i sees the whole prompt and its own ancestors.
K, V = kv_pool.get_key_buffer(0), kv_pool.get_value_buffer(0)
for i, r in enumerate(rows):
    for j in range(D):
        visible = torch.cat([torch.ones(P[i], dtype=torch.bool, device=device), sees[j]])
        keys = req_pool.req_to_token[r, :P[i] + D][visible].long()
        k, v = (x[keys].repeat_interleave(4, dim=1) for x in (K, V))  # 4 q heads per kv head
        probs = (torch.einsum("hd,khd->hk", q[i * D + j], k) * layer.scaling).softmax(-1)
        torch.testing.assert_close(out[i * D + j], torch.einsum("hk,khd->hd", probs, v))
print(f"{name} on {device}: TARGET_VERIFY output {tuple(out.shape)} matches attention by hand")
