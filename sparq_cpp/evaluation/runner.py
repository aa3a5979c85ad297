"""Run tasks x methods x compression targets on one GGUF: every sample once per setting, a record each.

Per sample and backend context the prompt but its last token is prefilled once (dense); each
setting then rewinds to it, so the last prompt token and every predicted token go through the
method: teacher-forced rows for bits per character, greedy steps (argmax, ties to the lower token
id) for the generation tasks. The settings come from sweep.py at the sample's S (its prompt
length); the ratio each run actually achieved over its steps is recorded.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sparq_cpp import lazy
from sparq_cpp.errors import SparqError
from sparq_cpp.evaluation import sweep, tasks
from sparq_cpp.evaluation.methods import LlamaSession, MethodSpec, mean_value_default, with_mean_value
from sparq_cpp.gguf_check import check_gguf, check_sparse

# the reference backend (sparq_cpp/evaluation/ref_session.py) needs numba, the [reference] extra
REFERENCE_METHODS = "the reference methods (exact-topk, h2o, lm-infinite, METHOD@ref)"

LN2 = math.log(2.0)


@dataclass
class EvalConfig:
    model_path: Path
    tasks: list
    methods: list                      # MethodSpec
    ratios: list                       # floats in (0, 1]
    task_cfg: tasks.TaskConfig = field(default_factory=tasks.TaskConfig)
    data: dict = field(default_factory=dict)   # task -> path
    cache_type: str = "f16"
    threads: int | None = None
    sparq_r: int | None = None
    loki_d: int | None = None
    sparq_local: float = 0.25         # SparQ's l as a share of k
    loki_local: float = 0.0           # Loki's
    sink: int = 0                      # SparQ's and Loki's first positions always kept
    mean_value: bool | None = None     # None: on for MHA, off for GQA (the paper's choice)
    loki_projection: str | None = None
    seed: int = 0
    progress: bool = True


def nll_bits(logits: np.ndarray, targets) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    return (lse - x[np.arange(len(targets)), targets]) / LN2


def _margin(logits: np.ndarray) -> float:
    """How far the greedy token's logit is above the next best: where two backends' generations part, a
    margin below their logits' rounding differences is a tie that either may break, not a disagreement."""
    if len(logits) < 2:
        return float("inf")
    top2 = np.partition(np.asarray(logits, dtype=np.float64), -2)[-2:]
    return float(top2[1] - top2[0])


def check_lengths(task: str, samples, n_ctx_train: int, model_name: str) -> None:
    for s in samples:
        if s.n_tokens > n_ctx_train:
            raise SparqError(f"{task} sample {s.id} needs {s.n_tokens} tokens ({len(s.prompt)} prompt + "
                             f"{s.n_tokens - len(s.prompt)} predicted), longer than the model's context "
                             f"({n_ctx_train} tokens, n_ctx_train of {model_name}); use shorter --context/--lengths")


def check_requested(cfg: EvalConfig, n_ctx_train: int, model_name: str) -> None:
    """Catch a too-long request before any tokenizing: the sizes the options ask for."""
    tc = cfg.task_cfg
    asks = {"bpc": ("--context + --continuation", tc.context + tc.continuation),
            "repetition": ("--context + --max-new", tc.context + tc.max_new),
            "needle": ("--lengths", max(tc.lengths)), "kv": ("--lengths", max(tc.lengths)),
            "copy": ("--context + --copy-words", tc.context + tc.copy_words)}
    for task in cfg.tasks:
        what, n = asks[tasks.base(task)]
        if n > n_ctx_train:
            raise SparqError(f"{task}: {what} asks for {n} tokens, longer than the model's context "
                             f"({n_ctx_train} tokens, n_ctx_train of {model_name})")


def _plan(methods, ratios):
    """(spec, target) pairs: dense once at 1, every other method at each target below 1."""
    runs = []
    for spec in methods:
        if spec.method == "dense":
            runs.append((spec, 1.0))
        else:
            runs += [(spec, r) for r in ratios if r < 1]
    return runs


def run(cfg: EvalConfig, log=print) -> dict:
    summary = check_gguf(cfg.model_path)
    D = summary.head_dim
    for task in cfg.tasks:
        if tasks.base(task) not in tasks.TASKS or (tasks.base(task) != task and tasks.base(task) != "bpc"):
            raise SparqError(f"unknown task {task!r} (known: {', '.join(tasks.TASKS)}, bpc:DOMAIN)")
    for task in cfg.data:
        if task not in cfg.tasks:
            raise SparqError(f"--data names task {task!r}, which is not among --tasks ({', '.join(cfg.tasks)})")
    check_requested(cfg, summary.n_ctx_train, summary.path.name)
    mean_value = mean_value_default(summary.n_head, summary.n_head_kv, cfg.mean_value)
    skipped = []
    methods = []
    for spec in cfg.methods:
        if spec.method == "loki" and spec.backend == "ref" and cfg.loki_projection is None:
            raise SparqError("loki on the reference needs a projection: --loki-pca FILE (from `sparq-cpp calibrate`)")
        methods.append(spec)
    for spec in methods:
        if spec.method != "dense":  # every other method selects positions of an ordinary KV cache
            check_sparse(summary, spec.label)
    runs = _plan(methods, cfg.ratios)

    tok = tasks.Tokenizer(cfg.model_path)
    ref_model = None
    if any(s.backend == "ref" for s, _ in runs):
        ref_model = lazy.need("sparq_cpp.evaluation.ref_session", REFERENCE_METHODS).load_llama(cfg.model_path)

    built = {}
    for task in cfg.tasks:
        samples = tasks.build(task, tok, cfg.task_cfg, cfg.data.get(task), seed=cfg.seed)
        check_lengths(task, samples, summary.n_ctx_train, summary.path.name)
        built[task] = samples

    records = []
    total = sum(len(s) for s in built.values()) * len(runs)
    bar = _progress(total, cfg.progress)
    try:
        for task, samples in built.items():
            n_ctx = min(summary.n_ctx_train, -(-(max(s.n_tokens for s in samples) + 1) // 32) * 32)
            sessions = _open_sessions(cfg, runs, samples[0].kind, n_ctx, mean_value, ref_model,
                                      alisa_c=_alisa_c_max(runs, samples, D, cfg))
            try:
                for sample in samples:
                    for key, session in sessions.items():
                        session.prefill(sample.prompt[:-1])
                        for spec, target in runs:
                            if _session_key(spec, _shares_dense(runs)) != key:
                                continue
                            rec = _run_one(session, spec, target, sample, tok, D, cfg, mean_value, skipped)
                            if rec is not None:
                                records.append(rec)
                            bar.update(1)
            finally:
                for s in sessions.values():
                    s.close()
    finally:
        bar.close()

    return {"config": _config_doc(cfg, mean_value), "model": _model_doc(summary), "records": records,
            "skipped": skipped}


def _session_key(spec: MethodSpec, shared_dense: bool = False):
    """Which backend context runs spec. exact-topk on llama.cpp is SparQ with r = D: the SparQ context. With
    shared_dense, llama.cpp's dense runs use it too (one prefill less per sample: at 8k tokens most of a
    sample's time)."""
    if spec.backend != "llama":
        return ("ref",)
    if spec.method == "exact-topk" or (shared_dense and spec.method == "dense"):
        return ("llama", "sparq")
    return (spec.backend, spec.method)


def _shares_dense(runs) -> bool:
    """Whether the runs open a SparQ context (sparq or exact-topk on llama.cpp), whose prefill dense can share."""
    return any(s.backend == "llama" and s.method in ("sparq", "exact-topk") for s, _ in runs)


def _alisa_c_max(runs, samples, D, cfg) -> float | None:
    """The largest caching ratio alisa@llama is run with on these samples: its context keeps the window for it."""
    cs = [p["c"] for spec, target in runs if spec.method == "alisa" and spec.backend == "llama" for s in samples
          if (p := sweep.settings("alisa", target, len(s.prompt), D)) is not None]
    return max(cs) if cs else None


def _open_sessions(cfg, runs, kind, n_ctx, mean_value, ref_model, alisa_c=None):
    sessions = {}
    for spec, _ in runs:
        key = _session_key(spec, _shares_dense(runs))
        spec = MethodSpec("sparq", "llama") if key == ("llama", "sparq") else spec
        if key in sessions:
            continue
        if spec.backend == "llama":
            sessions[key] = LlamaSession(cfg.model_path, spec.method, n_ctx=n_ctx, cache_type=cfg.cache_type,
                                         threads=cfg.threads, mean_value=mean_value,
                                         loki_projection=cfg.loki_projection,
                                         alisa_c=alisa_c)
        else:
            if cfg.cache_type not in ("f32", "f16"):
                raise SparqError(f"the reference stores f32 or f16 caches, not {cfg.cache_type}; "
                                 "use --cache-type f16 with reference methods")
            RefSession = lazy.need("sparq_cpp.evaluation.ref_session", REFERENCE_METHODS).RefSession
            sessions[key] = RefSession(ref_model, cache_type=cfg.cache_type, loki_projection=cfg.loki_projection,
                                       model_path=cfg.model_path)
    return sessions


def _run_one(session, spec, target, sample, tok, D, cfg, mean_value, skipped):
    S = len(sample.prompt)
    params = sweep.settings(spec.method, target, S, D, r=cfg.sparq_r, d=cfg.loki_d, local=cfg.sparq_local, loki_local=cfg.loki_local,
                            sink=cfg.sink)
    if params is None:
        reason = f"{spec.label} cannot reach compression {target:g} at S={S} (D={D})"
        if not any(s.get("method") == spec.label and s.get("target") == target and s.get("task") == sample.task
                   for s in skipped):
            skipped.append({"task": sample.task, "method": spec.label, "target": target, "reason": reason})
        return None
    session.rewind()
    if spec.backend == "llama":
        session.use(params, spec.method)
    else:
        session.use_attention(session.make(spec.method, with_mean_value(params, mean_value)))
    t0 = time.perf_counter()
    rec = {"task": sample.task, "sample": sample.id, "method": spec.label, "backend": spec.backend,
           "target": target, "params": with_mean_value(params, mean_value) if spec.method == "sparq" else params,
           "S": S, "meta": sample.meta}
    if sample.kind == "score":
        fed = [sample.prompt[-1]] + sample.target[:-1]
        if isinstance(session, LlamaSession):  # one decode step per token, one row of logits at a time
            bits = session.score(fed, sample.target)
        else:  # the reference returns the fed tokens' logits only
            bits = nll_bits(session.feed(fed), sample.target)
        steps = [S + i for i in range(len(sample.target))]
        rec.update(score=float(bits.sum() / max(sample.n_chars, 1)), bits=float(bits.sum()), chars=sample.n_chars,
                   tokens=len(sample.target))
    else:
        logits = session.feed([sample.prompt[-1]])[-1]
        out, steps, margins = [], [], []
        while True:
            steps.append(S + len(out))
            t = int(np.argmax(logits))
            out.append(t)
            margins.append(_margin(logits))
            if t == tok.eos or len(out) >= sample.max_new:
                break
            logits = session.feed([t])[-1]
        text = tok.decode([t for t in out if t != tok.eos], prev=sample.prompt)
        rec.update(score=tasks.score_generation(sample, text), output=text, output_tokens=out,
                   output_margins=margins, reference=sample.reference)
    rec["ratio"] = sweep.ratio_over_steps(spec.method, params, steps, D)
    rec["seconds"] = time.perf_counter() - t0
    return rec


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total, enabled):
    if not enabled:
        return _NoBar()
    return tqdm(total=total, desc="eval", unit="run", leave=False, dynamic_ncols=True)


def _config_doc(cfg: EvalConfig, mean_value: bool) -> dict:
    return {"model_path": str(cfg.model_path), "tasks": list(cfg.tasks), "methods": [m.label for m in cfg.methods],
            "ratios": list(cfg.ratios), "task": dataclasses.asdict(cfg.task_cfg),
            "data": {k: str(v) for k, v in cfg.data.items()}, "cache_type": cfg.cache_type,
            "sparq_r": cfg.sparq_r, "sparq_local": cfg.sparq_local, "loki_local": cfg.loki_local, "loki_d": cfg.loki_d, "sink": cfg.sink,
            "mean_value": mean_value,
            "loki_projection": cfg.loki_projection, "seed": cfg.seed}


def _model_doc(s) -> dict:
    return {"name": s.name, "path": str(s.path), "n_layer": s.n_layer, "n_head": s.n_head, "n_head_kv": s.n_head_kv,
            "head_dim": s.head_dim, "n_ctx_train": s.n_ctx_train, "n_vocab": s.n_vocab}
