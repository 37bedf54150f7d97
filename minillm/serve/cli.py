"""`python -m minillm serve`: the OpenAI-compatible server, with vLLM's flag names.

    python -m minillm serve                                  # smollm2-135m on 127.0.0.1:8000
    python -m minillm serve --port 8001 --max-num-seqs 16 --scheduling-policy priority
    python -m minillm serve --speculative-config '{"method": "eagle", "num_speculative_tokens": 4}'
    python -m minillm serve --disaggregated --threads-per-engine 1   # prefill + decode processes

Engine flags map onto `EngineConfig` fields (`--max-num-seqs` -> max_num_seqs, ...) with the
server's own defaults (`SERVER_DEFAULTS`); a bad flag (a heads file that is not there too) is
one line and exit status 2; the SLO controller's line says the load it needs to act. The server
binds 127.0.0.1 unless `--host` says otherwise, binds its port before loading anything, keeps CORS
off unless `--allowed-origins` lists origins, and loads through the front door (`LLM`).
`--disaggregated` puts a router in front of a prefill and a decode process (serve/disaggregated.py;
`--role` runs each piece in its own terminal, on this machine's trusted loopback only).

Left out on purpose: vLLM's other flags (pipeline parallelism, LoRA, tool parsers, ...).
"""
import argparse
import json
import logging
import os
import socket
import sys

from minillm.model.loading import DEFAULT_MODEL

ENGINE_FLAGS = {   # flag -> (EngineConfig field, type)
    "--block-size": ("block_size", int), "--num-gpu-blocks-override": ("num_blocks", int),
    "--max-num-seqs": ("max_num_seqs", int), "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--kv-cache-memory-bytes": ("kv_cache_memory_bytes", int),
    "--preemption-mode": ("preemption_mode", str), "--scheduling-policy": ("scheduling_policy", str),
    "--kv-cache-dtype": ("kv_cache_dtype", str), "--seed": ("seed", int),
    "--num-speculative-tokens": ("num_speculative_tokens", int),
    "--attention-backend": ("attention_backend", str),     # "auto", "paged" or "flash_decoding"
    "--max-num-partial-prefills": ("max_num_partial_prefills", int),
    "--max-long-partial-prefills": ("max_long_partial_prefills", int),
    "--long-prefill-token-threshold": ("long_prefill_token_threshold", int),
    "--prefill-step-target-ms": ("prefill_step_target_ms", float),   # chunks in time (0: off)
    "--tensor-parallel-size": ("tensor_parallel_size", int),   # ranks, as worker processes
    # speculation that steps aside (vLLM V0's flag; or "disable_by_batch_size" in --speculative-config)
    "--speculative-disable-by-batch-size": ("speculative_disable_by_batch_size", int),
    "--speculative-min-seq-len": ("speculative_min_seq_len", int),
    "--logprobs-mode": ("logprobs_mode", str),   # raw_logprobs (default) | processed_logprobs | ..
}
# the host KV tier (paging/offload.py): vLLM's --kv-offloading-size, in GiB (with
# --enable-prefix-caching), and how long a cached block sits idle before it is copied there
ENGINE_FLAGS.update({"--kv-offloading-size": ("kv_offloading_size", float),
                     "--offload-idle-s": ("offload_idle_s", float)})
# The server's own defaults where they differ from EngineConfig's: a 512-token budget prefills a
# typical prompt (HumanEval's longest are ~320 tokens) in one step, and partial prefills keep a
# short request from waiting behind a long prompt's whole prefill (a quarter of the budget is left
# to others). `--long-prefill-token-threshold 0 --max-num-partial-prefills 1` is the old order.
# Chunks are also sized in time (`--prefill-step-target-ms`, engine/policies/prefill_pacer.py): a 384-token
# chunk took 7-18 s at load 7 on a 2-core CPU, and a short request beside a long prompt waits a
# chunk per token; `--prefill-step-target-ms 0` sizes chunks in tokens only.
SERVER_DEFAULTS = {"max_num_batched_tokens": 512, "max_num_partial_prefills": 2,
                   "max_long_partial_prefills": 1, "long_prefill_token_threshold": 384,
                   "prefill_step_target_ms": 500.0}
PARTIAL_PREFILL_FIELDS = ("max_num_partial_prefills", "max_long_partial_prefills",   # need chunks
                          "long_prefill_token_threshold", "prefill_step_target_ms")


def origins(value: str) -> list[str]:
    """--allowed-origins: '["http://a", "http://b"]' (vLLM's JSON) or 'http://a,http://b'."""
    if value.lstrip().startswith("["):
        try:
            out = json.loads(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"not a JSON list: {err}") from None
        if not isinstance(out, list) or not all(isinstance(o, str) and o for o in out):
            raise argparse.ArgumentTypeError("a JSON list of origin strings")
        return out
    return [o.strip() for o in value.split(",") if o.strip()]


def address(value: str) -> tuple[str, int]:
    """--router-address: HOST:PORT."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"HOST:PORT with a port in [1, 65535], got {value!r}")
    return host.strip("[]"), int(port)


def json_object(value: str) -> dict:
    """--speculative-config: a JSON object, as vLLM takes it, e.g.
    '{"method": "eagle", "num_speculative_tokens": 4, "speculative_token_tree": [[0], [1], [0, 0]]}'."""
    try:
        out = json.loads(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(out, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, got {type(out).__name__}")
    return out


def positive(value: str) -> float:
    """--slo-*: a finite number > 0."""
    try:
        out = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number > 0, got {value!r}") from None
    if not 0 < out < float("inf"):
        raise argparse.ArgumentTypeError(f"a finite number > 0, got {value!r}")
    return out


# compiled engine steps (kernels/compiled_steps.py), vLLM's JSON flag: '{"compile_sizes": [1, 2, 4, 8]}'
ENGINE_FLAGS["--compilation-config"] = ("compilation_config", json_object)

# The SLO controller (engine/policies/slo_controller.py): P95 targets in ms and its decision interval.
ENGINE_FLAGS.update({"--slo-ttft-p95-ms": ("slo_ttft_p95_ms", positive),
                     "--slo-tpot-p95-ms": ("slo_tpot_p95_ms", positive),
                     "--slo-interval-s": ("slo_interval_s", positive)})


def missing_heads(spec: dict) -> str | None:
    """The complaint about a --speculative-config whose Medusa / EAGLE heads file is not there."""
    path = spec.get("model")
    if spec.get("method") in ("medusa", "eagle") and isinstance(path, str) and not os.path.isfile(path):
        return (f"--speculative-config: no {spec['method']} heads file at {path!r} (\"model\": "
                f"a path to trained heads, or null to train them)")
    return None


def slo_notice(engine) -> str | None:
    """The load the SLO controller needs to act: it holds until `min_samples` latencies (TPOT:
    one per finished request) fall within its longest window, a count of intervals."""
    ctl = getattr(engine, "controller", None)
    if ctl is None:
        return None
    i, n, w = ctl.interval_s, ctl.min_samples, ctl.max_window_s
    return (f"minillm: the SLO controller decides every {i:g} s from >= {n} latencies of the last "
            f"{w:g} s (TPOT: one per finished request): with R requests finishing per second, "
            f"--slo-interval-s must exceed {n * i / w:g} / R s ({i:g} s needs R >= {n / w:.2g})")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minillm serve",
                                description="An OpenAI-compatible server over minillm's engine.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a preset name, an HF folder or a .gguf")
    p.add_argument("--served-model-name", default=None, help="the id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (or set MINILLM_API_KEY)")
    p.add_argument("--dtype", default=None, help="auto (float32), bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: the model's shape with random weights")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    p.add_argument("--max-pending-requests", type=int, default=256,
                   help="requests waiting or running before new ones get 503")
    p.add_argument("--allowed-origins", type=origins, default=None,
                   help="origins allowed by CORS, e.g. '[\"http://localhost:3000\"]' (default: CORS off)")
    p.add_argument("--speculative-config", type=json_object, default=None,
                   help='speculative decoding, e.g. \'{"method": "medusa", "num_speculative_tokens": 3}\' '
                        '(ngram, draft_model, medusa, eagle, lookahead; "model": a path or null)')
    p.add_argument("--disaggregated", action="store_true",
                   help="prefill and decode in two processes behind this server (chapter 11)")
    p.add_argument("--threads-per-engine", type=int, default=1,
                   help="torch threads of each engine process with --disaggregated (default 1)")
    p.add_argument("--role", default="all", choices=["all", "router", "prefill", "decode"],
                   help="with --disaggregated: run one piece only, in a terminal of its own")
    p.add_argument("--router-address", type=address, default=("127.0.0.1", 8100),
                   help="HOST:PORT where the router waits for its workers (default 127.0.0.1:8100)")
    p.add_argument("--graceful-shutdown-s", type=float, default=5.0)
    p.add_argument("--log-level", default="info")
    for flag, (_, typ) in ENGINE_FLAGS.items():
        p.add_argument(flag, type=typ, default=None)
    return p


def engine_options(args) -> dict:
    opts = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _) in ENGINE_FLAGS.items()}
    opts = {k: v for k, v in opts.items() if v is not None}
    for field, value in SERVER_DEFAULTS.items():   # partial prefills need chunked prefill
        if args.enable_chunked_prefill or field not in PARTIAL_PREFILL_FIELDS:
            opts.setdefault(field, value)
    opts["enable_prefix_caching"] = args.enable_prefix_caching
    opts["enable_chunked_prefill"] = args.enable_chunked_prefill
    return opts


def build_llm(args):
    """The `LLM` the flags describe (`--load-format dummy`: `random_model`, SmolLM2's shape)."""
    import torch

    from minillm.llm import LLM, resolve_dtype
    from minillm.model.loading import default_device, load_tokenizer, random_model
    opts = engine_options(args)
    if args.load_format == "dummy":
        dtype = resolve_dtype(args.dtype) or torch.float32
        model = random_model(DEFAULT_MODEL, device=args.device or default_device(), dtype=dtype)
        llm = LLM(model, load_tokenizer(), quantization=args.quantization,
                  speculative_config=args.speculative_config, **opts)
        llm.model_name = args.model
        return llm
    return LLM(args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
               speculative_config=args.speculative_config, **opts)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, made before anything loads; a port in use (or an
    address this machine does not have) ends the process with one line on stderr, status 1."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError as err:
        sock.close()
        sys.exit(f"minillm serve: cannot listen on {host}:{port}: {err.strerror or err}")
    return sock


def _show_notices() -> None:
    """The one-line notices of the loader and the kernel tuning, on stderr like uvicorn's log."""
    log = logging.getLogger("minillm")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("minillm: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if not 0 <= args.port < 65536:
        parser().error(f"--port must be in [0, 65535], got {args.port}")
    if args.max_pending_requests < 1:
        parser().error(f"--max-pending-requests must be >= 1, got {args.max_pending_requests}")
    if args.threads_per_engine < 1:
        parser().error(f"--threads-per-engine must be >= 1, got {args.threads_per_engine}")
    if args.disaggregated and (args.speculative_config is not None or args.quantization):
        parser().error("--disaggregated takes no --speculative-config and no --quantization")
    if args.disaggregated and engine_options(args).get("tensor_parallel_size", 1) != 1:
        parser().error("--disaggregated takes no --tensor-parallel-size (each engine is one process)")
    if args.role != "all" and not args.disaggregated:
        parser().error(f"--role {args.role} needs --disaggregated")
    if args.speculative_config is not None and missing_heads(args.speculative_config):
        parser().error(missing_heads(args.speculative_config))
    if args.role in ("prefill", "decode"):
        return run_worker_role(args)                   # no HTTP port: it dials the router
    sock = bind(args.host, args.port)                  # first: a clash costs no model load
    from minillm.serve.app import build_app
    from minillm.serve.server import serve
    _show_notices()
    if args.disaggregated:
        return serve_disaggregated(args, sock)
    try:
        llm = build_llm(args)
    except (TypeError, ValueError) as err:            # a bad engine option: say which
        sock.close()
        parser().error(str(err))
    name = args.served_model_name or args.model
    app = build_app(llm.llm_engine, name, args.api_key, args.max_pending_requests,
                    allowed_origins=args.allowed_origins)
    if slo_notice(llm.llm_engine):
        print(slo_notice(llm.llm_engine), flush=True)
    print(f"minillm: {name!r}, max_num_seqs={llm.llm_engine.config.max_num_seqs}, "
          f"{llm.llm_engine.num_blocks} KV blocks of {llm.llm_engine.config.block_size} tokens", flush=True)
    try:
        serve(app, args.host, args.port, args.graceful_shutdown_s, args.log_level, sock=sock)
    finally:                                           # tensor parallel: the workers stop too
        llm.shutdown()


def _load(args):
    """(model, tokenizer) through the front door (this machine's matmul routes, chosen on
    --threads-per-engine threads), or SmolLM2's shape at random (`--load-format dummy`)."""
    import torch

    from minillm.llm import load_model, resolve_dtype
    from minillm.model.loading import default_device, load_tokenizer, random_model
    dtype = resolve_dtype(args.dtype) or torch.float32
    device = args.device or default_device()
    if args.load_format == "dummy":
        return random_model(DEFAULT_MODEL, device=device, dtype=dtype), load_tokenizer()
    torch.set_num_threads(args.threads_per_engine)     # the routes are chosen for the engines' threads
    return load_model(args.model, device=device, dtype=dtype)


def _authkey() -> bytes:
    return os.environ.get("MINILLM_DISAGG_KEY", "minillm").encode()


def run_worker_role(args) -> None:
    """`--role prefill|decode`: load the model, dial the router, serve its requests until it stops."""
    from minillm.engine.config import EngineConfig
    from minillm.serve.disagg_worker import run_remote
    _show_notices()
    model, tok = _load(args)
    try:
        config = EngineConfig(**engine_options(args))
    except (TypeError, ValueError) as err:
        parser().error(str(err))
    host, port = args.router_address
    print(f"minillm: {args.role} worker (pid {os.getpid()}) dialing the router at {host}:{port}",
          flush=True)
    try:
        run_remote(args.role, args.router_address, {"model": model, "tokenizer": tok,
                                                    "config": config,
                                                    "threads": args.threads_per_engine}, _authkey())
    except (ConnectionError, OSError) as err:
        sys.exit(f"minillm serve --role {args.role}: cannot reach the router at {host}:{port}: {err}")


def serve_disaggregated(args, sock) -> None:
    """`--disaggregated`: the model loaded here, handed to a prefill and a decode process (or,
    with `--role router`, to the two workers that dial in)."""
    from minillm.engine.config import EngineConfig
    from minillm.serve.app import build_app
    from minillm.serve.router import DisaggregatedEngine
    from minillm.serve.server import serve
    model, tok = _load(args)
    remote = {}
    if args.role == "router":
        host, port = args.router_address
        remote = dict(listen=args.router_address, authkey=_authkey(), start_timeout_s=None,
                      on_listen=lambda a: print(f"minillm: waiting for a prefill and a decode "
                                                f"worker at {host}:{port}", flush=True))
    try:
        engine = DisaggregatedEngine(model, tok, EngineConfig(**engine_options(args)),
                                     args.threads_per_engine, **remote)
    except (TypeError, ValueError) as err:
        sock.close()
        parser().error(str(err))
    if 2 * args.threads_per_engine > (os.cpu_count() or 1):
        print(f"minillm: warning: 2 engines x {args.threads_per_engine} threads > "
              f"{os.cpu_count()} cores: the engines will slow each other down", file=sys.stderr)
    name = args.served_model_name or args.model
    try:
        app = build_app(engine, name, args.api_key, args.max_pending_requests,
                        allowed_origins=args.allowed_origins)
        print(f"minillm: {name!r} disaggregated: prefill pid {engine.pids['prefill']}, decode pid "
              f"{engine.pids['decode']}, {engine.num_blocks} KV blocks of "
              f"{engine.config.block_size} tokens each", flush=True)
        serve(app, args.host, args.port, args.graceful_shutdown_s, args.log_level, sock=sock)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
