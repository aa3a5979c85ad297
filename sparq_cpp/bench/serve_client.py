"""The clients of `sparq-cpp bench serve`: users who each hold a streamed chat with an OpenAI-compatible server
(llama-server), timed as they see it, and what their replies add up to.

A reply is timed from the request being sent: the time to its first generated text (TTFT), then the arrival of
each further streamed chunk that carries text (one token each from llama-server; a token that ends inside a UTF-8
character arrives with the next one) and the gaps between them (inter-token latency). llama-server's own
`timings` on the last chunk add what a client cannot see: the prompt tokens it processed (`prompt_n`) and those it
took from the slot's cache (`cache_n`), and the tokens generated (`predicted_n`). A failed request (an HTTP error,
an error event in the stream, a stream cut before `[DONE]`, a timeout) is kept as a reply with its `error`, so
that a report counts it instead of losing it; a cancelled user closes its stream and lets the cancellation through.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from sparq_cpp import lazy


@dataclass
class Reply:
    user: int
    turn: int
    t_send: float
    t_first: float | None = None  # the first chunk with generated text
    t_end: float | None = None  # the end of the stream
    token_times: list = field(default_factory=list)  # arrival of every chunk with generated text, the first included
    text: str = ""
    finish_reason: str | None = None
    timings: dict = field(default_factory=dict)  # llama-server's: cache_n, prompt_n, prompt_ms, predicted_n, ...
    usage: dict = field(default_factory=dict)
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send

    @property
    def gaps(self) -> list:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def n_tokens(self) -> int:
        """Tokens generated: the server's count where it gave one, else the chunks with text."""
        return int(self.timings.get("predicted_n", len(self.token_times)))

    def as_dict(self, t0: float = 0.0) -> dict:
        """For the JSON: times relative to t0, the gaps between tokens rather than their times."""
        d = {k: v for k, v in asdict(self).items() if k != "token_times"}
        for k in ("t_send", "t_first", "t_end"):
            d[k] = None if d[k] is None else d[k] - t0
        d["text_chars"] = len(self.text)
        d["ttft_s"] = self.ttft
        d["gaps_s"] = self.gaps
        return d


def _message(raw) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body itself."""
    try:
        body = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except ValueError:
        return (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).strip()[:500]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err)[:500]
    return str(err)[:500]


async def stream_chat(client, url: str, body: dict, *, user: int = 0, turn: int = 0,
                      clock=time.perf_counter) -> Reply:
    """POST `body` to `url` (a chat completions endpoint) streamed, and time the reply as it arrives."""
    httpx = lazy.need("httpx", "sparq-cpp bench serve")
    rep = Reply(user=user, turn=turn, t_send=clock())
    done = False
    try:
        async with client.stream("POST", url, json={**body, "stream": True}) as r:
            rep.status = r.status_code
            if r.status_code != 200:
                rep.error = f"HTTP {r.status_code}: {_message(await r.aread())}"
                rep.t_end = clock()
                return rep
            async for line in r.aiter_lines():
                now = clock()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rep.error = f"the server reported an error in the stream: {_message(event)}"
                    break
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content is None:
                        content = choice.get("text")  # /v1/completions
                    if content is not None:  # a generated token (its text may wait for the rest of a character)
                        rep.t_first = now if rep.t_first is None else rep.t_first
                        rep.token_times.append(now)
                        rep.text += content
                    if choice.get("finish_reason"):
                        rep.finish_reason = choice["finish_reason"]
                if event.get("timings"):
                    rep.timings = event["timings"]
                if event.get("usage"):
                    rep.usage = event["usage"]
    except httpx.HTTPError as e:
        rep.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except ValueError as e:  # a data line that is not JSON
        rep.error = f"the stream held something that is not JSON ({e})"
    rep.t_end = clock()
    if rep.error is None and not done:
        rep.error = "the stream ended before [DONE]"
    return rep


@dataclass
class Conversation:
    """One user's turns: the first message (the document and a question), then follow-up questions."""
    user: int
    messages: list  # the user's messages, one per turn


async def run_users(base_url: str, conversations: list, *, max_tokens: int, timeout_s: float = 600,
                    ignore_eos: bool = True, on_reply=None, clock=time.perf_counter) -> tuple:
    """All conversations at once, each its turns in order (a turn's answer joins the next turn's prompt, so the
    server can take the conversation so far from its slot's cache). Returns (replies, t0, wall seconds).
    A failed turn ends its user's conversation (its next prompt would lack the answer)."""
    httpx = lazy.need("httpx", "sparq-cpp bench serve")
    replies: list = []

    async def user(conv: Conversation, client):
        history = []
        for turn, text in enumerate(conv.messages):
            history.append({"role": "user", "content": text})
            body = {"messages": history, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": True,
                    "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
            rep = await stream_chat(client, "/v1/chat/completions", body, user=conv.user, turn=turn, clock=clock)
            replies.append(rep)
            if on_reply is not None:
                on_reply(rep)
            if not rep.ok:
                return
            history.append({"role": "assistant", "content": rep.text})

    limits = httpx.Limits(max_connections=len(conversations) + 4, max_keepalive_connections=len(conversations) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = clock()
        await asyncio.gather(*(user(c, client) for c in conversations))
        wall = clock() - t0
    return replies, t0, wall


# ---- what the replies add up to ------------------------------------------------------------

def union_seconds(intervals) -> float:
    """The length of the union of (start, end) intervals."""
    return sum(b - a for a, b in merged(intervals))


def merged(intervals) -> list:
    """The union of (start, end) intervals as disjoint sorted intervals."""
    out = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


def minus(intervals, holes) -> list:
    """The union of `intervals` without the union of `holes`, as disjoint sorted intervals."""
    out, holes = [], merged(holes)
    for a, b in merged(intervals):
        for h0, h1 in holes:
            if h1 <= a or h0 >= b:
                continue
            if h0 > a:
                out.append((a, h0))
            a = max(a, h1)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def percentiles(values, qs=(50, 95, 99)) -> dict:
    """{'p50': ..., ...} of the values (linear interpolation), {} when there are none."""
    if not len(values):
        return {}
    a = np.asarray(values, float)
    out = {f"p{q:g}": float(np.percentile(a, q)) for q in qs}
    out.update(mean=float(a.mean()), max=float(a.max()), n=int(a.size))
    return out


def summarize(replies: list, wall_s: float) -> dict:
    """One phase's figures: aggregate decode tokens/s, TTFT, inter-token latency, prompt tokens/s, the prompt
    cache's share, and the failed requests with their errors.

    decode_tokens_per_s: the tokens after each reply's first, over the time some reply was decoding (the union of
    [first token, last token] over replies): the rate the users get together while the server decodes.
    decode_only_tokens_per_s: the same over the part of that time when no request was waiting for its first token
    (no prompt in the server's batch): the decode rate without the stalls prompts cause, None when there was none.
    output_tokens_per_s: every generated token over the phase's wall time (prompts included).
    prompt_tokens_per_s: the prompt tokens the server processed (cached ones left out) over the time some request
    waited for its first token.
    itl_decode_only_s: the inter-token gaps during which no request waited for its first token: decode steps with
    no prompt in the server's batch, where a stall of the cache's upkeep or of a restore would show (a gap beside
    a prompt is that prompt's processing, which llama-server batches with the decoding slots).
    """
    ok = [r for r in replies if r.ok]
    failed = [{"user": r.user, "turn": r.turn, "status": r.status, "error": r.error} for r in replies if not r.ok]
    timed = [r for r in ok if r.t_first is not None]
    decode_tokens = sum(max(0, r.n_tokens - 1) for r in timed)
    decode_time = union_seconds((r.token_times[0], r.token_times[-1]) for r in timed)
    prompt_n = sum(int(r.timings.get("prompt_n", 0)) for r in ok)
    cache_n = sum(int(r.timings.get("cache_n", 0)) for r in ok)
    prompt_windows = [(r.t_send, r.t_first) for r in timed]
    prompt_time = union_seconds(prompt_windows)
    quiet = minus([(r.token_times[0], r.token_times[-1]) for r in timed], prompt_windows)
    quiet_time = sum(b - a for a, b in quiet)
    quiet_tokens = sum(any(a < t <= b for a, b in quiet) for r in timed for t in r.token_times[1:])
    gaps = [g for r in timed for g in r.gaps]
    itl = percentiles(gaps, (50, 99))
    waits = merged(prompt_windows)
    alone = [b - a for r in timed for a, b in zip(r.token_times, r.token_times[1:])
             if not any(h0 < b and a < h1 for h0, h1 in waits)]
    itl_alone = percentiles(alone, (50, 99))
    with_timings = [r for r in ok if "cache_n" in r.timings]
    followups = [r for r in with_timings if r.turn > 0]
    turns = sorted({r.turn for r in timed})
    return {
        "requests": len(replies), "failed": len(failed), "errors": failed,
        "generated_tokens": sum(r.n_tokens for r in ok),
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else None,
        "decode_only_tokens_per_s": quiet_tokens / quiet_time if quiet_time > 0 else None,
        "decode_only_s": quiet_time,
        "output_tokens_per_s": sum(r.n_tokens for r in ok) / wall_s if wall_s > 0 else None,
        "wall_s": wall_s,
        "ttft_s": percentiles([r.ttft for r in timed], (50, 95)),
        "ttft_by_turn_s": {str(t): percentiles([r.ttft for r in timed if r.turn == t], (50, 95)) for t in turns},
        "itl_s": itl,
        "itl_p99_over_p50": itl["p99"] / itl["p50"] if itl and itl["p50"] > 0 else None,
        "itl_decode_only_s": itl_alone,
        "itl_decode_only_p99_over_p50": (itl_alone["p99"] / itl_alone["p50"] if itl_alone and itl_alone["p50"] > 0
                                         else None),
        "prompt_tokens": prompt_n, "prompt_tokens_cached": cache_n,
        "prompt_tokens_per_s": prompt_n / prompt_time if prompt_time > 0 and prompt_n else None,
        "prompt_cache": {
            "requests_from_cache": (sum(r.timings["cache_n"] > 0 for r in with_timings) / len(with_timings)
                                    if with_timings else None),
            "followups_from_cache": (sum(r.timings["cache_n"] > 0 for r in followups) / len(followups)
                                     if followups else None),
            "cached_token_share": cache_n / (cache_n + prompt_n) if cache_n + prompt_n else None,
        },
    }
