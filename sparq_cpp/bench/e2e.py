"""End-to-end token latency against sequence length S, for dense and sparse attention in llama.cpp.

For each depth S and mode, a context is filled with S positions, then single-token decodes are
timed as generation runs them: the first step after the fill (after a state load it pays SparQ's cache
upkeep: the V sums; a SparQ state carries K^T, as a state saved by a SparQ context does), `warmup` steps, then `repeats` steady steps, each at the next position (S, S+1, ...: the
depth grows by at most a few dozen tokens, under 1% at 4k). Then, reported apart, `repeats` steps
each right after removing the last token (`llama_memory_seq_rm(mem, 0, pos, -1)`, outside the
timing), as speculative decoding, prompt reuse and regenerate do. A step is `llama_decode` +
`llama_synchronize`: embedding, every layer, the output head.

Two ways to reach depth S:
  - synthetic (default): a llama.cpp sequence-state blob written here (sparq_cpp/bench/stateblob.py) with S
    positions of random K and V rows at the model's scale, loaded with `llama_state_seq_set_data`.
    Nothing is computed, so 32k positions take seconds instead of an hour of prefill on 2 cores.
  - prefill: the real thing, random tokens through the model in batches of 512.
`--fill both` does both where prefill is affordable (S <= prefill_max), in two contexts whose
timed steps alternate, and checks that the decode latencies agree within 5%: decode cost depends
on the cache's size, not on its values.

The transfer model (sparq_cpp/bench/transfer_model.py) gives the bytes each token reads; the machine's read
bandwidth is measured (sparq_cpp/bench/machine.py); the bound on a mode's speed-up is
bytes(baseline) / bytes(mode), where the baseline is the faster of the f16 dense modes
(dense-fa, dense-nofa) measured at that S.
"""
from __future__ import annotations

import ctypes
import datetime as _dt
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sparq_cpp import lazy
from sparq_cpp.attention import Dense, Loki, SparQ
from sparq_cpp.bench import machine
from sparq_cpp.bench.stateblob import KVLayout, sparse_layout, synthetic_state
from sparq_cpp.bench.transfer_model import token_bytes
from sparq_cpp.bindings import sparse_api
from sparq_cpp.errors import SparqError
from sparq_cpp.lazy import llama_cpp as import_llama_cpp
from sparq_cpp.llm import llama_class
from sparq_cpp.memory import ModelShape
from sparq_cpp.outfile import atomic_write, fmt_bytes
from sparq_cpp.pyext.build import installed_build
# the bench by job: settings (e2e_config), memory planning (e2e_memory), the model (e2e_model), results (e2e_report)
from sparq_cpp.bench.e2e_config import BASELINE_MODES, MODES, SCHEMA, BenchConfig, Mode, fmt_depth, validate
from sparq_cpp.bench.e2e_memory import ubatch as _ubatch, depth_estimate, fills_at, group_estimate, n_ctx_for, plan_groups
from sparq_cpp.bench.e2e_model import ensure_model, kv_scales, loki_projection, plan_model
from sparq_cpp.bench.e2e_report import faster_baseline, fill_agreement, plot, summarize

# ---- running -----------------------------------------------------------------------------

class _Context:
    """One llama.cpp context for a mode, with the low-level handles the steps need."""

    def __init__(self, path, shape: ModelShape, mode: Mode, cfg: BenchConfig, depth: int, fills: list):
        Llama = llama_class()
        self.lc = import_llama_cpp()
        self.mode, self.depth = mode, depth
        self.pos = depth  # the position of the next step
        n_ctx = n_ctx_for(depth, step_headroom(cfg))
        self.n_batch = _ubatch(fills, n_ctx, cfg.prefill_batch)
        if mode.dense:
            att = Dense()
        elif mode.kind == "loki":
            att = Loki(d=cfg.d, k=cfg.k, l=cfg.loki_l, projection=cfg.loki_pca, sink=cfg.sink)
        else:
            att = SparQ(r=cfg.r, k=cfg.k, l=cfg.l, mean_value=cfg.mean_value, sink=cfg.sink)
        self.llm = Llama(path, att, cache_type=mode.cache_type, n_ctx=n_ctx, n_batch=self.n_batch,
                         n_ubatch=self.n_batch, n_threads=cfg.threads, n_threads_batch=cfg.threads,
                         flash_attn=mode.flash_attn, seed=cfg.seed, logits_all=False)
        self.batch = None
        try:
            self.ctx = self.llm._ctx.ctx
            self.mem = self.lc.llama_get_memory(self.ctx)
            self.layout = KVLayout(shape.n_layer, shape.n_embd_kv, shape.n_embd_kv, mode.cache_type,
                                   not mode.flash_attn)
            # the header a state of this context starts with (SparQ: its blobs carry K^T, as saved states do)
            self.sparse = sparse_layout(self._seq_state())
            self.attention = self._attention_in_effect()
            want = {"sparq": 1, "loki": 2}.get(mode.kind, 0)
            if not mode.dense and self.attention.get("mode") != want:
                raise SparqError(f"{mode.name}: the context did not switch {mode.kind} on ({self.attention})")
            if mode.dense and self.attention.get("mode", 0) != 0:
                raise SparqError(f"{mode.name}: the context runs sparse attention ({self.attention})")
            self.batch = self.lc.llama_batch_init(max(1, self.n_batch), 0, 1)
        except BaseException:
            self.llm.close()
            raise

    def _seq_state(self) -> bytes:
        n = self.lc.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * n)()
        return bytes(buf[:self.lc.llama_state_seq_get_data(self.ctx, buf, n, 0)])

    def _attention_in_effect(self) -> dict:
        if not sparse_api.available():
            return {"mode": 0, "api": "stock build"}
        return sparse_api.as_dict(sparse_api.get_params(self.ctx))

    def close(self):
        if self.batch is not None:
            self.lc.llama_batch_free(self.batch)
            self.batch = None
        self.llm.close()

    def clear(self):
        self.lc.llama_memory_clear(self.mem, True)

    def pos_max(self) -> int:
        return self.lc.llama_memory_seq_pos_max(self.mem, 0)

    def _set_batch(self, tokens, pos0: int, last_logits: bool):
        b = self.batch
        for i, t in enumerate(tokens):
            b.token[i] = int(t)
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 0
        if last_logits:
            b.logits[len(tokens) - 1] = 1
        b.n_tokens = len(tokens)

    def fill_synthetic(self, depth: int, k_std, v_std, seed: int, progress=None) -> float:
        t0 = time.perf_counter()
        blob = synthetic_state(self.layout, depth, seed=seed, k_std=k_std, v_std=v_std, sparse=self.sparse,
                               progress=progress)
        self.clear()
        t_load = time.perf_counter()
        n = self.lc.llama_state_seq_set_data(self.ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                             len(blob), 0)
        self.state_load_s, self.state_bytes = time.perf_counter() - t_load, len(blob)
        size = len(blob)
        del blob
        if n != size:
            raise SparqError(f"{self.mode.name}: llama.cpp did not load the synthetic state at S={depth} "
                             f"(read {n} of {size} bytes)")
        if self.pos_max() != depth - 1:
            raise SparqError(f"{self.mode.name}: after the state load the cache ends at {self.pos_max()}, "
                             f"not {depth - 1}")
        self.pos = depth
        return time.perf_counter() - t0

    def fill_prefill(self, depth: int, seed: int, n_vocab: int, progress=None) -> float:
        rng = np.random.default_rng([seed, depth])
        tokens = rng.integers(3, n_vocab, depth)
        self.clear()
        t0 = time.perf_counter()
        for p0 in range(0, depth, self.n_batch):
            chunk = tokens[p0:p0 + self.n_batch]
            self._set_batch(chunk, p0, last_logits=p0 + len(chunk) == depth)
            rc = self.lc.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise SparqError(f"{self.mode.name}: llama_decode failed during prefill at {p0} (code {rc})")
            if progress:
                progress(len(chunk))
        self.lc.llama_synchronize(self.ctx)
        if self.pos_max() != depth - 1:
            raise SparqError(f"{self.mode.name}: after prefill the cache ends at {self.pos_max()}, not {depth - 1}")
        self.pos = depth
        return time.perf_counter() - t0

    def step(self, token: int, rewind: bool = False) -> tuple:
        """One timed single-token decode at the next position, or with `rewind` at the last position
        again after removing it (untimed): (seconds, seconds our threads waited for a CPU during it or None)."""
        if rewind:
            if not self.lc.llama_memory_seq_rm(self.mem, 0, self.pos - 1, -1) or self.pos_max() != self.pos - 2:
                raise SparqError(f"{self.mode.name}: could not remove position {self.pos - 1}")
            self.pos -= 1
        depth = self.pos
        self._set_batch([token], depth, last_logits=True)
        w0 = machine.run_queue_wait_ns()
        t0 = time.perf_counter()
        rc = self.lc.llama_decode(self.ctx, self.batch)
        self.lc.llama_synchronize(self.ctx)
        dt = time.perf_counter() - t0
        w1 = machine.run_queue_wait_ns()
        wait = (w1 - w0) * 1e-9 if w0 is not None and w1 is not None else None
        if rc != 0:
            raise SparqError(f"{self.mode.name}: llama_decode failed at S={depth} (code {rc})")
        if self.pos_max() != depth:
            raise SparqError(f"{self.mode.name}: the decode did not land at position {depth}")
        self.pos += 1
        return dt, wait


def step_headroom(cfg: BenchConfig) -> int:
    """Positions the steps may add beyond the depth: the first, warm-up, timed and retried steps."""
    max_extra = cfg.max_extra_steps if cfg.max_extra_steps is not None else 3 * cfg.repeats
    return 1 + cfg.warmup + cfg.repeats + max_extra


def _warmup_steps(cfg: BenchConfig, mode: Mode, fill: str) -> int:
    """Steps after the first one, untimed (the first step is timed and reported on its own)."""
    return cfg.warmup


def _stats(samples: list) -> dict:
    a = np.asarray(samples, float)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median_s": float(med), "q1_s": float(q1), "q3_s": float(q3), "min_s": float(a.min()),
            "max_s": float(a.max()), "mean_s": float(a.mean())}


def _sample_stats(rec: dict, repeats: int) -> dict:
    """Median, IQR, ... of a record's undisturbed steps when there are at least half of `repeats`
    of them, else of all its steps."""
    good = [t for t, bad in zip(rec["samples_s"], rec["disturbed"]) if not bad]
    use_good = len(good) >= max(1, -(-repeats // 2))
    return {"stats_from": "undisturbed steps" if use_good else "all steps (machine busy throughout)",
            "n_used": len(good) if use_good else len(rec["samples_s"]),
            **_stats(good if use_good else rec["samples_s"])}


def pool_rounds(results: list, repeats: int) -> list:
    """One record per (depth, mode, fill) from the records of several rounds: their steps pooled,
    the statistics over the pool (a round whose window hit a slow spell, or whose contexts landed
    badly in memory, is outvoted), and each round's own median kept under "rounds"."""
    pooled: dict = {}
    for r in results:
        key = (r["depth"], r["mode"], r["fill"])
        if key not in pooled:
            pooled[key] = {**{k: v for k, v in r.items() if k != "round"}, "samples_s": [], "run_queue_wait_s": [],
                           "disturbed": [], "first_step_s": [], "warmup_s": [], "rewind_step_s": [], "fill_s": 0.0,
                           "state_load_s": [], "rounds": []}
        p = pooled[key]
        for f in ("samples_s", "run_queue_wait_s", "disturbed", "first_step_s", "warmup_s", "rewind_step_s",
                  "state_load_s"):
            p[f] = p[f] + list(r.get(f, []))  # runs written before the first step was timed have none
        p["fill_s"] += r["fill_s"]
        p["rounds"].append({k: r[k] for k in ("median_s", "q1_s", "q3_s", "n_used", "timed_with",
                                               "other_processes_cpu_share", "waited_for_quiet_s")})
    out = []
    for p in pooled.values():
        p.update(_sample_stats(p, repeats * len(p["rounds"])))
        p["effective_gbs"] = p["bytes"]["total"] / p["median_s"] / 1e9
        out.append(p)
    return out


def _run_group(path, shape, modes: list, cfg: BenchConfig, depth: int, fills: list, token: int, k_std, v_std,
               bar) -> list:
    """Time some modes at one depth: one context per (mode, fill), each filled and warmed up, then
    their timed steps alternate in turns (mode A synthetic, A prefill, B synthetic, ...) so that a slow
    spell of a shared machine hits them all alike. A turn is `block` steps of one context back to back
    after one untimed step (kept as "settle_s"): a mode's steps then meet the caches and clocks that its
    own steps leave, as when it runs alone, not those of the mode timed before it.

    A step during which our threads waited for a CPU for more than `disturbed_frac` of its time
    (another process took a core) is kept in the JSON but marked disturbed, and another step is
    taken instead, up to `max_extra_steps` more steps per context and `max_retry_s` seconds. The
    statistics use the undisturbed steps when there are at least half of `repeats` of them, else
    all steps (and the record says so).
    """
    tag = f"S={fmt_depth(depth)} {','.join(m.name for m in modes)}"
    ctxs, fill_s, first, warm, samples, load = {}, {}, {}, {}, {}, {}
    max_extra = cfg.max_extra_steps if cfg.max_extra_steps is not None else 3 * cfg.repeats
    try:
        for mode in modes:
            for fill in fills:
                key = (mode.name, fill)
                bar.set_postfix_str(f"S={fmt_depth(depth)} {mode.name}: {fill} fill")
                c = ctxs[key] = _Context(path, shape, mode, cfg, depth, [fill])
                if fill == "synthetic":
                    fill_s[key] = c.fill_synthetic(depth, k_std, v_std, cfg.seed)
                    # the load alone (llama_state_seq_set_data), as a user restoring a saved state pays it
                    load[key] = {"state_load_s": [c.state_load_s], "state_bytes": c.state_bytes}
                else:
                    fill_s[key] = c.fill_prefill(depth, cfg.seed, shape.n_vocab)
        waited = 0.0
        if cfg.wait_quiet > 0:
            bar.set_postfix_str(f"{tag}: waiting for a quiet machine")
            waited = machine.wait_quiet(cfg.wait_quiet)
        bar.set_postfix_str(f"{tag}: decode")
        mon = machine.CpuMonitor()
        for key, c in ctxs.items():
            # the first step after the fill: after a state load it includes SparQ's cache upkeep
            first[key] = c.step(token)[0]
            bar.update(1)
            warm[key] = []
            for _ in range(_warmup_steps(cfg, MODES[key[0]], key[1])):
                warm[key].append(c.step(token)[0])
                bar.update(1)
            samples[key] = []
        kept = dict.fromkeys(ctxs, 0)
        settle = {key: [] for key in ctxs}
        t_start = time.perf_counter()
        while any(kept[k] < cfg.repeats for k in ctxs):
            for key, c in ctxs.items():
                if kept[key] >= cfg.repeats or len(samples[key]) >= cfg.repeats + max_extra:
                    continue
                # a turn: cfg.block steps of one mode back to back, after one untimed step that pays for the
                # switch (the other modes' working set in the caches, a compute-bound neighbour's clock)
                if len(ctxs) > 1:
                    settle[key].append(c.step(token)[0])
                for _ in range(cfg.block):
                    if kept[key] >= cfg.repeats or len(samples[key]) >= cfg.repeats + max_extra:
                        break
                    dt, wait = c.step(token)
                    disturbed = wait is not None and wait > cfg.disturbed_frac * dt
                    samples[key].append((dt, wait, disturbed))
                    if not disturbed:
                        kept[key] += 1
                        bar.update(1)
                    else:
                        n_dist = sum(x[2] for k in samples for x in samples[k])
                        bar.set_postfix_str(f"{tag}: decode, {n_dist} disturbed")
                        time.sleep(0.2)
            exhausted = all(kept[k] >= cfg.repeats or len(samples[k]) >= cfg.repeats + max_extra for k in ctxs)
            timed_out = (time.perf_counter() - t_start > cfg.max_retry_s
                         and all(len(samples[k]) >= cfg.repeats for k in ctxs))
            if exhausted or timed_out:
                bar.update(sum(max(0, cfg.repeats - kept[k]) for k in ctxs))
                break
        # steps right after a one-token rewind, in turns as above
        bar.set_postfix_str(f"{tag}: decode after a rewind")
        rewind = {key: [] for key in ctxs}
        for _ in range(0, cfg.repeats, cfg.block):
            for key, c in ctxs.items():
                if len(ctxs) > 1:
                    settle[key].append(c.step(token, rewind=True)[0])
                for _ in range(min(cfg.block, cfg.repeats - len(rewind[key]))):
                    rewind[key].append(c.step(token, rewind=True)[0])
                    bar.update(1)
        others = mon.foreign_share()
    finally:
        for c in ctxs.values():
            c.close()
    out = []
    for mode in modes:
        by = token_bytes(shape, mode.kind, depth, mode.cache_type, r=cfg.r, k=cfg.k, d=cfg.d)
        for fill in fills:
            key = (mode.name, fill)
            rec = {"depth": depth, "mode": mode.name, "fill": fill, "samples_s": [x[0] for x in samples[key]],
                   "run_queue_wait_s": [x[1] for x in samples[key]], "disturbed": [x[2] for x in samples[key]]}
            rec.update(_sample_stats(rec, cfg.repeats))
            out.append({**rec, "first_step_s": [first[key]], "warmup_s": warm[key], "rewind_step_s": rewind[key],
                        "settle_s": settle[key], "block": cfg.block,
                        "fill_s": fill_s[key], **load.get(key, {}), "bytes": by,
                        "effective_gbs": by["total"] / rec["median_s"] / 1e9,
                        "attention": ctxs[key].attention, "n_ctx": n_ctx_for(depth, step_headroom(cfg)),
                        "timed_with": [m.name for m in modes],
                        "other_processes_cpu_share": others, "waited_for_quiet_s": waited})
    return out


def build_record() -> dict | None:
    rec = installed_build()
    if rec is None:
        return None
    return {k: rec.get(k) for k in ("key", "series_hash", "options", "patches", "pin")}


def run(cfg: BenchConfig, log=print) -> dict:
    """Run the sweep and return the result (the JSON document); writes --json and --plot if set."""
    cfg = validate(cfg)
    path, shape, how, to_write = plan_model(cfg)
    max_depth = max(cfg.depths)
    if max_depth + 1 > shape.n_ctx_train and not cfg.beyond_train_ctx:
        raise SparqError(f"--depths: depth {fmt_depth(max_depth)} is beyond the model's context "
                         f"({shape.n_ctx_train} positions, trained); pass --beyond-train-ctx to time it anyway")
    log(f"model     {path} ({how})")
    log(f"          {shape.n_layer} layers, n_embd {shape.n_embd}, {shape.n_head} heads / {shape.n_head_kv} KV heads "
        f"of {shape.head_dim}, n_ff {shape.n_ff}, n_vocab {shape.n_vocab}; weights {fmt_bytes(shape.weight_bytes)}, "
        f"{fmt_bytes(shape.weight_bytes_per_token)} read per token")

    avail = machine.mem_available()
    budget = int(cfg.mem_fraction * avail)
    estimates = {}
    log(f"memory    available {fmt_bytes(avail)}, budget {fmt_bytes(budget)} ({cfg.mem_fraction:.0%}); "
        f"estimated peak per depth (the most demanding mode):")
    for depth in cfg.depths:
        est = depth_estimate(shape, cfg, depth)
        estimates[depth] = est
        log(f"          S={fmt_depth(depth):>5} {est['mode']:<11} {fmt_bytes(est['total']):>10} = weights "
            f"{fmt_bytes(est['weights'])} + KV {fmt_bytes(est['kv_cache'])} + K^T {fmt_bytes(est['k_transposed'])} "
            f"+ compute {fmt_bytes(est['compute'])} + transient {fmt_bytes(est['transient'])} "
            f"+ overhead {fmt_bytes(est['overhead'])}")
    for depth in cfg.depths:
        if estimates[depth]["total"] > budget:
            raise SparqError(f"--depths: depth {fmt_depth(depth)} does not fit this machine's memory: estimated peak "
                             f"{fmt_bytes(estimates[depth]['total'])} ({estimates[depth]['mode']}) > budget "
                             f"{fmt_bytes(budget)}; use fewer --layers or smaller --depths")
    first_base = next((m for m in cfg.modes if m in BASELINE_MODES), None)
    for depth in cfg.depths:
        g = plan_groups(shape, cfg, depth, budget, first_base)
        peak = max(group_estimate(shape, cfg, depth, x)["total"] for x in g)
        log(f"          S={fmt_depth(depth):>5} timed together: {' | '.join(','.join(x) for x in g)} "
            f"(peak {fmt_bytes(peak)})" + ("; the faster dense baseline so far joins the sparse modes"
                                            if len(g) > 1 else ""))

    shape = ensure_model(cfg, path, to_write, log)
    loki_basis = None
    if any(MODES[m].kind == "loki" for m in cfg.modes):
        cfg.loki_pca, loki_basis = loki_projection(cfg, path, shape, log)
        log(f"loki      basis {cfg.loki_pca.name}: {loki_basis}; d={cfg.d}, k={cfg.k}, l={cfg.loki_l}, sink={cfg.sink}")
    info = machine.machine_info()
    log(f"machine   {info['cpu_model']}, {info['cores_usable']} cores, {fmt_bytes(info['mem_total_bytes'] or 0)} RAM; "
        f"{cfg.threads} threads")
    mon = machine.CpuMonitor()
    time.sleep(0.5)
    busy = mon.foreign_share()
    info["other_processes_cpu_share_at_start"] = busy
    if busy is not None and busy > 0.1:
        log(f"warning   other processes use {100 * busy:.0f}% of the CPU right now: timings with {cfg.threads} "
            f"threads will be disturbed (see the 'others' column)")
    if cfg.wait_quiet > 0:
        machine.wait_quiet(cfg.wait_quiet)
    bw = machine.measure_bandwidth(cfg.threads, cfg.bandwidth_bytes)
    log(f"bandwidth {bw['best_gbs']:.1f} GB/s best, {bw['median_gbs']:.1f} median of {len(bw['passes_gbs'])} passes "
        f"({bw['method']}, {fmt_bytes(bw['buffer_bytes'])})")
    build = build_record()
    lib = _library()
    log(f"build     {build['key'] if build else 'none recorded (stock llama-cpp-python?)'}; libllama {lib.get('libllama')}"
        + (" (LLAMA_CPP_LIB_PATH overrides the installed build)" if lib.get("LLAMA_CPP_LIB_PATH") else ""))
    k_std, v_std, scale_how = kv_scales(path, shape)

    tasks = [(d, m, f) for d in cfg.depths for m in cfg.modes for f in fills_at(cfg, d)]
    steps = cfg.rounds * sum(1 + _warmup_steps(cfg, MODES[m], f) + 2 * cfg.repeats for _, m, f in tasks)
    bar = tqdm(total=steps, desc="bench", unit="step", disable=not cfg.progress, leave=False)
    rng = np.random.default_rng(cfg.seed)
    token = int(rng.integers(3, shape.n_vocab))
    results = []
    try:
        # rounds run the whole sweep again (minutes apart for the same depth), with fresh contexts
        for rnd in range(cfg.rounds):
            for depth in cfg.depths:
                fills = fills_at(cfg, depth)
                if rnd == 0:
                    groups = plan_groups(shape, cfg, depth, budget, faster_baseline(results) or first_base)
                    estimates[depth]["groups"] = groups
                    estimates[depth]["group_peak"] = max(group_estimate(shape, cfg, depth, x)["total"] for x in groups)
                    if len(groups) > 1:
                        log(f"S={fmt_depth(depth)}: timing {' | '.join(','.join(x) for x in groups)}")
                for group in estimates[depth]["groups"]:
                    recs = _run_group(path, shape, [MODES[m] for m in group], cfg, depth, fills, token,
                                      k_std, v_std, bar)
                    results += [{**r, "round": rnd} for r in recs]
    finally:
        bar.close()
    results = pool_rounds(results, cfg.repeats)

    doc = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "machine": {**info, "threads": cfg.threads, "bandwidth": bw, "build": build,
                    "llama_cpp_python": _llama_cpp_version(), "library": _library(),
                    "system_info": _system_info()},
        "model": {"path": str(path), "chosen": how, **shape.as_dict()},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "modes": {m: asdict(MODES[m]) for m in cfg.modes},
        "loki_basis": loki_basis,
        "synthetic_kv_scale": scale_how,
        "memory_estimate": {str(d): e for d, e in estimates.items()},
        "transfer_model": "weights touched + docs/spec.md KV reads per layer and KV head, n = S + 1 (sparq_cpp/bench/transfer_model.py)",
        "results": results,
    }
    # measured again at the end: on a shared machine the better of the two is the machine's
    if cfg.wait_quiet > 0:
        machine.wait_quiet(cfg.wait_quiet)
    bw_end = machine.measure_bandwidth(cfg.threads, cfg.bandwidth_bytes)
    bw["at_end"] = bw_end
    bw["at_start_best_gbs"] = bw["best_gbs"]
    bw["best_gbs"] = max(bw["best_gbs"], bw_end["best_gbs"])
    log(f"bandwidth {bw_end['best_gbs']:.1f} GB/s best at the end; using {bw['best_gbs']:.1f} GB/s")
    doc["summary"] = summarize(results, bw["best_gbs"])
    doc["fill_agreement"] = fill_agreement(results)
    if cfg.json_path is not None:
        atomic_write(cfg.json_path, lambda tmp: tmp.write_text(json.dumps(doc, indent=1)), "--json")
    if cfg.plot_path is not None:
        atomic_write(cfg.plot_path, lambda tmp: plot(doc, tmp), "--plot")
    return doc


def _library() -> dict:
    """The libllama actually loaded (LLAMA_CPP_LIB_PATH can point away from the installed build)."""
    try:
        raw = lazy.llama_cpp("llama_cpp")

        return {"libllama": getattr(raw._lib, "_name", None), "LLAMA_CPP_LIB_PATH": os.environ.get("LLAMA_CPP_LIB_PATH")}
    except ImportError:
        return {}


def _llama_cpp_version() -> str | None:
    try:
        llama_cpp = lazy.llama_cpp()

        return llama_cpp.__version__
    except ImportError:
        return None


def _system_info() -> str | None:
    try:
        llama_cpp = lazy.llama_cpp()

        return llama_cpp.llama_print_system_info().decode().strip()
    except Exception:  # noqa: BLE001 (informational only)
        return None
