"""Chapter 11's exercise checks accept answers worked out here by hand and reject near misses."""
from minillm import exercises


def test_keys():
    assert list(exercises.list_exercises("11")) == ["11.1", "11.2", "11.3", "11.4"]


def test_numeric_answers_by_hand():
    # 11.1: 80 layers x 2 all-reduces + the embedding's = 161 calls of 32 tokens x 8192 x 2 bytes
    assert exercises.check("11.1", 161 * 32 * 8192 * 2)
    assert not exercises.check("11.1", 160 * 32 * 8192 * 2)       # the embedding's forgotten
    assert not exercises.check("11.1", 161 * 32 * 8192 * 2 / 8)   # a shard, not the full sum
    # 11.2: 3 / (m + 3) < 0.1  <=>  m > 27
    assert exercises.check("11.2", 28)
    assert not exercises.check("11.2", 27)                      # exactly 10%: not below
    # 11.3: 2 (K, V) x 80 layers x 8 KV heads x 128 dims x 2 bytes x 2048 tokens, 8 bits a byte,
    # over 400e9 bits/s, in ms
    kv = 2 * 80 * 8 * 128 * 2 * 2048
    assert exercises.check("11.3", kv * 8 / 400e9 * 1e3)
    assert not exercises.check("11.3", kv / 400e9 * 1e3)                      # bytes as bits
    assert not exercises.check("11.3", 2 * 80 * 64 * 128 * 2 * 2048 * 8 / 400e9 * 1e3)   # all 64 heads


def _right(hkv, tp, rank):
    if hkv >= tp:
        n = hkv // tp
        return [rank * n + i for i in range(n)]
    return [rank * hkv // tp]


def test_code_exercise():
    assert exercises.check("11.4", _right)
    assert not exercises.check("11.4", lambda hkv, tp, rank: [rank % hkv])   # round robin
    assert not exercises.check("11.4", lambda hkv, tp, rank: list(range(hkv)))  # no split
    assert not exercises.check("11.4", lambda hkv, tp, rank: 1 / 0)
