"""How many elements attention moves between main memory (HBM) and on-chip memory (SRAM) of M
elements, counted by walking the loops, beside the closed forms (Dao et al. 2022, section 3.2).

Units: elements; N the sequence length (T = S = N), d the head dim, one head, no causal mask. Each
walk counts every tile load and store; `*_formula` is the closed form, and the tests compare them.
- Standard attention (Algorithm 0): S and P written out and read back; each matmul reads its
  operands once: Theta(N d + N^2).
- FlashAttention (Algorithm 1): B_c = ceil(M / 4d) keys and B_r = min(B_c, d) queries per tile,
  key/value tiles outer: Theta(N^2 d^2 / M).
- FlashAttention-2's query-outer order (what `tiled.py` runs): each query tile loaded and stored
  once, every key/value tile once per query tile: again Theta(N^2 d^2 / M), a smaller constant.
The reads fall by a factor ~M / d^2, not to O(N); what drops from O(N^2) to O(N) is the extra
memory: no N x N matrix is stored.

Left out on purpose: the backward pass, causal tile skipping (which halves the tiled counts), and
caches between SRAM and HBM.
"""
from dataclasses import dataclass

from minillm._validate import check_int


@dataclass(frozen=True)
class IOCount:
    reads: int          # elements loaded from main memory
    writes: int         # elements stored to main memory

    @property
    def total(self) -> int:
        return self.reads + self.writes


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _check(N, d, M=None):
    check_int("N", N, low=1)
    check_int("d", d, low=1)
    if M is not None:
        check_int("M", M, low=4 * d)    # a tile must hold at least one row of Q, K, V and O


def flash_block_sizes(d: int, M: int) -> tuple[int, int]:
    """(B_r, B_c): the tile sizes FlashAttention derives from an on-chip memory of M elements."""
    _check(1, d, M)
    B_c = _ceil(M, 4 * d)
    return min(B_c, d), B_c


def _row_tiles(N: int, b: int):
    """Sizes of the tiles of b rows that cover N rows (the last one may be short)."""
    return [min(b, N - i) for i in range(0, N, b)]


def io_standard(N: int, d: int) -> IOCount:
    """Walk standard attention's three passes over row tiles of Q (tile size does not matter)."""
    _check(N, d)
    reads = writes = 0
    reads += 2 * N * d                       # pass 1: Q and K, each read once
    for rows in _row_tiles(N, d):
        writes += rows * N                   #   S_i = Q_i K^T stored
    for rows in _row_tiles(N, d):            # pass 2: softmax, row by row
        reads, writes = reads + rows * N, writes + rows * N          # read S_i, store P_i
    reads += N * d                           # pass 3: V read once
    for rows in _row_tiles(N, d):
        reads, writes = reads + rows * N, writes + rows * d          # read P_i, store O_i
    return IOCount(reads, writes)


def io_standard_formula(N: int, d: int) -> IOCount:
    return IOCount(reads=3 * N * d + 2 * N * N, writes=2 * N * N + N * d)


def io_flash(N: int, d: int, M: int) -> IOCount:
    """Walk Algorithm 1 of FlashAttention: key/value tiles outer, query tiles inner."""
    _check(N, d, M)
    B_r, B_c = flash_block_sizes(d, M)
    reads = writes = 0
    for cols in _row_tiles(N, B_c):
        reads += 2 * cols * d                            # K_j, V_j: loaded once each
        for rows in _row_tiles(N, B_r):
            reads += 2 * rows * d + 2 * rows             # Q_i, O_i, l_i, m_i
            writes += rows * d + 2 * rows                # O_i, l_i, m_i
    return IOCount(reads, writes)


def io_flash_formula(N: int, d: int, M: int) -> IOCount:
    """2 N d + T_c N (2d + 2) reads and T_c N (d + 2) writes, T_c = ceil(N / B_c)."""
    T_c = _ceil(N, flash_block_sizes(d, M)[1])
    return IOCount(reads=2 * N * d + T_c * N * (2 * d + 2), writes=T_c * N * (d + 2))


def io_flash_query_outer(N: int, d: int, M: int) -> IOCount:
    """Walk the query-outer order (FlashAttention-2, `tiled.py`) with query tiles of ceil(M / 4d)
    rows and key tiles of min(ceil(M / 4d), d) rows; the running m, l, O stay on chip."""
    _check(N, d, M)
    B_k, B_q = flash_block_sizes(d, M)
    reads = writes = 0
    for rows in _row_tiles(N, B_q):
        reads += rows * d                                # Q_i, once
        for cols in _row_tiles(N, B_k):
            reads += 2 * cols * d                        # K_j, V_j, once per query tile
        writes += rows * d + rows                        # O_i and its log-sum-exp, once
    return IOCount(reads, writes)


def io_flash_query_outer_formula(N: int, d: int, M: int) -> IOCount:
    """N d + 2 N d T_q reads and N (d + 1) writes, T_q = ceil(N / ceil(M / 4d))."""
    T_q = _ceil(N, flash_block_sizes(d, M)[1])
    return IOCount(reads=N * d + 2 * N * d * T_q, writes=N * (d + 1))
