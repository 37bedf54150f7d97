"""Speculative decoding benchmark (chapter 6): real model, batch 1 and a small batch, greedy.

1. n-gram (prompt lookup) drafting on input-grounded prompts (summarize, rewrite, extract, code
   edit) vs minillm's plain `generate`, and transformers' `prompt_lookup_num_tokens` vs
   transformers' plain `generate` on the same prompts.
2. Each self-draft of the target (bf16 copy, layer-skipping copy, early-exit copy) as a draft
   model: measured speedup vs the prediction E[tokens](a, K) / (K c + v) from the acceptance
   rate a measured in the run, the measured cost ratio c (one draft forward / one target
   forward) and the measured verify cost v (a K+1-token target forward / a 1-token one);
   and transformers' assisted generation with the same draft (constant K, no confidence cut).
3. A small batch: the four prompts served together by `LLMEngine`, plain vs n-gram drafts.

Every prediction adds the prefills the measured times contain (`speedup_with_prefill`): the
target's, in both runs, and a draft model's own pass over the prompt, which a 64-token answer does
not amortize (a bf16 prefill is slow on CPUs without bf16 matrix units). Forward costs are medians
of interleaved isolated timings; the draft's first forward of a step feeds 2 tokens after a fully
accepted step (probability a^K), so c mixes the 1- and 2-token costs.

Generation stops at the chat end-of-turn token, the same for every method; greedy speculative
output is checked to be identical to plain output. Times are the best of `repeat` runs; measure
on a quiet machine (`--threads=N` pins torch's thread count).

    python -m benchmarks spec [--quick]
"""
import torch

from benchmarks.records import save_figure_beside, write_result
from minillm.model.chat import encode_chat
from minillm.model.generate import generate
from minillm.model.hf_convert import to_hf_model
from minillm.model.loading import default_device, load_model
from minillm.spec.proposers import DraftModelProposer, NgramProposer
from minillm.spec.loop import SpecStats, speculative_generate
from minillm.analysis.spec_theory import expected_speedup, free_verify_costs, speedup_with_prefill
from minillm.lab.prompts import SELF_DRAFTS, SPEC_PROMPTS as PROMPTS, SPEC_SETTINGS as SETTINGS
from minillm.lab.spec_costs import best_time, forward_times, prefill_times, small_batch
from minillm.lab.spec_report import report  # noqa: F401  (`python -m benchmarks spec` prints it)


def _hf_generate(hf, ids, n, stop, **kw) -> list[int]:
    x = torch.tensor([ids], device=hf.device)
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                      eos_token_id=stop, pad_token_id=stop[0], **kw)
    return out[0, len(ids):].tolist()


def _first_run(st: SpecStats, repeat: int) -> SpecStats:
    """Stats of one run (the `repeat` greedy runs are identical)."""
    n = st.num_steps // repeat
    return SpecStats(st.num_proposed[:n], st.num_accepted[:n], st.draft_s / repeat,
                     st.verify_s / repeat)


def _spec_entry(t_plain, t_spec, out, ref, st: SpecStats, k, c, v, t1, prefill, draft_prefill=0.0) -> dict:
    """c, v, prefill costs: from isolated forward timings, in units of t1 (one 1-token target
    forward). `predicted` = the per-step formula E[tokens](a, K) / (K c + v), then both prefills
    added (`speedup_with_prefill`); `predicted_decode` leaves the prefills out. c_loop, v_loop: the
    time spent inside the run per draft token (draft prefill included) and per verify step."""
    a = min(st.alpha_estimate, 1.0)
    decode = expected_speedup(a, k, c, v)
    pred = speedup_with_prefill(len(out), decode, prefill, draft_prefill)
    steps = max(1, st.num_steps)
    return {"tokens": len(out), "seconds": t_spec, "speedup": t_plain / t_spec,
            "same_as_plain": out == ref, "acceptance": a, "alpha_estimate": a,
            "accepted_fraction": st.accepted_fraction, "tokens_per_step": st.tokens_per_step,
            "mean_k": sum(st.num_proposed) / steps, "steps": st.num_steps,
            "k": k, "c": c, "verify_cost": v, "prefill_cost": prefill, "draft_prefill_cost": draft_prefill,
            "predicted": pred, "predicted_decode": decode,
            "predicted_ideal": expected_speedup(a, k, c, 1.0),
            "measured_over_predicted": (t_plain / t_spec) / pred,
            "c_loop": st.draft_s / max(1, sum(st.num_proposed)) / t1,
            "verify_cost_loop": st.verify_s / steps / t1}


def run(quick: bool = False, device=None, out_dir=None, model=None, tok=None,
        num_threads: int | None = None) -> dict:
    s = SETTINGS[quick]
    if num_threads:
        torch.set_num_threads(num_threads)
    device = torch.device(device) if device is not None else default_device()
    if model is None:
        model, tok = load_model(device=device)
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    hf = to_hf_model(model)
    N, Kn, Kd, rep = s["max_new_tokens"], s["k_ngram"], s["k_draft"], s["repeat"]
    drafts = {name: build(model) for name, (build, _) in SELF_DRAFTS.items()}
    hf_drafts = {name: to_hf_model(d) for name, d in drafts.items()}
    for a in hf_drafts.values():
        a.generation_config.num_assistant_tokens = Kd
        a.generation_config.num_assistant_tokens_schedule = "constant"
        a.generation_config.assistant_confidence_threshold = 0.0
    result = {"settings": {**s, "draft_prompts": list(s["draft_prompts"])}, "ngram": {},
              "self_drafts": {n: {"description": d, "prompts": {}} for n, (_, d) in SELF_DRAFTS.items()}}
    ctx = len(encode_chat(tok, PROMPTS["summarize"])) + N // 2     # a typical context length
    kmax = max(Kn, Kd)
    times = forward_times({"target": model, **drafts}, ctx,
                          {"target": list(range(1, kmax + 2)), **{d: [1, 2] for d in drafts}},
                          rounds=15)
    t1 = times[("target", 1)]
    verify = {k: times[("target", k + 1)] / t1 for k in range(1, kmax + 1)}
    cost = {name: times[(name, 1)] / t1 for name in drafts}
    cost2 = {name: times[(name, 2)] / t1 for name in drafts}     # after a fully accepted step
    result["costs"] = {"context_len": ctx, "target_forward_s": t1, "verify_cost": verify,
                       "draft_cost_ratio": cost}
    for name, text in PROMPTS.items():
        ids = encode_chat(tok, text)
        pre = prefill_times({"target": model, **(drafts if name in s["draft_prompts"] else {})}, len(ids))
        pre = {m: t / t1 for m, t in pre.items()}
        result["costs"].setdefault("prefill_cost", {})[name] = pre
        t_plain, ref = best_time(lambda: generate(model, ids, N, stop_token_ids=stop), rep)
        st = SpecStats()
        ngram = NgramProposer(min_ngram=s["min_ngram"])
        t_spec, out = best_time(lambda: speculative_generate(model, ngram, ids, N, Kn,
                                                         stop_token_ids=stop, stats=st), rep)
        st = _first_run(st, rep)
        entry = _spec_entry(t_plain, t_spec, out, ref, st, Kn, 0.0, verify[Kn], t1, pre["target"])
        # the same cost model fed with the steps that actually ran (k varies with the matches)
        step_cost = sum(verify[k] if k else 1.0 for k in st.num_proposed)
        entry["predicted_from_steps"] = speedup_with_prefill(len(out), len(out) / step_cost, pre["target"])
        t_hf, hf_ref = best_time(lambda: _hf_generate(hf, ids, N, stop), rep)
        t_hf_pl, hf_out = best_time(lambda: _hf_generate(hf, ids, N, stop, prompt_lookup_num_tokens=Kn,
                                                     max_matching_ngram_size=3), rep)
        entry.update(plain_seconds=t_plain, plain_tokens=len(ref), hf_plain_seconds=t_hf,
                     hf_tokens=len(hf_ref), hf_prompt_lookup_seconds=t_hf_pl,
                     hf_speedup=t_hf / t_hf_pl, hf_same_as_ours=hf_out == ref)
        result["ngram"][name] = entry
        if name not in s["draft_prompts"]:
            continue
        for dname, draft in drafts.items():
            st = SpecStats()
            t_spec, out = best_time(lambda: speculative_generate(
                model, DraftModelProposer(draft), ids, N, Kd, stop_token_ids=stop, stats=st), rep)
            st = _first_run(st, rep)
            # the first draft forward of a step feeds 2 tokens after a fully accepted step (p = a^K)
            full = min(st.alpha_estimate, 1.0) ** Kd
            c_eff = cost[dname] + (cost2[dname] - cost[dname]) * full / Kd
            entry = _spec_entry(t_plain, t_spec, out, ref, st, Kd, c_eff, verify[Kd], t1,
                                pre["target"], pre[dname])
            t_hf_a, _ = best_time(lambda: _hf_generate(hf, ids, N, stop, assistant_model=hf_drafts[dname]), rep)
            entry.update(hf_speedup=t_hf / t_hf_a)
            result["self_drafts"][dname]["prompts"][name] = entry
    result["small_batch"] = small_batch(model, [encode_chat(tok, t) for t in PROMPTS.values()], stop, s)
    _summarize(result)
    path = write_result("spec", result, device, out_dir)
    from minillm.viz.spec import plot_spec_benchmark
    save_figure_beside(plot_spec_benchmark(result), path, "spec")
    result["path"] = str(path)
    return result


def _summarize(result: dict) -> None:
    """Aggregate over prompts: total plain time / total speculative time, and mean prediction."""
    ng = result["ngram"].values()
    # the ceiling of these runs' own schedules: every forward of up to K + 1 tokens as cheap as a
    # 1-token step (v = 1) and drafting free
    costs = [free_verify_costs(e["tokens"], e["steps"], e["prefill_cost"]) for e in ng]
    for e, (plain, spec) in zip(ng, costs):
        e["ceiling_v1"] = plain / spec
    result["ngram_summary"] = {
        "ceiling_v1": sum(p for p, _ in costs) / sum(s for _, s in costs),
        "speedup": sum(e["plain_seconds"] for e in ng) / sum(e["seconds"] for e in ng),
        "hf_speedup": sum(e["hf_plain_seconds"] for e in ng) / sum(e["hf_prompt_lookup_seconds"] for e in ng),
        "predicted_from_steps": sum(e["predicted_from_steps"] for e in ng) / len(ng),
        "acceptance": sum(e["acceptance"] for e in ng) / len(ng), "all_same": all(e["same_as_plain"] for e in ng)}
    for d in result["self_drafts"].values():
        es = list(d["prompts"].values())
        if es:
            d["summary"] = {key: sum(e[key] for e in es) / len(es) for key in
                            ("speedup", "predicted", "predicted_decode", "predicted_ideal", "acceptance",
                             "c", "verify_cost", "draft_prefill_cost", "c_loop", "verify_cost_loop",
                             "hf_speedup", "measured_over_predicted")}
            d["summary"]["all_same"] = all(e["same_as_plain"] for e in es)


def main(args=None) -> dict:
    import sys
    args = sys.argv[1:] if args is None else args
    threads = next((int(a.split("=", 1)[1]) for a in args if a.startswith("--threads=")), None)
    r = run(quick="--quick" in args, num_threads=threads)
    print(report(r))
    return r


if __name__ == "__main__":
    main()
