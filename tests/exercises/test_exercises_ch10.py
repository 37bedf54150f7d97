"""Chapter 10's exercise checks accept right answers written here independently and reject
wrong or broken ones."""
import torch

from minillm import exercises


def test_all_four_are_registered():
    assert list(exercises.list_exercises("10")) == ["10.1", "10.2", "10.3", "10.4"]


def test_10_4_the_better_draft_by_hand():
    chain, tree = 1.12 / (1.15 + 0.05), 1.22 / (1.9 + 0.05)       # 0.933 and 0.626: both lose
    assert exercises.check("10.4", chain)
    assert not exercises.check("10.4", tree)                       # the slower of the two
    assert not exercises.check("10.4", 1.12 / 1.15)                # drafting left out
    assert not exercises.check("10.4", 1.22 / 1.9)                 # the tree, drafting left out


def _rule(p, kids):
    acc, r, reach = torch.zeros(len(kids), dtype=p.dtype), p.clone(), 1.0
    for j, x in enumerate(kids):
        acc[j] = reach * r[x]
        reach = reach * (1 - float(r[x]))
        if float(r[x]) >= 1.0:
            break
        r[x] = 0.0
        r = r / r.sum()
    return acc, r


def _no_renormalize(p, kids):
    acc, r, reach = torch.zeros(len(kids), dtype=p.dtype), p.clone(), 1.0
    for j, x in enumerate(kids):
        acc[j], reach = reach * float(r[x]), reach * (1 - float(r[x]))
        r[x] = 0.0
    return acc, r / r.sum()


def test_sibling_rule_check():
    assert exercises.check("10.1", _rule)
    assert not exercises.check("10.1", _no_renormalize)
    assert not exercises.check("10.1", lambda p, kids: (p[kids], p))
    assert not exercises.check("10.1", lambda p, kids: 1 / 0)


def _mask(parents):
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def test_mask_check():
    assert exercises.check("10.2", _mask)
    assert not exercises.check("10.2", lambda parents: torch.eye(len(parents), dtype=torch.bool))
    assert not exercises.check("10.2", lambda parents: torch.ones(len(parents), len(parents)).tril().bool())


def _tau(parents, depths, ranks, a):
    reach = [1.0] * len(parents)
    for i in range(1, len(parents)):
        reach[i] = reach[parents[i]] * a(depths[i], ranks[i])
    return sum(reach)


def test_tau_check():
    assert exercises.check("10.3", _tau)
    assert not exercises.check("10.3", lambda p, d, r, a: _tau(p, d, r, a) - 1)      # no own token
    assert not exercises.check("10.3", lambda p, d, r, a: 1 + sum(a(d[i], r[i]) for i in range(1, len(p))))
