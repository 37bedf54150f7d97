"""The async half of the load generator: arrival times, SSE parsing, and one streamed request.

Arrivals: `arrival_times(n, rate, burstiness, seed)` draws the gaps between request starts from
a gamma distribution with shape `burstiness` and mean 1/rate (burstiness 1: exponential gaps, a
Poisson process; below 1 burstier, above 1 more regular; the coefficient of variation of the gaps
is 1/sqrt(burstiness)). rate=inf sends every request at time 0.

Streaming: the server's answer is read as server-sent events, parsed by hand (`SSEParser`:
`data:` lines joined until a blank line ends the event, `:` comment lines skipped). A chunk is
one event whose choice carries text (`delta.content` for chat, `text` for completions); `usage`
is taken from any event that has it (OpenAI sends it in a last chunk with empty choices,
transformers beside the last choice). The stream ends at `data: [DONE]` or when the server closes it.

`run_load` sends every prompt at its arrival time, at most `max_concurrency` in flight (a request
that arrives while all slots are busy waits for one, as in vLLM's benchmark, and its latencies
count from when it is sent), and never raises
for a failed request: the failure is recorded in its `RequestResult`.

Left out on purpose: retries, non-streamed requests, `n` > 1, and multi-turn chats.
"""
import asyncio
import json
import math
import random
import time

from minillm._validate import check_int, check_real
from minillm.lab.serve_metrics import RequestResult

ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Start offsets in seconds of `n` requests: 0 for the first, then gamma-distributed gaps."""
    check_int("n", n, low=1)
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0):
        raise ValueError(f"request rate must be a number > 0 (inf: all at once), got {rate!r}")
    check_real("burstiness", burstiness, low=0, low_open=True)
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, [0.0]
    for _ in range(n - 1):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))   # mean shape*scale = 1/rate
        out.append(t)
    return out


class SSEParser:
    """Feed it text lines (without their line ending); it returns each finished event's data."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if line == "":                              # a blank line ends the event
            return self.flush()
        if line.startswith(":"):                    # a comment (servers send these as keep-alives)
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None                                 # event:, id:, retry: are not used here

    def flush(self) -> str | None:
        """The pending event's data, if any (a stream may end without a final blank line)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def chunk_text(event: dict, endpoint: str) -> str:
    """The text one streamed event carries ('' for role-only, empty or usage-only events)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def request_body(model: str, prompt: str, endpoint: str, max_tokens: int, ignore_eos: bool) -> dict:
    """Greedy, streamed, with usage asked for; `ignore_eos` is sent only when True."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": prompt}]} if endpoint == "chat"
                else {"prompt": prompt})
    if ignore_eos:                                  # only when asked: not every server knows it
        body["ignore_eos"] = True
    return body


async def _consume(response, endpoint: str, result: RequestResult) -> None:
    """Read the SSE stream into `result` (times relative to result.start)."""
    parser, last, usage, chunks = SSEParser(), None, None, 0
    async for line in response.aiter_lines():
        data = parser.feed(line)
        if data is None:
            continue
        if data.strip() == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"server error in stream: {str(event['error'])[:200]}")
        usage = event.get("usage") or usage
        text = chunk_text(event, endpoint)
        if text:
            now = time.perf_counter()
            if last is None:
                result.ttft = now - result.start
            else:
                result.itl.append(now - last)
            last, chunks = now, chunks + 1
            result.text += text
    if last is None:
        raise RuntimeError("the stream ended without any text")
    result.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    result.prompt_tokens = int(usage.get("prompt_tokens", 0)) if usage else 0


async def send_request(client, url: str, body: dict, endpoint: str, headers: dict) -> RequestResult:
    """One streamed request; any failure (HTTP status, connection, bad stream) -> ok=False."""
    result = RequestResult(ok=False, start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")[:200]
                raise RuntimeError(f"HTTP {response.status_code}: {detail}")
            await _consume(response, endpoint, result)
        result.e2e = time.perf_counter() - result.start
        result.ok = True
    except Exception as err:     # noqa: BLE001 (one failed request must never end the run)
        result.error = f"{type(err).__name__}: {err}"[:300]
    return result


async def run_load(base_url: str, model: str, prompts: list[str], *, endpoint: str = "chat",
                   request_rate: float = math.inf, burstiness: float = 1.0,
                   max_concurrency: int | None = None, max_tokens: int = 64, ignore_eos: bool = False,
                   seed: int = 0, api_key: str | None = None,
                   timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every prompt, return (results in prompt order, wall seconds from first send to last
    end). `seed` seeds the arrival times; requests are greedy (temperature 0)."""
    import httpx
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if max_concurrency is not None:
        check_int("max_concurrency", max_concurrency, low=1)
    check_int("max_tokens", max_tokens, low=1)
    starts = arrival_times(len(prompts), request_rate, burstiness, seed)
    url = base_url.rstrip("/") + ENDPOINTS[endpoint]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency or len(prompts))
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int, prompt: str) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + starts[i] - time.perf_counter()))
            async with gate:
                body = request_body(model, prompt, endpoint, max_tokens, ignore_eos)
                return await send_request(client, url, body, endpoint, headers)
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - t0
    return list(results), duration
