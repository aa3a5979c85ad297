"""`sparq-cpp bench serve`: many users at long context on the OpenAI-compatible server, per attention mode.

For each depth, number of users N and mode, a server is started through `sparq-cpp serve` (its checks and its
memory estimate apply) with N slots, each of the depth plus the turns' room, and N users talk to it at once
(sparq_cpp/bench/serve_client.py): each over its own document (N different passages of a real text, cut to the depth in the
server's own tokens), a first turn that asks about it, then follow-up turns that send the conversation so far,
which the server takes from the slot's prompt cache. Answers are streamed at temperature 0, every one
--max-tokens long (end of text ignored), so that every mode decodes the same number of tokens.

After the N users, each conversation runs again alone on the same server (its document from its slot's cache), and
the report says whether temperature 0 gave every user the texts it got among the others.

Per (depth, N, mode) the report gives aggregate decode tokens/s (also over the time no prompt waited), TTFT p50/p95, inter-token latency p50/p99,
prompt tokens/s, the server's peak RSS (VmHWM), the caches one user costs (the serve estimate), and the share of
requests served from the prompt cache, with every failed request and its error. The server restarts for every
(depth, N, mode) so that its peak RSS is that setting's; the users of one N get the same documents in every mode.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from sparq_cpp.bench import machine
from sparq_cpp.bench.e2e import build_record
from sparq_cpp.bench.e2e_config import MODES, fmt_depth, parse_depths, parse_modes
from sparq_cpp.bench.serve_client import Conversation, run_users, summarize
from sparq_cpp.bench.server_process import ServerProcess
from sparq_cpp.errors import SparqError
from sparq_cpp.lazy import pyplot
from sparq_cpp.llm import check_threads, default_threads
from sparq_cpp.memory import context_estimate, shape_from_gguf
from sparq_cpp.outfile import atomic_write, check_writable, fmt_bytes
from sparq_cpp.train import corpus

SCHEMA = "sparq-cpp-bench-serve/1"


@dataclass(frozen=True)
class ServeMode:
    name: str
    kind: str  # dense, sparq, loki
    args: tuple  # `sparq-cpp serve`'s options for it
    about: str


def _serve_modes() -> dict:
    """The end-to-end bench's modes (dense-fa, dense-nofa, dense-q8kv, sparq, sparq-q8kv, loki) as `serve`
    options, and `dense`: the server's own choice of flash attention (-fa auto)."""
    out = {"dense": ServeMode("dense", "dense", ("--attn", "dense"), "dense attention, -fa auto, f16 cache")}
    for m in MODES.values():
        args = ("--attn", m.kind, "--cache-type", m.cache_type, "-fa", "on" if m.flash_attn else "off")
        out[m.name] = ServeMode(m.name, m.kind, args, m.about)
    return out


SERVE_MODES = _serve_modes()
DEFAULT_MODES = "dense,sparq"

# What the users ask: the first turn after the document, then follow-ups in turn.
FIRST_QUESTION = "Summarize the passage above in a few sentences."
FOLLOW_UPS = ("What does the passage tell us about its main characters?",
              "Which sentence of the passage matters most, and why?",
              "What might happen next in the story?",
              "Describe the tone of the passage.")
TEMPLATE_ROOM = 64  # tokens of the chat template and the first question beside the document
TURN_ROOM = 48  # tokens of a follow-up question and the chat template around it


@dataclass
class ServeBenchConfig:
    model: Path | None
    users: list = field(default_factory=lambda: [1, 4])
    depths: list = field(default_factory=lambda: [4096])
    modes: list = field(default_factory=lambda: DEFAULT_MODES.split(","))
    turns: int = 2
    max_tokens: int = 64
    threads: int | None = None
    text: Path | None = None  # the documents' text (default: Jane Austen's novels, sparq_cpp/train/corpus.py)
    sparse: tuple = ()  # `serve` options for the sparse modes (--sparq-r 16, --sparse-k 128, ...)
    request_timeout: float = 600.0
    start_timeout: float = 600.0
    json_path: Path | None = None
    plot_path: Path | None = None
    log_dir: Path | None = None
    progress: bool = True
    alone: bool = True  # replay each user alone after the N together and compare the texts


def _items(text) -> list:
    """'1,4' or [1, 4] -> ['1', '4']."""
    return [str(x).strip() for x in (text if isinstance(text, (list, tuple)) else str(text).split(",")) if str(x).strip()]


def parse_users(text) -> list:
    """'1,4,8' -> [1, 4, 8], sorted, no duplicates; each >= 1."""
    items = _items(text)
    if not items:
        raise SparqError("--users: give at least one number of users, e.g. 1,4")
    for item in items:
        if not item.isdigit() or int(item) < 1:
            raise SparqError(f"--users: {item!r} is not a number of users >= 1")
    return sorted({int(x) for x in items})


def parse_depth_option(text) -> list:
    try:
        return parse_depths(text)
    except SparqError as e:
        raise SparqError(str(e).replace("--depths", "--depth")) from None


def validate(cfg: ServeBenchConfig) -> ServeBenchConfig:
    """Every check that needs no server: numbers, modes, files."""
    cfg = replace(cfg, users=parse_users(cfg.users), depths=parse_depth_option(cfg.depths),
                  modes=parse_modes(cfg.modes, SERVE_MODES))
    for name in ("turns", "max_tokens"):
        if getattr(cfg, name) < 1:
            raise SparqError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(cfg, name)}")
    if min(cfg.depths) <= TEMPLATE_ROOM:
        raise SparqError(f"--depth: must be more than {TEMPLATE_ROOM} tokens (the chat template and the question "
                         f"beside the document), got {min(cfg.depths)}")
    if cfg.request_timeout <= 0:
        raise SparqError(f"--request-timeout: must be > 0, got {cfg.request_timeout}")
    if cfg.text is not None and not Path(cfg.text).is_file():
        raise SparqError(f"--text: file not found: {cfg.text}")
    cfg = replace(cfg, threads=check_threads(cfg.threads if cfg.threads is not None else default_threads()))
    if cfg.json_path is not None:
        cfg = replace(cfg, json_path=check_writable(cfg.json_path, "-o/--json"))
    if cfg.plot_path is not None:
        cfg = replace(cfg, plot_path=check_writable(cfg.plot_path, "--plot"))
    return cfg


def slot_tokens(cfg: ServeBenchConfig, depth: int) -> int:
    """A slot's context: the document's depth and every turn's question and answer."""
    return depth + cfg.turns * (cfg.max_tokens + TURN_ROOM) + TEMPLATE_ROOM


# ---- the documents -------------------------------------------------------------------------

def source_text(cfg: ServeBenchConfig) -> tuple:
    """(text, what it is): --text, or Jane Austen's six novels (fetched once with apt-get, sparq_cpp/train/corpus.py)."""
    if cfg.text is not None:
        return Path(cfg.text).read_text(encoding="utf-8", errors="replace"), f"--text {cfg.text}"
    return "\n\n".join(corpus.load_novels().values()), corpus.SOURCE


def documents(server: ServerProcess, text: str, n: int, tokens: int, what: str) -> list:
    """n consecutive passages of `text`, each `tokens` tokens long in the server's tokenizer (cut there and
    detokenized), starting at paragraphs."""
    docs, pos = [], 0
    chars = max(4096, 8 * tokens)  # English runs about 4 characters a token
    for i in range(n):
        if pos >= len(text):
            break
        chunk = text[pos:pos + chars]
        ids = server.post("/tokenize", {"content": chunk, "add_special": False})["tokens"]
        if len(ids) < tokens:
            break
        doc = server.post("/detokenize", {"tokens": ids[:tokens]})["content"]
        docs.append(doc.strip())
        nxt = text.find("\n\n", pos + len(doc))
        pos = nxt + 2 if nxt >= 0 else len(text)
    if len(docs) < n:
        raise SparqError(f"{what} holds {len(docs)} passages of {tokens} tokens, {n} users need {n}; give a longer "
                         "--text, fewer --users or a smaller --depth")
    return docs


def conversations(docs: list, turns: int) -> list:
    return [Conversation(user=i, messages=[f"{doc}\n\n{FIRST_QUESTION}"] +
                         [FOLLOW_UPS[t % len(FOLLOW_UPS)] for t in range(turns - 1)])
            for i, doc in enumerate(docs)]


# ---- the server ------------------------------------------------------------------------------

# the sparse options that belong to one method (serve refuses another method's); the others go to both
METHOD_OPTIONS = {"--sparq-r": "sparq", "--mean-value": "sparq", "--no-mean-value": "sparq", "--loki-d": "loki",
                  "--loki-pca": "loki"}


def mode_options(sparse: tuple, kind: str) -> list:
    """The options of `sparse` (flags, each with its value unless it is a switch) that a mode of this kind takes."""
    out, i = [], 0
    while i < len(sparse):
        flag = sparse[i]
        n = 1 if flag in ("--mean-value", "--no-mean-value") else 2
        if kind != "dense" and METHOD_OPTIONS.get(flag, kind) == kind:
            out += sparse[i:i + n]
        i += n
    return out


def serve_argv(cfg: ServeBenchConfig, mode: ServeMode, users: int, depth: int):
    """argv(port) of `sparq-cpp serve` for a mode, N slots of the slot context."""
    sparse = mode_options(tuple(cfg.sparse), mode.kind)
    n_ctx = users * slot_tokens(cfg, depth)
    return lambda port: [sys.executable, "-m", "sparq_cpp.cli.main", "serve", "-m", str(cfg.model),
                         "--port", str(port), "-c", str(n_ctx), "-np", str(users), "-t", str(cfg.threads),
                         *mode.args, *sparse]


def proc_status(pid: int) -> dict:
    """/proc/PID/status's sizes in bytes (VmHWM: peak RSS, VmRSS), {} where there is none."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if key.startswith("Vm") and len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def process_tree(pid: int) -> list:
    """pid and its descendants (`sparq-cpp serve` is a Python process whose child is llama-server)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return out


def tree_status(pid: int) -> dict:
    """proc_status of the process of pid's tree with the highest peak RSS: the server, not its wrapper."""
    return max((proc_status(p) for p in process_tree(pid)), key=lambda st: st.get("VmHWM", 0), default={})


def proc_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) of pid and its descendants, None if pid is gone."""
    total = None
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total = (total or 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def _estimate(cfg, shape, mode: ServeMode, users: int, depth: int) -> dict:
    """The serve estimate of this setting (the flags serve_argv gives)."""
    opt = dict(zip(mode.args[::2], mode.args[1::2]))
    cache = opt.get("--cache-type", "f16")
    return context_estimate(shape, kind=mode.kind, n_ctx=users * slot_tokens(cfg, depth), n_seq=users,
                            type_k=cache, type_v=cache, flash_attn=opt.get("-fa", "auto") != "off")


def run_phase(cfg, server: ServerProcess, convs: list, bar, tag: str) -> tuple:
    """N users against the server, in an event loop of their own: (replies, t0, wall seconds)."""
    done = {"n": 0, "tokens": 0}

    def on_reply(rep):
        done["n"] += 1
        done["tokens"] += rep.n_tokens if rep.ok else 0
        bar.update(1)
        bar.set_postfix_str(f"{tag}: {done['n']}/{len(convs) * cfg.turns} replies"
                            + ("" if rep.ok else f", error: {rep.error[:60]}"))

    return asyncio.run(run_users(f"http://127.0.0.1:{server.port}", convs, max_tokens=cfg.max_tokens,
                                 timeout_s=cfg.request_timeout, on_reply=on_reply))


def same_as_alone(cfg, base_url: str, convs: list, replies: list, bar, tag: str) -> dict:
    """Each conversation again, alone on the same server (llama-server takes its document from the slot that holds
    it): whether temperature 0 gives each user the texts it got while the others decoded in the same batch. A turn
    whose text differs is kept with the character where it starts to differ; an alone request that failed is kept
    with its error."""
    together = {(r.user, r.turn): r.text for r in replies if r.ok}
    compared, differ, failed = 0, [], []
    for i, conv in enumerate(convs):
        bar.set_postfix_str(f"{tag}: user {i + 1} of {len(convs)} alone")
        got, _, _ = asyncio.run(run_users(base_url, [conv], max_tokens=cfg.max_tokens, timeout_s=cfg.request_timeout))
        for r in got:
            if not r.ok:
                failed.append({"user": r.user, "turn": r.turn, "status": r.status, "error": f"alone: {r.error}"})
                continue
            if (r.user, r.turn) not in together:
                continue
            compared += 1
            a, b = together[(r.user, r.turn)], r.text
            if a != b:
                at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                differ.append({"user": r.user, "turn": r.turn, "at_char": at, "together": a, "alone": b})
    return {"compared": compared, "identical": compared - len(differ), "differ": differ, "errors": failed}


def run(cfg: ServeBenchConfig, log=print) -> dict:
    """The sweep: per depth, number of users and mode, a server and its users; the JSON document (written to
    --json, plotted to --plot). A failed request is counted and kept with its error; the run then ends with a
    SparqError naming them, after the JSON is written."""
    cfg = validate(cfg)
    shape = shape_from_gguf(cfg.model)
    text, text_what = source_text(cfg)
    info = machine.machine_info()
    build = build_record()
    log(f"model     {cfg.model}: {shape.n_layer} layers, {shape.n_head} heads / {shape.n_head_kv} KV heads of "
        f"{shape.head_dim}, weights {fmt_bytes(shape.weight_bytes)}, trained context {shape.n_ctx_train}")
    log(f"machine   {info['cpu_model']}, {info['cores_usable']} cores, {fmt_bytes(info['mem_total_bytes'] or 0)} RAM; "
        f"{cfg.threads} threads; build {build['key'] if build else 'none recorded'}")
    log(f"documents {text_what}")
    need = slot_tokens(cfg, max(cfg.depths))
    if shape.n_ctx_train and need > shape.n_ctx_train:  # llama-server caps a slot's context there
        fits = shape.n_ctx_train - (need - max(cfg.depths))
        raise SparqError(f"--depth {fmt_depth(max(cfg.depths))} with {cfg.turns} turn(s) of {cfg.max_tokens} tokens "
                         f"needs {need} tokens of context per user, more than the {shape.n_ctx_train} the model was "
                         f"trained on (llama-server's limit for a slot): use --depth {fits} or less, or fewer --turns "
                         f"or --max-tokens")
    phases = [(d, n, m) for d in cfg.depths for n in cfg.users for m in cfg.modes]
    avail = machine.mem_available()
    for d, n, m in phases:
        est = _estimate(cfg, shape, SERVE_MODES[m], n, d)
        if avail and est["total"] > avail:
            raise SparqError(f"{m} with {n} users at depth {fmt_depth(d)} needs about {fmt_bytes(est['total'])}, "
                             f"more than the {fmt_bytes(avail)} available; use fewer --users or a smaller --depth")
    bar = tqdm(total=sum(n * cfg.turns for _, n, _ in phases), desc="bench serve", unit="reply",
               disable=not cfg.progress, leave=False)
    results, docs_for = [], {}
    try:
        for depth, users, name in phases:
            mode = SERVE_MODES[name]
            tag = f"{name} S={fmt_depth(depth)} users={users}"
            bar.set_postfix_str(f"{tag}: starting the server")
            server = ServerProcess(serve_argv(cfg, mode, users, depth), log_dir=cfg.log_dir,
                                   timeout_s=cfg.start_timeout, request_timeout_s=cfg.request_timeout)
            try:
                props = server.get("/props")
                attn = props.get("sparse_attn") or {}
                if (attn.get("mode") or "dense") != ("dense" if mode.kind == "dense" else mode.kind):
                    raise SparqError(f"{name}: the server runs {attn.get('mode')!r} attention, not {mode.kind}")
                key = (depth, max(cfg.users))
                if key not in docs_for:  # every N takes the first N of the same passages
                    docs_for[key] = documents(server, text, max(cfg.users), depth - TEMPLATE_ROOM, text_what)
                convs = conversations(docs_for[key][:users], cfg.turns)
                cpu0, mon = proc_cpu_seconds(server.proc.pid), machine.CpuMonitor()
                bar.set_postfix_str(f"{tag}: turn 1")
                replies, t0, wall = run_phase(cfg, server, convs, bar, tag)
                cpu1 = proc_cpu_seconds(server.proc.pid)
                status = tree_status(server.proc.pid)
                others = mon.foreign_share()
                if others is not None and cpu0 is not None and cpu1 is not None:
                    others = max(0.0, others - (cpu1 - cpu0) / max(wall * (os.cpu_count() or 1), 1e-9))
                alone = same_as_alone(cfg, f"http://127.0.0.1:{server.port}", convs, replies, bar, tag) if cfg.alone and users > 1 else None
                argv = serve_argv(cfg, mode, users, depth)(server.port)
                notes = [ln for ln in server.text().splitlines() if ln.startswith(("threads ", "memory: ", "warning"))]
            finally:
                server.close()
            est = _estimate(cfg, shape, mode, users, depth)
            summ = summarize(replies, wall)
            first = [r for r in replies if r.turn == 0 and r.ok]
            rec = {"mode": name, "depth": depth, "users": users, "kind": mode.kind, **summ,
                   "depth_tokens": [int(r.timings.get("prompt_n", 0)) + int(r.timings.get("cache_n", 0))
                                    for r in first],
                   "peak_rss_bytes": status.get("VmHWM"), "kv_bytes_per_user": est["per_user"],
                   "memory_estimate": est, "sparse_attn": attn, "server_command": argv[3:], "server_notes": notes,
                   "other_processes_cpu_share": others, "same_as_alone": alone,
                   "replies": [r.as_dict(t0) for r in replies]}
            results.append(rec)
            log(phase_line(rec))
    finally:
        bar.close()
    doc = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "machine": {**info, "threads": cfg.threads, "build": build},
        "model": {"path": str(cfg.model), **shape.as_dict()},
        "documents": text_what,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "modes": {m: asdict(SERVE_MODES[m]) for m in cfg.modes},
        "results": results,
    }
    if cfg.json_path is not None:
        atomic_write(cfg.json_path, lambda tmp: tmp.write_text(json.dumps(doc, indent=1)), "--json")
    if cfg.plot_path is not None:
        atomic_write(cfg.plot_path, lambda tmp: plot(doc, tmp), "--plot")
    return doc


def failures(doc: dict) -> str | None:
    """A line naming the failed requests of a run, None when every request succeeded."""
    bad = [(r, e) for r in doc["results"] for e in r["errors"] + ((r.get("same_as_alone") or {}).get("errors") or [])]
    if not bad:
        return None
    total = sum(r["requests"] for r in doc["results"])
    r, e = bad[0]
    return (f"{len(bad)} of {total} requests failed; the first: {r['mode']} S={fmt_depth(r['depth'])} "
            f"users={r['users']}, user {e['user']} turn {e['turn'] + 1}: {e['error']}")


# ---- the report ---------------------------------------------------------------------------------

def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}" if x < 0.01 else f"{1e3 * x:.0f}"


def _alone(r: dict) -> str:
    a = r.get("same_as_alone")
    return "-" if not a else f"{a['identical']}/{a['compared']}"


def phase_line(r: dict) -> str:
    t, i, q = r["ttft_s"], r["itl_s"], r.get("itl_decode_only_s") or {}
    dec, quiet = r["decode_tokens_per_s"], r["decode_only_tokens_per_s"]
    return (f"{r['mode']} S={fmt_depth(r['depth'])} users={r['users']}: decode "
            f"{'-' if dec is None else f'{dec:.1f}'} tok/s ({'-' if quiet is None else f'{quiet:.1f}'} with no prompt "
            f"waiting), TTFT p50 {_ms(t.get('p50'))} ms, ITL p50/p99 "
            f"{_ms(i.get('p50'))}/{_ms(i.get('p99'))} ms ({_ms(q.get('p50'))}/{_ms(q.get('p99'))} with no prompt "
            f"waiting), peak RSS {fmt_bytes(r['peak_rss_bytes'] or 0)}"
            + (f", same texts as alone {_alone(r)}" if r.get("same_as_alone") else "")
            + (f", {r['failed']} failed" if r["failed"] else ""))


def format_table(doc: dict) -> str:
    m, mach = doc["model"], doc["machine"]
    cfg = doc["config"]
    lines = [f"{Path(m['path']).name}: {mach['cpu_model']}, {mach['threads']} threads; {cfg['turns']} turns of "
             f"{cfg['max_tokens']} tokens per user, streamed",
             "decode: tokens/s of all users together while decoding (no-prompt: while no prompt waited); TTFT/ITL in "
             "ms (ITL np: the gaps while no prompt waited); prompt: tokens/s processed; cached: share of follow-up "
             "requests served from the prompt cache; KV/user: the caches one slot holds; alone: replies whose text "
             "each user got again alone",
             f"{'S':>5} {'users':>5}  {'mode':<11} {'decode':>7} {'no-prompt':>9} {'TTFT p50':>8} {'p95':>7} "
             f"{'ITL p50':>7} {'p99':>6} {'p99/p50':>7} {'np p99/p50':>10} {'prompt':>7} {'cached':>6} "
             f"{'peak RSS':>10} {'KV/user':>9} {'alone':>6} {'failed':>6}"]
    for r in doc["results"]:
        t, i, pc = r["ttft_s"], r["itl_s"], r["prompt_cache"]
        dec, pr, ratio = r["decode_tokens_per_s"], r["prompt_tokens_per_s"], r["itl_p99_over_p50"]
        quiet, qratio = r["decode_only_tokens_per_s"], r.get("itl_decode_only_p99_over_p50")
        cached = pc["followups_from_cache"]
        lines.append(
            f"{fmt_depth(r['depth']):>5} {r['users']:>5}  {r['mode']:<11} {'-' if dec is None else f'{dec:.1f}':>7} "
            f"{'-' if quiet is None else f'{quiet:.1f}':>9} {_ms(t.get('p50')):>8} {_ms(t.get('p95')):>7} "
            f"{_ms(i.get('p50')):>7} {_ms(i.get('p99')):>6} {'-' if ratio is None else f'{ratio:.2f}':>7} "
            f"{'-' if qratio is None else f'{qratio:.2f}':>10} {'-' if pr is None else f'{pr:.0f}':>7} "
            f"{'-' if cached is None else f'{100 * cached:.0f}%':>6} {fmt_bytes(r['peak_rss_bytes'] or 0):>10} "
            f"{fmt_bytes(r['kv_bytes_per_user']):>9} {_alone(r):>6} {r['failed']:>6}")
    return "\n".join(lines)


def plot(doc: dict, out_path) -> None:
    """Aggregate decode tokens/s and inter-token latency p99 (log scale) against users, one line per (mode, depth);
    dashed: while no prompt waited."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {}
    for r in doc["results"]:
        series.setdefault((r["mode"], r["depth"]), []).append(r)
    for (mode, depth), rows in series.items():
        rows = sorted(rows, key=lambda r: r["users"])
        label = f"{mode} S={fmt_depth(depth)}"
        line, = ax1.plot([r["users"] for r in rows], [r["decode_tokens_per_s"] or 0 for r in rows], "o-", label=label)
        ax1.plot([r["users"] for r in rows], [r["decode_only_tokens_per_s"] or 0 for r in rows], "s--",
                 color=line.get_color(), alpha=0.6, label=f"{label}, no prompt waiting")
        ax2.plot([r["users"] for r in rows], [1e3 * r["itl_s"].get("p99", 0) for r in rows], "o-",
                 color=line.get_color(), label=label)
        quiet = [(r["users"], 1e3 * (r.get("itl_decode_only_s") or {}).get("p99", 0)) for r in rows]
        ax2.plot([u for u, q in quiet if q > 0], [q for _, q in quiet if q > 0], "s--", color=line.get_color(),
                 alpha=0.6, label=f"{label}, no prompt waiting")
    users = sorted({r["users"] for r in doc["results"]})
    ax2.set_yscale("log")  # a prompt's stall is seconds, a decode step tens of ms
    for ax, what in ((ax1, "aggregate decode tokens/s"), (ax2, "inter-token latency p99 (ms)")):
        ax.set_xlabel("users (concurrent conversations)")
        ax.set_ylabel(what)
        ax.set_xticks(users)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_title("throughput of all users together")
    ax2.set_title("what each user waits between tokens")
    m = doc["model"]
    fig.suptitle(f"{Path(m['path']).name}: {doc['machine']['threads']} threads, {doc['machine']['cpu_model']}; "
                 f"{doc['config']['turns']} turns of {doc['config']['max_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, format="png", dpi=110)
    plt.close(fig)
