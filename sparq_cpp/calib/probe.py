"""End-to-end probes of sparse settings on the user's text: the bits per character each setting loses, against
dense on the same samples, on ordinary text and on a retrieval (the `copy` task's layout: a paragraph of the text's
common words, given early and repeated at the end, the repeat scored), every scored token one decode step through
llama.cpp, as generation runs.

calib.budget's layer errors rank settings of one method well, but they do not see a lost retrieval: on Gemma 3 at
1/8, SparQ and Loki with the first position kept have about the same output error per layer, yet SparQ loses the
copy (2.2 bits per character where dense copies at 0.05) and Loki with the first position kept does not
(docs/accuracy.md); within Loki with the first position kept, the local window lowers the layer error on text and
costs the retrieval (d = 16, l = k/4: 0.32 and +0.89 bits per character lost on it; d = 32, l = 0: 0.45 and
+0.00). So `sparq-cpp calibrate` probes, per ratio, method, sink and local window, the rank of least layer error
(`pick`), and `--attn auto` chooses among the probed candidates by the bits per character lost on text plus on the
retrieval (sparq_cpp.auto).

A setting chosen on one kind of text can lose more on another: on Gemma 3 at 1/8, the Loki setting chosen on Austen
loses +1.8% bits per character on held-out Austen, +4.6% on technical documentation and +6.6% on code
(docs/accuracy.md, "Out of domain"). So the text is scored per domain (`domains`: the calibration text's own held-out
part as "text", and the held-out parts of sparq_cpp.train.domains), and the loss auto weighs is that of the domain
that loses most relative to dense's bits per character there.
"""
from __future__ import annotations

import math

import numpy as np

from sparq_cpp.errors import SparqError
from sparq_cpp.evaluation import tasks
from sparq_cpp.evaluation.methods import LlamaSession, mean_value_default
from sparq_cpp.gguf_check import check_gguf

CONTINUATION = 64  # text: tokens scored per sample
COPY_WORDS = 64    # retrieval: words in the repeated paragraph (the second half scored)


def pick(fid: dict) -> list[int]:
    """The candidates to probe: per ratio, method, sink and share of k kept local, the rank of least mean layer
    error."""
    best: dict = {}
    for i, c in enumerate(fid["candidates"]):
        key = (c["ratio"], c["method"], c["sink"], c["l"] > 0)
        err = float(np.mean(fid["error"][i]))
        if key not in best or err < best[key][0]:
            best[key] = (err, i)
    return sorted(i for _, i in best.values())


def _held_out(text: str, tok, skip_tokens: int, need_chars: int) -> str:
    """The text after about its first skip_tokens tokens (those the basis was fitted on), if enough is left."""
    ids = tok.encode(text[:20_000])
    cpt = max(1.0, len(text[:20_000]) / max(len(ids), 1))
    cut = int(skip_tokens * cpt)
    return text[cut:] if len(text) - cut >= need_chars else text


def probe(model_path, projection, text: str, cands: list[dict], idx: list[int], *, S: int, skip_tokens: int = 0,
          n_samples: int = 2, domains: dict[str, str] | None = None, own_text: bool = True, n_threads=None,
          log=lambda msg: None) -> dict:
    """Bits per character lost against dense by the candidates `idx` of `cands` (calib.budget.candidates) on
    n_samples text windows of about S tokens per domain, and on n_samples retrievals of the calibration text's held-out
    part. The domains: that held-out part as "text" (unless own_text is false), then `domains` ({name: held-out
    text}). Returns {"probed": [0/1 per candidate], "domains": [names], "domain_text": [[bits per character over
    dense per domain] per candidate], "domain_dense": [dense's per domain], "text": [the worst domain's loss per
    candidate], "copy": [...] (0 where not probed), "dense_text" (dense's mean over the domains), "dense_copy",
    "samples"}."""
    s = check_gguf(model_path)
    tok = tasks.Tokenizer(model_path)
    ctx = S - CONTINUATION
    need = int(S * 6)  # characters per sample: S tokens at up to ~6 characters each
    source = _held_out(text, tok, skip_tokens, need * n_samples)
    texts = ({"text": source} if own_text else {}) | dict(domains or {})
    if not texts:
        raise SparqError("the end-to-end probe needs a text to score: own_text, or at least one domain")
    bpc_cfg = tasks.TaskConfig(samples=n_samples, context=ctx, continuation=CONTINUATION)
    samples = {}
    for name, body in texts.items():
        try:
            samples[f"text:{name}"] = tasks.bpc_samples(body, tok, bpc_cfg, f"the {name} text")
        except SparqError as e:
            if name == "text" and own_text:
                raise SparqError(f"the end-to-end probe needs {n_samples} windows of {S} tokens of ordinary prose: "
                                 f"{e}") from None
            log(f"the probe leaves out the {name} domain: {e}")
    texts = {name: body for name, body in texts.items() if f"text:{name}" in samples}
    if not texts:
        raise SparqError("the end-to-end probe found no domain text long enough")
    try:
        samples["copy"] = tasks.copy_samples(source, tok, tasks.TaskConfig(samples=n_samples, context=ctx,
                                                                            copy_words=COPY_WORDS), "the text")
    except SparqError as e:
        raise SparqError(f"the end-to-end probe needs {n_samples} windows of {S} tokens of ordinary prose: {e}") from None
    n_ctx = -(-(max(x.n_tokens for v in samples.values() for x in v) + 1) // 32) * 32
    mean_value = mean_value_default(s.n_head, s.n_head_kv, None)
    bits = {kind: np.zeros(len(cands) + 1) for kind in samples}  # the last: dense
    chars = {kind: 0 for kind in samples}
    methods = sorted({cands[i]["method"] for i in idx})
    sessions = {m: LlamaSession(model_path, m, n_ctx=n_ctx, cache_type="f16", threads=n_threads,
                                mean_value=mean_value, loki_projection=projection if m == "loki" else None)
                for m in methods}
    if "sparq" not in sessions:
        sessions["sparq"] = LlamaSession(model_path, "sparq", n_ctx=n_ctx, cache_type="f16", threads=n_threads,
                                         mean_value=mean_value)
    try:
        done = 0
        total = sum(len(v) for v in samples.values())
        for kind, group in samples.items():
            for sample in group:
                fed = [sample.prompt[-1]] + sample.target[:-1]
                chars[kind] += sample.n_chars
                for method, session in sessions.items():
                    session.prefill(sample.prompt[:-1])
                    runs = [i for i in idx if cands[i]["method"] == method] + ([None] if method == "sparq" else [])
                    for i in runs:
                        session.rewind()
                        if i is None:
                            session.use({}, "dense")
                        else:
                            c = cands[i]
                            session.use({"r" if method == "sparq" else "d": c["rank"], "k": c["k"], "l": c["l"],
                                         "sink": c["sink"]})
                        bits[kind][len(cands) if i is None else i] += session.score(fed, sample.target).sum()
                done += 1
                log(f"probe sample {done}/{total}")
    finally:
        for session in sessions.values():
            session.close()
    per = {kind: bits[kind] / max(chars[kind], 1) for kind in samples}
    dense = {kind: float(per[kind][-1]) for kind in samples}
    lost = {}
    for kind in samples:
        lost[kind] = [float(per[kind][i] - dense[kind]) if i in idx else 0.0 for i in range(len(cands))]
        if not all(math.isfinite(x) for x in lost[kind]) or not math.isfinite(dense[kind]):
            raise SparqError(f"the end-to-end probe's {kind} scores are not finite")
    names = list(texts)
    domain_text = [[lost[f"text:{d}"][i] for d in names] for i in range(len(cands))]
    return {"probed": [int(i in idx) for i in range(len(cands))], "samples": n_samples, "domains": names,
            "domain_text": domain_text, "domain_dense": [dense[f"text:{d}"] for d in names],
            "text": [max(row) for row in domain_text], "copy": lost["copy"],
            "dense_text": float(np.mean([dense[f"text:{d}"] for d in names])), "dense_copy": dense["copy"]}
