"""Compiled engine steps (kernels/compiled_steps.py) against trusted references.

A float64 tiny model (ties cannot flip) is compiled once per process for sizes 1, 4, 8 (inductor's
default mode, seconds); every engine below shares those graphs. Each request's greedy output must
equal `minillm.generate` run alone, over chunked prefill, preemption both ways, prefix caching,
static batching, n-gram speculation and token trees, with steps really run compiled and padded; seeded
sampling with n > 1 equals the eager engine's. Timing decides nothing here (`keep="agreeing"`,
or saved verdicts written by the test). A background compile runs in a child process while the
engine serves eager, and its steps, once adopted, give generate's tokens.
"""
import json
import os
import random
import sys
import threading

import pytest
import torch

from minillm import generate, tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.kernels import compiled_steps as cs

SIZES = (1, 4, 8)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=256, seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def cc(tmp_path_factory):
    return cs.CompilationConfig(compile_sizes=SIZES, mode="default", keep="agreeing", rounds=1,
                                cache_dir=str(tmp_path_factory.mktemp("inductor")))


@pytest.fixture(scope="module")
def workload(model):
    rng = random.Random(0)
    prompts = [[7, 8, 9, 10, 11, 12] + [rng.randrange(256) for _ in range(rng.randint(1, 30))]
               for _ in range(8)]
    max_tokens = [rng.randint(1, 20) for _ in prompts]
    return prompts, max_tokens, [generate(model, p, k) for p, k in zip(prompts, max_tokens)]


CONFIGS = {
    "chunk8": dict(block_size=3, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=8),
    "preempt_recompute": dict(block_size=16, num_blocks=6, max_num_seqs=64, max_num_batched_tokens=64),
    "preempt_swap": dict(block_size=3, num_blocks=20, max_num_seqs=32, max_num_batched_tokens=32,
                         preemption_mode="swap"),
    "prefix_cache": dict(block_size=3, num_blocks=60, max_num_seqs=8, max_num_batched_tokens=16,
                         enable_prefix_caching=True),
    "static": dict(block_size=3, num_blocks=200, max_num_seqs=3, max_num_batched_tokens=64,
                   scheduling="static"),
    "ngram_spec": dict(block_size=4, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=32,
                       num_speculative_tokens=3, speculative_method="ngram"),
}


def _counting(engine) -> list:
    """(padded size, rows) of each step that ran compiled."""
    sizes, steps = [], engine.runner.compiled
    real = steps.run

    def run(input_ids, positions, cache, rows, *args, **kw):
        sizes.append((input_ids.shape[1], rows))
        return real(input_ids, positions, cache, rows, *args, **kw)
    steps.run = run
    return sizes


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_generate_alone(model, cc, workload, name):
    prompts, max_tokens, refs = workload
    engine = LLMEngine(model, EngineConfig(**CONFIGS[name], compilation_config=cc))
    assert engine.runner.compiled is not None and engine.runner.compiled.kept == SIZES
    sizes = _counting(engine)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref
    assert engine.num_free_blocks == engine.num_blocks
    assert sizes and {s for s, _ in sizes} <= set(SIZES)            # compiled steps really ran
    assert any(rows < size for size, rows in sizes)                   # some of them padded
    if "preempt" in name:
        assert engine.scheduler.num_preemptions > 0
    if name == "prefix_cache":
        assert engine.block_manager.stats["hit_blocks"] > 0


def test_token_trees_run_compiled_with_their_mask_in_the_metadata(model, cc, workload):
    """Tree verify rows padded to a compiled size: the tree mask rides in the cache's metadata,
    which the graph's opaque attention op reads, so greedy still equals generate alone."""
    from tree_drafters import TreeDrafter
    prompts, max_tokens, refs = workload
    drafter = TreeDrafter(model, needs_features=False)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=200, max_num_seqs=2,
                                           max_num_batched_tokens=16, compilation_config=cc),
                       speculative_config={"method": "medusa", "num_speculative_tokens": 2,
                                           "model": drafter,
                                           "speculative_token_tree": [(0,), (1,), (0, 0)]})
    engine.spec.switch.probe_steps = 10**9                          # every verify a tree
    sizes = _counting(engine)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    assert [o.token_ids for o in outs] == refs and engine.num_free_blocks == engine.num_blocks
    assert drafter.trees > 0 and engine.spec.switch.kept.get((1, 1), 0) > 0
    assert any(rows < size == 8 for size, rows in sizes)           # tree steps padded to 8


def test_seeded_sampling_with_n_equals_the_eager_engine(model, cc, workload):
    prompts, _, _ = workload
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, n=2, seed=i)
              for i in range(len(prompts))]
    base = dict(block_size=4, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=16)
    eager = LLMEngine(model, EngineConfig(**base)).generate(prompts, params)
    engine = LLMEngine(model, EngineConfig(**base, compilation_config=cc))
    sizes = _counting(engine)
    compiled = engine.generate(prompts, params)
    assert sizes
    for a, b in zip(eager, compiled):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_the_summary_says_what_was_kept(model, cc):
    from minillm.paging.paged_cache import PagedKVCache
    steps = cs.compiled_steps_for(model, cc, lambda n, p: PagedKVCache(model.config, n, p,
                                                                       dtype=model.dtype))
    line = steps.summary()
    assert "kept 1 (" in line and "8 (" in line and "steps over 8 rows run eager" in line
    assert [t.size for t in steps.timings] == list(SIZES)
    assert all(t.tokens_equal and t.max_abs_diff < 1e-9 for t in steps.timings)
    assert steps.padded(3) == 4 and steps.padded(8) == 8 and steps.padded(9) is None


def test_a_failing_compiler_runs_eager_with_one_line(model, workload, monkeypatch, tmp_path):
    lines = []
    monkeypatch.setattr(cs, "notice", lines.append)
    monkeypatch.setattr(cs.CompiledSteps, "_build",
                        lambda self, *a: (_ for _ in ()).throw(RuntimeError("no C++ compiler")))
    cfg = cs.CompilationConfig(compile_sizes=(1, 2), mode="default", rounds=1, cache_dir=str(tmp_path))
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, compilation_config=cfg))
    assert engine.runner.compiled is None
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "eager" in lines[0]
    prompts, max_tokens, refs = workload
    outs = engine.generate(prompts[:2], [SamplingParams(max_tokens=k) for k in max_tokens[:2]])
    assert [o.token_ids for o in outs] == refs[:2]


def test_a_later_process_loads_the_packages_and_a_corrupt_one_is_rebuilt(model, cc, workload,
                                                                         monkeypatch):
    """A new CompiledSteps loads every package the tests above wrote (none compiled); a corrupt
    package is said in one line and compiled again; an engine over them gives generate's tokens."""
    from minillm.paging.paged_cache import PagedKVCache
    make = lambda n, p: PagedKVCache(model.config, n, p, dtype=model.dtype)     # noqa: E731
    cs.CompiledSteps(model, cc).compile(make)            # compiles only if run alone
    lines = []
    monkeypatch.setattr(cs, "notice", lines.append)
    real = torch._inductor.aoti_compile_and_package
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda *a, **k: pytest.fail("compiled although the package was on disk"))
    second = cs.CompiledSteps(model, cc).compile(make)
    assert second.kept == SIZES and second.loaded == list(SIZES) and lines == []
    with open(second.package_path(4, cc.cache_dir), "wb") as f:
        f.write(b"not a package")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", real)
    third = cs.CompiledSteps(model, cc).compile(make)
    assert third.loaded == [1, 8] and third.kept == SIZES
    assert len(lines) == 1 and "unreadable" in lines[0]
    other = tiny_model(vocab_size=256, seed=1, dtype=torch.float64)    # same shapes, other weights
    assert cs.CompiledSteps(other, cc).package_path(1, "d") != third.package_path(1, "d")
    cs._MADE.pop(model, None)                             # a new process: nothing in memory
    prompts, max_tokens, refs = workload
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, max_num_batched_tokens=16,
                                           compilation_config=cc))      # loads the packages
    assert engine.runner.compiled.loaded == list(SIZES)
    outs = engine.generate(prompts[:3], [SamplingParams(max_tokens=k) for k in max_tokens[:3]])
    assert [o.token_ids for o in outs] == refs[:3]


@pytest.mark.parametrize("value, word", [
    (dict(compile_sizes=[]), "compile_sizes"), (dict(compile_sizes=[4, 2]), "strictly increasing"),
    (dict(compile_sizes=[1, 1]), "strictly increasing"),
    (dict(compile_sizes=[0, 2]), r"compile_sizes\[0\]"),
    (dict(compile_sizes=[1, 512]), "max_num_batched_tokens"), (dict(compile_sizes=4), "compile_sizes"),
    (dict(mode="fast"), "mode"), (dict(keep="always"), "keep"), (dict(min_gain=1.5), "min_gain"),
    (dict(rounds=0), "rounds"), (dict(sizes=[1]), "unknown keys")])
def test_bad_config_names_compilation_config(value, word):
    with pytest.raises(ValueError, match=word) as err:
        EngineConfig(max_num_batched_tokens=256, compilation_config=value)
    assert "compilation_config" in str(err.value)


def test_bad_types_and_tensor_parallel_are_refused():
    with pytest.raises(TypeError, match="compilation_config"):
        EngineConfig(compilation_config=[1, 2])
    with pytest.raises(ValueError, match="compilation_config needs tensor_parallel_size=1"):
        EngineConfig(compilation_config={}, tensor_parallel_size=2)


def test_inductor_caches_are_keyed_by_machine_and_threads(tmp_path, monkeypatch):
    a = cs.inductor_cache_dir(str(tmp_path))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    b = cs.inductor_cache_dir(str(tmp_path))
    assert a != b and a.startswith(str(tmp_path)) and b.startswith(str(tmp_path))
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "mc"))
    assert cs.inductor_cache_dir().startswith(str(tmp_path / "mc" / "inductor"))


def _quiet(busy: bool):
    from minillm.kernels.load_now import LoadNow
    return lambda self: LoadNow(2.0 if busy else 0.0, 0.0, 1.0, 2, 1.0)


def test_a_quiet_run_saves_its_verdicts_and_a_later_one_reads_them(model, cc, monkeypatch):
    """keep="faster": a quiet machine saves which sizes won; a later CompiledSteps does not time
    them again, never loads a size saved as eager, and still checks every size it keeps (a size
    saved as faster that disagrees now runs eager). A busy machine saves nothing, in one line."""
    from minillm.kernels.load_now import Watch
    from minillm.paging.paged_cache import PagedKVCache
    make = lambda n, p: PagedKVCache(model.config, n, p, dtype=model.dtype)     # noqa: E731
    fast = cs.CompilationConfig(**{**cc.__dict__, "keep": "faster"})
    path = cs.CompiledSteps(model, fast).verdict_path(fast.cache_dir)
    if os.path.exists(path):
        os.remove(path)
    lines = []
    monkeypatch.setattr(cs, "notice", lines.append)
    monkeypatch.setattr(Watch, "read", _quiet(busy=True))
    cs.CompiledSteps(model, fast).compile(make)
    assert not os.path.exists(path) and len(lines) == 1 and "busy" in lines[0]
    monkeypatch.setattr(Watch, "read", _quiet(busy=False))
    first = cs.CompiledSteps(model, fast).compile(make)
    assert os.path.exists(path) and not any(t.saved for t in first.timings)
    data = json.load(open(path))
    data["sizes"]["1"]["choice"] = "eager"
    data["sizes"]["4"]["choice"] = data["sizes"]["8"]["choice"] = "compiled"
    json.dump(data, open(path, "w"))
    monkeypatch.setattr(cs, "_timed", lambda fn: pytest.fail("timed a size with a saved verdict"))
    real = cs.CompiledSteps._check
    monkeypatch.setattr(cs.CompiledSteps, "_check", lambda self, ids, pos, prepared: (
        (1.0, False) if ids.shape[1] == 8 else real(self, ids, pos, prepared)))
    later = cs.CompiledSteps(model, fast).compile(make)
    assert later.kept == (4,) and 1 not in later._runners and sorted(later.loaded) == [4, 8]
    assert all(t.saved for t in later.timings) and "earlier quiet run" in later.summary()
    assert later.padded(1) is None and later.padded(3) == 4 and later.padded(5) is None
    data["key"]["threads"] = 97                           # another thread count's verdicts
    json.dump(data, open(path, "w"))
    monkeypatch.undo()
    again = cs.CompiledSteps(model, fast).compile(make)
    assert not any(t.saved for t in again.timings)        # foreign file ignored: timed again


def test_a_background_compile_serves_eager_first_then_compiled(model, workload, tmp_path,
                                                               monkeypatch):
    """The engine is built at once and serves eager while a child process compiles (one size,
    to keep the suite short); the serving process never compiles; the runner adopts the checked
    steps at its next step, and a decode of one row runs them."""
    from minillm.kernels import background_steps as bs
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda *a, **k: pytest.fail("compiled in the serving process"))
    monkeypatch.setattr(bs, "NICE", 0)          # a loaded test machine would starve a niced child
    cfg = cs.CompilationConfig(compile_sizes=(1,), mode="default", keep="agreeing", rounds=1,
                               cache_dir=str(tmp_path), background=True)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, max_num_batched_tokens=16,
                                           compilation_config=cfg))
    pending = engine.runner.pending
    assert isinstance(pending, bs.BackgroundSteps) and engine.runner.compiled is None
    prompts, max_tokens, refs = workload
    params = [SamplingParams(max_tokens=k) for k in max_tokens[:3]]
    assert [o.token_ids for o in engine.generate(prompts[:3], params)] == refs[:3]
    steps = pending.wait(timeout=600)
    assert steps is not None and pending.returncode == 0 and steps.kept == (1,)
    assert steps.loaded == [1] and "kept 1" in pending.line
    assert not [f for f in os.listdir(tmp_path) if f.startswith("job_")]       # job file removed
    ran, real = [], steps.run
    steps.run = lambda ids, *a, **k: ran.append(ids.shape[1]) or real(ids, *a, **k)
    out = engine.generate([prompts[0][:5]], [SamplingParams(max_tokens=6)])[0]
    assert engine.runner.pending is None and engine.runner.compiled is steps and ran == [1] * 5
    assert out.token_ids == generate(model, prompts[0][:5], 6)


def test_a_failed_background_compile_stays_eager_with_a_line(model, workload, tmp_path, monkeypatch):
    from minillm.kernels import background_steps as bs
    lines = []
    monkeypatch.setattr(bs, "notice", lines.append)
    monkeypatch.setattr(cs, "notice", lines.append)
    monkeypatch.setattr(bs, "_command", lambda job: [sys.executable, "-c", "raise SystemExit(3)"])
    cfg = cs.CompilationConfig(compile_sizes=(1, 2), mode="default", rounds=1,
                               cache_dir=str(tmp_path), background=True)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, compilation_config=cfg))
    engine.runner.pending.wait(timeout=120)
    assert any("status 3" in x for x in lines) and "every step eager" in lines[-1]
    prompts, max_tokens, refs = workload
    outs = engine.generate(prompts[:2], [SamplingParams(max_tokens=k) for k in max_tokens[:2]])
    assert [o.token_ids for o in outs] == refs[:2] and engine.runner.compiled is None
    assert engine.runner.pending is None


def test_the_step_clock_lets_timing_in_only_between_steps():
    from minillm.kernels.background_steps import IDLE_S, StepClock
    clock, got = StepClock(), []
    clock.begin()
    waiter = threading.Thread(target=lambda: got.append(clock.wait_idle()))
    waiter.start()
    waiter.join(3 * IDLE_S)
    assert waiter.is_alive()                               # a step is running: no timing
    clock.end()
    waiter.join(10)
    assert got == [1] and clock.unchanged(1)
    clock.begin()
    assert not clock.unchanged(1)
    clock.end()
    assert not clock.unchanged(1)                          # a step ran since the token


@pytest.mark.parametrize("argv, word", [(["--sizes", "2,1"], "strictly increasing"),
                                        (["--sizes", "1,x"], "--sizes"), (["--threads", "0"], "--threads"),
                                        (["--mode", "fast"], "mode")])
def test_the_compile_command_refuses_bad_flags_before_loading_anything(argv, word, capsys, monkeypatch):
    from minillm.engine import compile_steps
    monkeypatch.setattr(compile_steps, "load_model", lambda **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit):
        compile_steps.main(argv)
    assert word in capsys.readouterr().err
