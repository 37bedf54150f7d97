"""Token trees in the paged attention path (attention/metadata.py `tree_parents`, the paged
cache's `prepare` and `move_slots`) against trusted references.

- attention alone: random pools, a ragged step mixing a tree verify, a prefill chunk and decodes;
  each query against plain matmul + softmax with the explicit mask written out here (context,
  then the node itself and its ancestors);
- a tiny float64 model: the paged pass over a cached context, the tree's nodes at positions
  "root + depth", gives every node the logits of a plain forward over context + its root-to-node
  path (each path run as a chain, no cache), with a prefill chunk and a decode in the same step;
- `move_slots` leaves the cache holding, at the path's positions, the K/V a plain forward over
  context + path writes (a cache-free reference, `KVCache`);
- bad tree_parents: ValueError naming the argument.
"""
import pytest
import torch

from minillm import tiny_model
from minillm.attention.metadata import PagedAttentionMetadata
from minillm.attention.paged import attend_slot_rows
from minillm.model.kv_cache import KVCache
from minillm.paging.paged_cache import PagedKVCache

F64 = torch.float64
PARENTS = [-1, 0, 0, 1, 1, 2, 3]              # 7 nodes, depths 0 1 1 2 2 2 3
pytestmark = pytest.mark.usefixtures("one_thread")


def depths(parents):
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def path_to(parents, i):
    out = [i]
    while out[-1] != 0:
        out.append(parents[out[-1]])
    return out[::-1]


def test_attention_with_a_tree_mask_equals_the_explicit_mask():
    g = torch.Generator().manual_seed(0)
    P, Hkv, H, D = 4, 2, 4, 8
    qlens, ctxs = [len(PARENTS), 5, 1, 1], [13, 9, 6, 11]      # tree, chunk, two decodes
    tables = [[3, 0, 7, 9], [1, 4, 6], [2, 8], [5, 10, 11]]
    trees = [PARENTS, None, None, None]
    k_slots = torch.randn(12 * P, Hkv * D, dtype=F64, generator=g)
    v_slots = torch.randn(12 * P, Hkv * D, dtype=F64, generator=g)
    q = torch.randn(sum(qlens), H, D, dtype=F64, generator=g)
    meta = PagedAttentionMetadata(qlens, ctxs, tables, P, tree_parents=trees)
    out = attend_slot_rows(q, k_slots, v_slots, Hkv, meta)                 # (M, H, D)
    at = 0
    for T, S, tab, tree in zip(qlens, ctxs, tables, trees):
        slots = [tab[p // P] * P + p % P for p in range(S)]
        k = k_slots[slots].view(S, Hkv, D).repeat_interleave(H // Hkv, 1)   # (S, H, D)
        v = v_slots[slots].view(S, Hkv, D).repeat_interleave(H // Hkv, 1)
        for t in range(T):
            seen = [j < S - T or (j - (S - T) in path_to(tree, t) if tree else j <= S - T + t)
                    for j in range(S)]
            scores = torch.einsum("hd,shd->hs", q[at + t], k) / D ** 0.5   # (H, S)
            scores[:, ~torch.tensor(seen)] = float("-inf")
            ref = torch.einsum("hs,shd->hd", torch.softmax(scores, -1), v)  # (H, D)
            torch.testing.assert_close(out[at + t], ref, atol=1e-12, rtol=0)
        at += T


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=64, seed=0, dtype=F64)


def _forward(model, cache, seqs):
    """seqs: (new tokens, positions, context_len, table, parents or None) -> logits (M, V)."""
    ids = [t for s in seqs for t in s[0]]
    pos = [p for s in seqs for p in s[1]]
    cache.prepare([len(s[0]) for s in seqs], [s[2] for s in seqs], [s[3] for s in seqs],
                  [s[4] for s in seqs])
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.tensor(pos), cache)[0]


@torch.inference_mode()
def test_tree_logits_equal_each_path_run_as_a_chain(model):
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(64, (9,), generator=g).tolist()          # the context; its last = the root
    other = torch.randint(64, (6,), generator=g).tolist()        # a prompt chunked beside the tree
    dec = torch.randint(64, (5,), generator=g).tolist()          # a decode beside it
    nodes = [ctx[-1]] + torch.randint(64, (len(PARENTS) - 1,), generator=g).tolist()
    cache = PagedKVCache(model.config, 16, 4, dtype=F64)
    ta, tb, tc = [0, 1, 2, 3], [4, 5, 6], [7, 8]
    S = len(ctx) - 1                                              # cached before the tree
    _forward(model, cache, [(ctx[:-1], list(range(S)), S, ta, None),
                            (dec[:-1], list(range(4)), 4, tc, None)])
    tree_pos = [S + d for d in depths(PARENTS)]
    logits = _forward(model, cache, [(nodes, tree_pos, S + len(nodes), ta, PARENTS),
                                     (other[:4], list(range(4)), 4, tb, None),
                                     (dec[-1:], [4], 5, tc, None)])
    for i in range(len(PARENTS)):
        chain = ctx[:-1] + [nodes[j] for j in path_to(PARENTS, i)]
        ref = model(torch.tensor([chain]))[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=1e-10, rtol=0)
    n = len(nodes)
    torch.testing.assert_close(logits[n + 3], model(torch.tensor([other[:4]]))[0, -1],
                               atol=1e-10, rtol=0)
    torch.testing.assert_close(logits[n + 4], model(torch.tensor([dec]))[0, -1], atol=1e-10, rtol=0)

    # keep the path to node 6 (0 -> 1 -> 3 -> 6): its K/V moves to slots S, S+1, S+2, S+3
    path = path_to(PARENTS, 6)
    slot = [ta[p // 4] * 4 + p % 4 for p in range(S + len(nodes))]
    cache.move_slots([slot[S + i] for i in path], [slot[S + j] for j in range(len(path))])
    ref_cache = KVCache(model.config, 1, 32, dtype=F64)
    chain = ctx[:-1] + [nodes[i] for i in path]
    model(torch.tensor([chain]), torch.arange(len(chain)), ref_cache)
    L, Hkv, D = model.config.n_layer, model.config.n_kv_head, model.config.head_dim
    got = cache.k.view(L, -1, Hkv, D)[:, slot[:len(chain)]]                # (L, S', Hkv, D)
    want = ref_cache.k[:, 0, :, :len(chain)].transpose(1, 2)                # (L, S', Hkv, D)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    got_v = cache.v.view(L, -1, Hkv, D)[:, slot[:len(chain)]]
    torch.testing.assert_close(got_v, ref_cache.v[:, 0, :, :len(chain)].transpose(1, 2),
                               atol=1e-10, rtol=0)


@pytest.mark.parametrize("trees, match", [
    ([[-1, 0]], "one entry per sequence"),
    ([[-1, 0], None], "query_len = 3 entries"),
    ([[0, 0, 1], None], r"parents\[0\] =\s+-1"),
    ([[-1, 0, 2], None], "0 <= parents"),
])
def test_bad_tree_parents_are_refused(trees, match):
    with pytest.raises(ValueError, match="tree_parents"):
        PagedAttentionMetadata([3, 1], [5, 2], [[0, 1], [2]], 4, tree_parents=trees)
    with pytest.raises(ValueError, match=match):
        PagedAttentionMetadata([3, 1], [5, 2], [[0, 1], [2]], 4, tree_parents=trees)
