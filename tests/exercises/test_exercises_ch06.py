"""Chapter 6's exercise checks accept the right answer (computed here independently, by brute
force) and reject a wrong one or a broken implementation."""
import json

import torch

from minillm import exercises, tiny_model
from minillm.analysis import spec_theory as th
from minillm.lab.spec_replay import schedule_file
from minillm.exercises import ch06

F64 = torch.float64


def test_all_six_are_registered():
    assert list(exercises.list_exercises("06")) == [f"06.{i}" for i in range(1, 7)]


def test_residual_check():
    good = lambda p, q: (p - q).clamp(min=0) / (p - q).clamp(min=0).sum().clamp(min=1e-300)
    assert exercises.check("06.1", good)
    assert not exercises.check("06.1", lambda p, q: p)                   # the tempting shortcut
    assert not exercises.check("06.1", lambda p, q: (p - q).abs() / (p - q).abs().sum())
    assert not exercises.check("06.1", lambda p, q: 1 / 0)                # raising is wrong, no crash


@torch.no_grad()
def _alpha_by_hand() -> float:
    s = ch06.TV_SETUP
    t = tiny_model(vocab_size=64, seed=s["target_seed"], dtype=F64)
    d = tiny_model(vocab_size=64, seed=s["draft_seed"], dtype=F64)
    x = torch.tensor([s["token_ids"]])
    total, n = 0.0, 0
    for pos in range(s["start"], len(s["token_ids"])):                 # law after token_ids[:pos]
        p = torch.softmax(t(x[:, :pos])[0, -1] / s["temperature"], -1)  # no cache: the plain forward
        q = torch.softmax(d(x[:, :pos])[0, -1] / s["temperature"], -1)
        total += float((q * torch.where(q > 0, p / q, torch.ones_like(p)).clamp(max=1)).sum())
        n += 1
    return total / n


def test_alpha_check():
    a = _alpha_by_hand()
    assert exercises.check("06.2", a)
    assert not exercises.check("06.2", a * 1.01)
    assert not exercises.check("06.2", float("nan"))


def _recorded_schedule(name: str, k: int):
    """Greedy prompt lookup by brute force: at each step, the longest tail (3 then 2 tokens) of the
    context seen earlier, most recent occurrence, proposes what followed (up to k tokens)."""
    rec = json.loads(schedule_file().read_text())["prompts"][name]
    prompt, out = rec["prompt"], rec["output"]
    proposed, accepted, done = [], [], 0
    while done < len(out):
        ctx, kk, cand = prompt + out[:done], min(k, len(out) - done - 1), []
        for n in (3, 2):
            tail = ctx[-n:]
            starts = [i for i in range(len(ctx) - n) if ctx[i:i + n] == tail]
            if starts and kk:
                cand = ctx[starts[-1] + n:starts[-1] + n + kk]
                break
        m = 0
        while m < len(cand) and cand[m] == out[done + m]:
            m += 1
        proposed.append(len(cand))
        accepted.append(m)
        done += m + 1
    return len(out), proposed, accepted


def test_best_k_check():
    _, prop, acc = _recorded_schedule(ch06.BEST_K_SETUP["prompt"], 8)
    tested = sum(n + (n < k) for n, k in zip(acc, prop))
    a = sum(acc) / tested
    c, v = ch06.BEST_K_SETUP["c"], ch06.BEST_K_SETUP["verify_cost"]
    speed = {k: sum(a ** i for i in range(k + 1)) / (k * c + v) for k in range(1, 17)}
    best = max(speed, key=speed.get)
    assert exercises.check("06.3", best)
    assert not exercises.check("06.3", best + 1)


def test_ceiling_check():
    num = den = 0
    for name in ("summarize", "rewrite", "extract", "code_edit"):
        n, prop, _ = _recorded_schedule(name, ch06.CEILING_K)
        num, den = num + n - 1, den + len(prop)
    assert exercises.check("06.4", num / den)
    assert not exercises.check("06.4", (num + 4) / den)                 # tokens / steps: not a speedup


class _Reactive:
    """Grow K after a fully accepted step, fall to 1 after a rejection."""
    def __init__(self):
        self.k = 2

    def update(self, num_accepted, num_proposed):
        self.k = min(8, self.k + 2) if num_accepted == num_proposed else 1


def test_policy_check():
    assert exercises.check("06.5", _Reactive)
    assert not exercises.check("06.5", lambda: th.FixedK(4))
    assert not exercises.check("06.5", lambda: th.FixedK(1))


def test_accepted_fraction_check():
    scheds = [_recorded_schedule(name, 8) for name in ("summarize", "rewrite", "extract", "code_edit")]
    accepted, drafted = sum(sum(a) for _, _, a in scheds), sum(sum(p) for _, p, _ in scheds)
    assert exercises.check("06.6", accepted / drafted)
    tested = sum(n + (n < k) for _, p, a in scheds for n, k in zip(a, p))
    assert not exercises.check("06.6", accepted / tested)              # that is alpha, not the fraction
    mean = sum(sum(a) / sum(p) for _, p, a in scheds) / 4
    assert not exercises.check("06.6", mean)                           # the mean of four fractions
