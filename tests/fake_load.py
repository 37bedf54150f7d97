"""A machine's CPU counters played back, so that what `load_now` says is known in advance.

`fake_load(monkeypatch, others=..., cores=...)` replaces `minillm.kernels.load_now.counters`:
every reading advances a clock by one second, during which other work used `state["others"]`
cores and this process `own` cores; `load_now` no longer sleeps. Change `state["others"]`
to make the machine busy from the next reading on.
"""
from minillm.kernels import load_now as ln


def fake_load(monkeypatch, others: float = 0.0, cores: int = 64, own: float = 1.0, steal: float = 0.0) -> dict:
    state = {"others": others, "own": own, "steal": steal, "t": 0.0, "busy": 0.0, "own_s": 0.0,
             "steal_s": 0.0, "readings": 0}

    def counters(exclude=()):
        state["t"] += 1.0
        state["busy"] += state["others"] + state["own"]
        state["own_s"] += state["own"]
        state["steal_s"] += state["steal"]
        state["readings"] += 1
        return state["busy"], state["steal_s"], state["own_s"], 0.0, state["t"]
    monkeypatch.setattr(ln, "counters", counters)
    monkeypatch.setattr(ln, "cores", lambda: list(range(cores)))
    monkeypatch.setattr(ln, "_sleep", lambda s: None)
    return state
