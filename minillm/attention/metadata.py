"""Per-step attention metadata for the paged KV cache: built once per forward pass, read by
every layer (`paged.py` defines the layout and the attention that uses it).

`PagedAttentionMetadata` turns the per-sequence query lengths, context lengths and block tables of
one step into index tensors: `slot_mapping` (where each new token's K/V goes) and, per group of
sequences attended together (the decodes, the prefill chunks), the slots to gather, the mask
(made once per step, as the 0 / -inf tensor SDPA would otherwise rebuild in every layer) and the
indices that move a padded group's queries and outputs to and from the flattened batch.
Letters as in `paged.py`.

Token trees (`tree_parents`): a sequence verifying a tree of T nodes (speculative decoding) has
node i's K/V in slot S - T + i and its parent in `parents[i]` (parents[0] = -1: the root, the
last emitted token). Its query i sees the S - T slots before the tree and, within the tree, only
itself and its ancestors: the causal block of its rows in the mask is replaced by the tree's
ancestor mask. The mask lives here, in the step's metadata, so every layer (and a compiled
step's opaque attention op) reads it without a tensor inside the graph. vLLM keeps one static
tree's bias in its metadata; here each sequence brings its own (dynamic drafters differ).
"""
from array import array

import torch


def long_tensor(values, device=None) -> torch.Tensor:
    """A flat list of ints -> int64 tensor (len,), several times faster than `torch.tensor(list)`
    (which inspects every element for its type): the runner builds a few of these every step."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(array("q", values), dtype=torch.long).to(device)


def check_tree_parents(tree_parents, query_lens) -> list:
    """None or one entry per sequence: None (causal) or parents (T,) with parents[0] = -1 and
    0 <= parents[i] < i, T = that sequence's query length. -> a list (None entries kept)."""
    if tree_parents is None:
        return [None] * len(query_lens)
    if len(tree_parents) != len(query_lens):
        raise ValueError(f"tree_parents must have one entry per sequence ({len(query_lens)}), "
                         f"got {len(tree_parents)}")
    for i, (par, t) in enumerate(zip(tree_parents, query_lens)):
        if par is None:
            continue
        if len(par) != t or par[0] != -1 or any(not 0 <= par[j] < j for j in range(1, t)):
            raise ValueError(f"tree_parents[{i}] must have query_len = {t} entries, parents[0] = "
                             f"-1 and 0 <= parents[j] < j, got {list(par)}")
    return list(tree_parents)


def ancestor_mask(parents) -> torch.Tensor:
    """(T, T) bool: [i, j] True when node j is node i or one of its ancestors."""
    T = len(parents)
    mask = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):                    # a parent's row is complete before its children's
        mask[i] |= mask[parents[i]]
    return mask


class _Group:
    """Index tensors for a set of sequences attended together (padded to Tg queries, Sg keys).

    Built once per step on the CPU from plain lists (a dozen small tensor ops), moved to the
    device once, and read by every layer."""

    def __init__(self, seqs, starts, query_lens, context_lens, tables, block_size, device,
                 whole: bool = False, trees=None):
        B, P = len(seqs), block_size
        qlens, ctxs = [query_lens[i] for i in seqs], [context_lens[i] for i in seqs]
        Tg, Sg = max(qlens), max(ctxs)
        nb = -(-Sg // P)                          # blocks the longest row reads
        rows = [tables[i][:nb] for i in seqs]
        table = long_tensor([b for r in rows for b in r + r[:1] * (nb - len(r))]).view(B, nb)
        s = long_tensor(ctxs)[:, None]                                         # (B, 1)
        j, t = torch.arange(Sg), torch.arange(Tg)                              # (Sg,), (Tg,)
        q = long_tensor(qlens)[:, None]                                        # (B, 1)
        slots = (table[:, :, None] * P + torch.arange(P)).view(B, nb * P)[:, :Sg]  # (B, Sg)
        # padding keys read the row's own first token (always written, so never NaN garbage)
        slots = torch.where(j < s, slots, slots[:, :1])
        self.kv_slots = slots.reshape(-1).to(device)                           # (B*Sg,)
        if Tg == 1:                               # decodes: the one query sees its S keys
            mask = (j < s)[:, None, None]                                      # (B, 1, 1, Sg)
        else:  # query t of a row sits at position S - T + t; padded rows repeat the last one
            qpos = torch.minimum(s - q + t, s - 1)                             # (B, Tg)
            mask = (j <= qpos[..., None])[:, None]                             # (B, 1, Tg, Sg)
            for b, i in enumerate(seqs):          # a token tree: ancestors only, within the tree
                if trees is not None and trees[i] is not None:
                    T, S = qlens[b], ctxs[b]
                    mask[b, 0, :T, S - T:S] = ancestor_mask(trees[i])         # (T, T)
        # every query sees every key (batch-1 decode, equal lengths): SDPA needs no mask at all
        self.mask = None if Tg == 1 and min(ctxs) == Sg else mask.to(device)
        self._additive = {}                                # dtype -> the mask as 0 / -inf
        # `whole`: this group is the batch itself, in order, unpadded (B*Tg == M): queries are a
        # view of q and the output is a view of the result, so no index tensors are needed
        self.whole = whole
        if not whole:
            start = long_tensor([starts[i] for i in seqs])[:, None]            # (B, 1)
            self.q_index = (start + torch.minimum(t, q - 1)).to(device)        # (B, Tg)
            valid = t < q                                                      # (B, Tg)
            self.src = valid.reshape(-1).nonzero().squeeze(1).to(device)       # rows of (B*Tg)
            self.dst = (start + t).masked_select(valid).to(device)             # flat token ids
        self.shape = (B, Tg, Sg)

    def additive_mask(self, dtype):
        """The mask as 0 (seen) / -inf (hidden) in the queries' dtype, made once per step: a
        boolean mask would be converted inside SDPA again in every layer."""
        if self.mask is None:
            return None
        if dtype not in self._additive:
            zeros = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._additive[dtype] = zeros.masked_fill(~self.mask, float("-inf"))
        return self._additive[dtype]


class PagedAttentionMetadata:
    """Per-step attention metadata, built once and shared by every layer.

    query_lens[i]: new tokens of sequence i in this pass (T_i >= 1), in flattened order.
    context_lens[i]: tokens of sequence i that attention sees, the new ones included (S_i >= T_i).
    block_tables[i]: physical block ids of sequence i, at least ceil(S_i / P) of them.
    tree_parents: None, or per sequence None or the parents of its T_i new tokens, a token tree
    (see the module docstring).
    """

    def __init__(self, query_lens, context_lens, block_tables, block_size: int, device=None,
                 tree_parents=None):
        if not (len(query_lens) == len(context_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, context_lens and block_tables must be non-empty lists "
                             f"of one length, got {len(query_lens)}, {len(context_lens)}, "
                             f"{len(block_tables)}")
        for i, (t, s, tab) in enumerate(zip(query_lens, context_lens, block_tables)):
            if not 1 <= t <= s:
                raise ValueError(f"sequence {i}: need 1 <= query_len <= context_len, got {t}, {s}")
            if len(tab) * block_size < s:
                raise ValueError(f"sequence {i}: block table of {len(tab)} blocks x {block_size} "
                                 f"cannot hold context_len {s}")
        trees = check_tree_parents(tree_parents, query_lens)
        self.tree_parents = trees if any(t is not None for t in trees) else None
        self.block_size = block_size
        self.query_lens, self.context_lens = list(query_lens), list(context_lens)
        self.num_tokens = sum(query_lens)
        starts, slots, acc = [], [], 0
        for t, s, tab in zip(query_lens, context_lens, block_tables):
            starts.append(acc)
            acc += t
            slots += [tab[p // block_size] * block_size + p % block_size for p in range(s - t, s)]
        self.slot_mapping = long_tensor(slots, device)                        # (M,)
        decode = [i for i, t in enumerate(query_lens) if t == 1]
        prefill = [i for i, t in enumerate(query_lens) if t > 1]
        # one group of equal query lengths (all decodes; one prefill chunk) is the batch in order
        whole = len(set(query_lens)) == 1
        self.groups = [_Group(g, starts, query_lens, context_lens, block_tables, block_size, device,
                              whole, self.tree_parents) for g in (decode, prefill) if g]
