#!/usr/bin/env python3
"""Closed-loop load generator for OpenAI-compatible completion servers.

Targets `fp8nsa serve` and llama.cpp's `llama-server` alike: it only uses
`POST {base}/v1/completions` with `"stream": true`, and optionally `POST {base}/tokenize`.

For each concurrency level C it sends R requests (default max(4, 2*C)) from C workers, each
worker sending its next request as soon as the previous one finished (closed loop), and prints
one JSON line on stdout:

  {"label", "concurrency", "requests", "errors", "output_tok_s", "ttft_p50_s", "ttft_p99_s",
   "tpot_p50_ms", "tpot_p99_ms", "cpu", ...a few extra fields}

and a readable summary on stderr.

Per request:
  TTFT  time from sending the request to the first SSE chunk carrying non-empty text.
  TPOT  (time of the last text chunk - time of the first) / (tokens - 1): the mean gap between
        output tokens after the first. Tokens are `usage.completion_tokens` when the stream ends
        with a usage chunk (requested through `stream_options.include_usage`), else the number
        of chunks with non-empty text (servers send one token per chunk; a multi-byte character
        split over tokens may merge chunks, so this count can be a little low).
  error a non-200 answer, a connection failure or timeout, an `error` object in the stream, a
        stream that ends without `data: [DONE]`, or one with no text at all.

Throughput (`output_tok_s`) is the output tokens of the successful requests divided by the
wall time of the level (first request sent to last answer finished).

Prompts are random words from a fixed list of common, short English words, so the prompt
length in tokens is approximated by the number of words: in the GPT-2-style BPE vocabularies
of the models we serve (SmolLM2, Llama, Qwen), such a word with its leading space is one token,
so a prompt of W words is about W tokens (+1 for BOS). When the server answers `POST /tokenize`
(llama-server does), one sample is tokenized first to measure the tokens-per-word ratio and
word counts are scaled by it; the server is not required to offer it (`--tokenize off` skips
the probe). Prompt lengths are uniform in [--min-prompt, --max-prompt] tokens, output lengths
uniform in [--min-out, --max-out] tokens, forced with `"ignore_eos": true`; everything is drawn
from --seed, and each level gets its own prompts so that no server prefix cache can serve a
level from the one before.

HTTP client: httpx (pip install httpx), one AsyncClient with keep-alive connections. The openai
package is not used: its per-chunk overhead would load the two cores that the server under test
shares with this script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import httpx
except ImportError:  # a clear message instead of a traceback
    sys.exit("loadgen.py needs httpx: python3 -m pip install httpx")

# Common short English words: each is a single BPE token with its leading space in the
# vocabularies above, which is what makes "1 word ~ 1 token" a fair approximation.
WORDS = """
the of and to in is it you that he was for on are with as his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said
an each she which do their time if will way about many then them write would like so these
her long make thing see him two has look more day could go come did number sound no most
people my over know water than call first who may down side been now find any new work part
take get place made live where after back little only round man year came show every good me
give our under name very through just form sentence great think say help low line differ turn
cause much mean before move right boy old too same tell does set three want air well also play
small end put home read hand port large spell add even land here must big high such follow act
why ask men change went light kind off need house picture try us again animal point mother
world near build self earth father head stand own page should country found answer school grow
study still learn plant cover food sun four between state keep eye never last let thought city
tree cross farm hard start might story saw far sea draw left late run while press close night
real life few north open seem together next white children begin got walk example ease paper
group always music those both mark often letter until mile river car feet care second book
carry took science eat room friend began idea fish mountain stop once base hear horse cut sure
watch color face wood main enough plain girl usual young ready above ever red list though feel
talk bird soon body dog family direct pose leave song measure door product black short numeral
class wind question happen complete ship area half rock order fire south problem piece told
knew pass since top whole king space heard best hour better true during hundred five remember
step early hold west ground interest reach fast verb sing listen six table travel less morning
ten simple several vowel toward war lay against pattern slow center love person money serve
appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall
lead cry dark machine note wait plan figure star box noun field rest correct able pound done
beauty drive stood contain front teach week final gave green oh quick develop ocean warm free
minute strong special mind behind clear tail produce fact street inch multiply nothing course
stay wheel full force blue object decide surface deep moon island foot system busy test record
boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate
""".split()


def cpu_model() -> str:
    """The CPU label every row carries (model name, family / model, SIMD level: see
    benches/cpu_label.py), so that results from different machines stay apart."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cpu_label import label

    return label()


def checkout() -> str:
    """The repository's commit, with "-dirty" when the work tree differs from it: what
    `benches/serve/run.sh` builds our server from (a peer's rows carry it too, as the run's),
    results files aside."""
    repo = Path(__file__).resolve().parents[2]
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=repo).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    # the results this run appends do not count as a change of what was measured
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benches/results")
    return commit + ("-dirty" if changed else "")


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Request:
    prompt: str
    prompt_tokens: int  # the length we aimed for, in tokens
    max_tokens: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0
    prompt_tokens: int | None = None  # usage.prompt_tokens when the server reports it
    latency_s: float = 0.0
    wanted: int = 0  # max_tokens asked for


@dataclass
class Level:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    pages_after: int | None = None


async def tokens_per_word(client: httpx.AsyncClient, base: str) -> float | None:
    """Tokens per word of our word list as the server's tokenizer counts them (POST /tokenize,
    llama-server's endpoint); None when the server does not offer it."""
    rng = random.Random(12345)
    n = 400
    text = " ".join(rng.choice(WORDS) for _ in range(n))
    try:
        r = await client.post(f"{base}/tokenize", json={"content": text, "add_special": False}, timeout=30)
        if r.status_code != 200:
            return None
        toks = r.json().get("tokens")
        if not isinstance(toks, list) or not toks:
            return None
        # the prompt starts without a space, so its first word may cost an extra token: negligible
        return len(toks) / n
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def make_requests(args, n: int, level_seed: str, tpw: float) -> list[Request]:
    # a str seed: random.Random(int) seeds with abs(n), so -1 and 1 would give the same prompts
    rng = random.Random(level_seed)
    reqs = []
    for _ in range(n):
        p_tok = rng.randint(args.min_prompt, args.max_prompt)
        words = max(1, round(p_tok / tpw))
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        reqs.append(Request(prompt, p_tok, rng.randint(args.min_out, args.max_out)))
    return reqs


async def one_request(client: httpx.AsyncClient, args, req: Request) -> Result:
    body = {
        "model": args.model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "stream": True,
        "ignore_eos": True,  # every request produces exactly max_tokens: comparable across servers
        "temperature": 0,
        # OpenAI's way to ask for a final chunk with usage; servers that ignore it are fine
        "stream_options": {"include_usage": True},
    }
    res = Result(wanted=req.max_tokens)
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = None
    done = False
    try:
        async with client.stream("POST", f"{args.base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")[:200]
                res.error = f"HTTP {r.status_code}: {text}"
                return res
            async for line in r.aiter_lines():
                # SSE: "data: <json>" lines, blank separators, ":" comments, other fields ignored
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    res.error = f"bad SSE data: {data[:100]}"
                    return res
                if obj.get("error"):
                    res.error = f"stream error: {json.dumps(obj['error'])[:200]}"
                    return res
                choices = obj.get("choices") or []
                if choices and (choices[0].get("text") or ""):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    last = now
                    chunks += 1
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    if isinstance(usage.get("completion_tokens"), int):
                        usage_tokens = usage["completion_tokens"]
                    if isinstance(usage.get("prompt_tokens"), int):
                        res.prompt_tokens = usage["prompt_tokens"]
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.latency_s = time.perf_counter() - t0
    if not done:
        res.error = "stream ended without [DONE]"
        return res
    if first is None:
        res.error = "no text in the stream"
        return res
    res.tokens = usage_tokens if usage_tokens else chunks
    res.ttft_s = first - t0
    if res.tokens > 1:
        res.tpot_s = (last - first) / (res.tokens - 1)
    res.ok = True
    return res


async def run_level(client: httpx.AsyncClient, args, concurrency: int, reqs: list[Request]) -> Level:
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    level = Level()

    async def worker():
        while True:
            try:
                req = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            level.results.append(await one_request(client, args, req))

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    # a hard bound on the level's time: what has not finished by then counts as errors
    _, pending = await asyncio.wait(tasks, timeout=args.level_timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    level.wall_s = time.perf_counter() - t0
    missing = len(reqs) - len(level.results)
    level.results.extend(Result(error=f"not finished within --level-timeout {args.level_timeout} s") for _ in range(missing))
    return level


async def pages_when_idle(client, base_url: str, wait_s: float = 10.0):
    """`fp8nsa_kv_pages_used` from the server's /metrics once no request runs or waits (polled
    for up to `wait_s`); None where the server has no such metric (llama-server)."""
    deadline = time.perf_counter() + wait_s
    while True:
        try:
            r = await client.get(f"{base_url}/metrics")
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        vals = {}
        for line in r.text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in ("fp8nsa_kv_pages_used", "fp8nsa_requests_running", "fp8nsa_requests_waiting"):
                vals[parts[0]] = float(parts[1])
        if "fp8nsa_kv_pages_used" not in vals:
            return None
        idle = vals.get("fp8nsa_requests_running", 0) == 0 and vals.get("fp8nsa_requests_waiting", 0) == 0
        if idle or time.perf_counter() > deadline:
            return int(vals["fp8nsa_kv_pages_used"])
        await asyncio.sleep(0.1)


def summarize(args, concurrency: int, level: Level, cpu: str, tpw: float) -> dict:
    ok = [r for r in level.results if r.ok]
    tokens = sum(r.tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s * 1000 for r in ok if r.tpot_s is not None]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]

    def rnd(x, nd):
        return None if x is None else round(x, nd)

    return {
        "label": args.label,
        "concurrency": concurrency,
        "requests": len(level.results),
        "errors": len(level.results) - len(ok),
        "output_tok_s": rnd(tokens / level.wall_s if level.wall_s > 0 else None, 2),
        "ttft_p50_s": rnd(percentile(ttft, 50), 4),
        "ttft_p99_s": rnd(percentile(ttft, 99), 4),
        "tpot_p50_ms": rnd(percentile(tpot, 50), 3),
        "tpot_p99_ms": rnd(percentile(tpot, 99), 3),
        "cpu": cpu,
        # extras: enough to tell how a row was produced
        "commit": checkout(),
        "output_tokens": tokens,
        "wall_s": round(level.wall_s, 3),
        "prompt_tokens_mean": rnd(sum(prompt) / len(prompt), 1) if prompt else None,
        "tokens_per_word": round(tpw, 3),
        "short_outputs": sum(1 for r in ok if r.tokens < r.wanted),
        "seed": args.seed,
        # KV pages still held once the level is over and the server idle (ours; null for a
        # server without the metric): 0 means every request gave its pages back
        "pages_used_after": level.pages_after,
    }


async def main_async(args) -> int:
    cpu = cpu_model()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        sys.exit("--concurrency wants a comma-separated list of positive integers")
    # room for every worker plus the probe; keep-alive so connection setup stays out of TTFT
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    timeout = httpx.Timeout(args.timeout, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tpw = None
        if args.tokenize == "auto":
            tpw = await tokens_per_word(client, args.base_url)
        if tpw:
            print(f"[loadgen] {args.label}: /tokenize says {tpw:.3f} tokens per word; prompts scaled by it", file=sys.stderr)
        else:
            tpw = 1.0
            print(f"[loadgen] {args.label}: no /tokenize; assuming 1 token per word", file=sys.stderr)

        # warm-up (not measured): first-touch page faults of mmapped weights and lazy setup
        # would otherwise land in the first level's TTFT
        if args.warmup > 0:
            warm = make_requests(args, args.warmup, f"{args.seed}/warmup", tpw)
            for w in warm:
                w.max_tokens = min(w.max_tokens, 8)
            res = await asyncio.gather(*(one_request(client, args, w) for w in warm))
            bad = [r.error for r in res if not r.ok]
            if bad:
                print(f"[loadgen] {args.label}: warm-up failed: {bad[0]}", file=sys.stderr)

        for c in levels:
            n = args.requests if args.requests else max(4, 2 * c)
            reqs = make_requests(args, n, f"{args.seed}/c{c}", tpw)
            print(f"[loadgen] {args.label}: concurrency {c}, {n} requests ...", file=sys.stderr)
            level = await run_level(client, args, c, reqs)
            level.pages_after = await pages_when_idle(client, args.base_url)
            row = summarize(args, c, level, cpu, tpw)
            print(json.dumps(row), flush=True)

            def fmt(x, unit):
                return "n/a" if x is None else f"{x}{unit}"

            print(
                f"[loadgen] {args.label} c={c}: {row['requests']} requests, {row['errors']} errors, "
                f"{fmt(row['output_tok_s'], ' tok/s')} out, TTFT p50 {fmt(row['ttft_p50_s'], ' s')} "
                f"p99 {fmt(row['ttft_p99_s'], ' s')}, TPOT p50 {fmt(row['tpot_p50_ms'], ' ms')} "
                f"p99 {fmt(row['tpot_p99_ms'], ' ms')}, wall {row['wall_s']} s"
                + ("" if row["pages_used_after"] is None else f", KV pages used after {row['pages_used_after']}"),
                file=sys.stderr,
            )
            errs = [r.error for r in level.results if not r.ok]
            for e in sorted(set(errs))[:5]:
                print(f"[loadgen]   error x{errs.count(e)}: {e}", file=sys.stderr)
            if row["short_outputs"]:
                print(f"[loadgen]   {row['short_outputs']} answers shorter than their max_tokens: does the server honour ignore_eos?", file=sys.stderr)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--model", default="default", help="the request's model field")
    p.add_argument("--label", default="server", help="names the rows")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default max(4, 2*C))")
    # a minimum left unset follows a maximum set below it (--max-out 32 alone means 32 at most)
    p.add_argument("--min-prompt", type=int, default=None, help="default 128 (or --max-prompt if lower)")
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-out", type=int, default=None, help="default 64 (or --max-out if lower)")
    p.add_argument("--max-out", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured short requests before the first level")
    p.add_argument("--tokenize", choices=["auto", "off"], default="auto", help="auto: calibrate prompt lengths with POST /tokenize when the server has it")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, s")
    p.add_argument("--level-timeout", type=float, default=1800.0, help="bound on one level's wall time, s")
    args = p.parse_args()
    args.base_url = args.base_url.rstrip("/")
    if args.min_prompt is None:
        args.min_prompt = min(128, args.max_prompt)
    if args.min_out is None:
        args.min_out = min(64, args.max_out)
    if not (1 <= args.min_prompt <= args.max_prompt) or not (1 <= args.min_out <= args.max_out):
        p.error("need 1 <= --min-prompt <= --max-prompt and 1 <= --min-out <= --max-out")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
