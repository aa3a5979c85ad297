"""The evaluation tasks: read a plain local file, build tokenized samples, score a model's output.

Every task turns into samples of one of two kinds, which the methods run the same way (the prompt
but its last token through dense attention, then every predicted token from a step of the method):
- ``score``: teacher-forced continuation; the score is bits per character of ``target``;
- ``generate``: greedy decoding of up to ``max_new`` tokens; the task scores the text.

File formats (UTF-8; ``--data TASK=PATH``; defaults are generated, see textgen.py):
- bpc: plain text. Samples are windows spread evenly over the file: ``context`` tokens of
  prefix, then ``continuation`` tokens scored. Score: bits per character of the scored text
  (sum of -log2 p over its tokens / its characters), lower is better.
- repetition (the SparQ paper's Text Repetition): plain text. Each sample is a chunk of about
  ``context`` tokens, then a newline and a passage of ``prompt_chars`` characters copied from
  inside the chunk; the model should continue with the ``reference_chars`` characters that follow
  the passage in the chunk. Score: characters matched before the first difference (leading
  whitespace stripped from both), higher is better.
- needle (needle in a haystack): header lines ``needle: ...``, ``question: ...``, ``answer: ...``,
  optionally ``answer_prefix: ...``, then a line ``---``, then the haystack text. For each length
  (tokens) and depth (0 = start, 1 = end) the needle is put at a sentence boundary at that depth of
  a haystack cut to the length, followed by the question. Score: 1 if the answer appears in the
  output (case and spacing ignored), else 0.
- copy (retrieval measured by the loss): plain text. Each sample is a window of about ``context``
  tokens with a paragraph of ``copy_words`` words drawn at random from the file's 300 most common
  one-token words put in at a sentence boundary near its first tenth, and the same words again at
  the end: the first half is given, the second half scored. Score: bits per character of the
  scored words, lower is better. Nothing but finding the earlier paragraph predicts them, so a
  method that loses it scores about log2(300) bits per word (~1.4 bits per character) or worse.
- kv (key-value retrieval, Liu et al. 2023): one ``key<TAB>value`` pair per line (at least 2).
  For each length and depth, a JSON object of as many pairs as fit the length, then the question
  for the key at that depth. Score: 1 if the output starts with the value, else 0.
"""
from __future__ import annotations

import json
import re

import numpy as np
from dataclasses import dataclass, field
from pathlib import Path

from sparq_cpp import lazy
from sparq_cpp.errors import SparqError
from sparq_cpp.evaluation import textgen

TASKS = ("bpc", "repetition", "needle", "kv", "copy")
DOMAIN_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def base(task: str) -> str:
    """The task a name stands for: "bpc:code" (bits per character on the domain "code") is bpc."""
    return task.split(":", 1)[0]


def domain_task(name: str) -> str:
    """The task name of bits per character on a named domain's text, checked."""
    if not DOMAIN_RE.fullmatch(name):
        raise SparqError(f"a domain name must be 1-32 lowercase letters, digits, '-' or '_', starting with a letter "
                         f"or digit; got {name!r}")
    return f"bpc:{name}"


HIGHER_IS_BETTER = {"bpc": False, "repetition": True, "needle": True, "kv": True, "copy": False}
SCORE_NAMES = {"bpc": "bits per character", "repetition": "characters matched", "needle": "accuracy",
               "kv": "accuracy", "copy": "bits per character"}


@dataclass
class Sample:
    task: str
    id: str
    kind: str                 # "score" or "generate"
    prompt: list[int]         # tokens, BOS first where the model's vocabulary adds one
    target: list[int] = field(default_factory=list)  # score: the tokens scored
    n_chars: int = 0          # score: characters of the scored text
    max_new: int = 0          # generate: most tokens generated
    reference: str = ""       # generate: what the output should hold
    meta: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        """Positions the sample needs in the context."""
        return len(self.prompt) + (len(self.target) if self.kind == "score" else self.max_new)


@dataclass
class TaskConfig:
    samples: int = 4
    context: int = 512                 # bpc / repetition: tokens of context
    continuation: int = 64             # bpc: tokens scored
    prompt_chars: int = 64             # repetition: characters of the copied passage
    reference_chars: int = 128         # repetition: characters the model should repeat
    max_new: int = 64                  # repetition: most tokens generated
    lengths: tuple = (512, 1024)       # needle / kv: prompt lengths in tokens
    depths: tuple = (0.0, 0.5, 1.0)    # needle / kv: where the needle / key sits
    copy_words: int = 32               # copy: words in the repeated paragraph


class Tokenizer:
    """The model's own tokenizer through llama.cpp (vocab only, no weights loaded)."""

    def __init__(self, path):
        llama_cpp = lazy.llama_cpp()
        try:
            with lazy.llama_cpp("_utils").suppress_stdout_stderr(disable=False):  # a vocab-only context warns about n_ctx_train = 0
                self._llm = llama_cpp.Llama(str(path), vocab_only=True, n_ctx=64, verbose=False)
        except (ValueError, RuntimeError) as e:  # llama-cpp-python's way of saying llama.cpp refused the file
            raise SparqError(f"llama.cpp could not load the tokenizer of {path}: {e}") from None
        self.eos = self._llm.token_eos()
        self.bos = self._llm.token_bos()
        # whether llama.cpp puts BOS before a text for this model (SmolLM2's vocabulary does not)
        self.add_bos = bool(self._llm._model.add_bos_token())

    @property
    def start(self) -> list[int]:
        """What a text starts with: [BOS] where the model's vocabulary adds it, else nothing."""
        return [self.bos] if self.add_bos else []

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos=bos)

    def decode(self, tokens, prev=None) -> str:
        return self._llm.detokenize(list(tokens), prev_tokens=list(prev) if prev else None).decode("utf-8", "replace")


# ---- reading files ------------------------------------------------------------------------

def read_text(path, task: str) -> str:
    path = Path(path)
    if not path.is_file():
        raise SparqError(f"{task} task file not found: {path}")
    data = path.read_bytes()
    if b"\0" in data:
        raise SparqError(f"{task} task file {path} is binary (it holds NUL bytes), expected UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SparqError(f"{task} task file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def parse_needle(text: str, where: str) -> dict:
    head, sep, haystack = text.partition("\n---\n")
    if not sep:
        raise SparqError(f"needle task file {where}: no line '---' between the header and the haystack "
                         "(format: 'needle: ...', 'question: ...', 'answer: ...' lines, '---', then text)")
    fields = {}
    for i, line in enumerate(head.splitlines(), 1):
        if not line.strip():
            continue
        key, colon, value = line.partition(":")
        key = key.strip().lower()
        if not colon or key not in ("needle", "question", "answer", "answer_prefix"):
            raise SparqError(f"needle task file {where}, header line {i}: expected 'needle:', 'question:', "
                             f"'answer:' or 'answer_prefix:', got {line[:60]!r}")
        fields[key] = value.strip()
    missing = [k for k in ("needle", "question", "answer") if not fields.get(k)]
    if missing:
        raise SparqError(f"needle task file {where}: header is missing {', '.join(missing)}")
    if not haystack.strip():
        raise SparqError(f"needle task file {where}: the haystack after '---' is empty")
    fields["haystack"] = haystack
    return fields


def parse_kv(text: str, where: str) -> list[tuple[str, str]]:
    pairs = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise SparqError(f"kv task file {where}, line {i}: expected 'key<TAB>value', got {line[:60]!r}")
        pairs.append((parts[0].strip(), parts[1].strip()))
    if len(pairs) < 2:
        raise SparqError(f"kv task file {where}: needs at least 2 'key<TAB>value' lines, found {len(pairs)}")
    if len({k for k, _ in pairs}) != len(pairs):
        raise SparqError(f"kv task file {where}: keys repeat; each key must be unique")
    return pairs


def default_text(task: str, seed: int = 0) -> str:
    if task == "needle":
        return textgen.needle_file(seed)
    if task == "kv":
        return textgen.kv_pairs_file(seed=seed)
    return textgen.prose(200_000, seed)


# ---- building samples ---------------------------------------------------------------------

def _word_start(text: str, i: int) -> int:
    """The first character of the word at or after i."""
    m = re.compile(r"\s\S").search(text, max(0, i - 1))
    return m.start() + 1 if m and i > 0 else (0 if i <= 0 else len(text))


def _cut(text: str, start: int, n_tokens: int, tok: Tokenizer) -> str:
    """text[start:end] ending before whitespace, with at most n_tokens tokens and close to it."""
    end = min(len(text), start + 4 * n_tokens)
    best = ""
    for _ in range(12):
        piece = text[start:end]
        if end < len(text):
            m = re.search(r"\s\S*$", piece)
            piece = piece[: m.start()] if m and m.start() > 0 else piece
        n = len(tok.encode(piece))
        if n <= n_tokens:
            best = piece if len(piece) > len(best) else best
            if n >= 0.97 * n_tokens or end >= len(text):
                break
            end = start + int((end - start) * min(2.0, n_tokens / max(n, 1) * 1.02)) + 1
        else:
            end = start + int(len(piece) * n_tokens / n * 0.98)
    return best


def _windows(text: str, count: int, need_chars: int) -> list[int]:
    span = len(text) - need_chars
    if span < 0:
        return [0] if text else []
    return [_word_start(text, int(span * i / max(count - 1, 1))) if count > 1 else 0 for i in range(count)]


def bpc_samples(text: str, tok: Tokenizer, cfg: TaskConfig, where: str) -> list[Sample]:
    ids = tok.encode(text[: 20_000])
    cpt = max(1.0, len(text[: 20_000]) / max(len(ids), 1))  # characters per token, to place the windows
    need = int((cfg.context + cfg.continuation) * cpt * 1.2)
    out = []
    for i, start in enumerate(_windows(text, cfg.samples, need)):
        piece = tok.encode(text[start: start + need + 64])
        if len(piece) < cfg.context + cfg.continuation:
            # this part of the text has fewer tokens per character than its start, where the window's length was
            # estimated (a text of several kinds): take twice as much, from earlier where the text ends too soon
            start = _word_start(text, min(start, max(0, len(text) - 2 * need)))
            piece = tok.encode(text[start: start + 2 * need])
        if len(piece) < cfg.context + cfg.continuation:
            raise SparqError(f"bpc task file {where} is too short for {cfg.samples} sample(s) of "
                             f"{cfg.context} + {cfg.continuation} tokens")
        n0 = cfg.context - len(tok.start)
        prefix = tok.start + piece[:n0]
        target = piece[n0: n0 + cfg.continuation]
        chars = len(tok.decode(target, prev=prefix))
        out.append(Sample("bpc", f"bpc-{i}", "score", prefix, target=target, n_chars=chars,
                          meta={"char_offset": start}))
    return out


def repetition_samples(text: str, tok: Tokenizer, cfg: TaskConfig, where: str) -> list[Sample]:
    ids = tok.encode(text[: 20_000])
    cpt = max(1.0, len(text[: 20_000]) / max(len(ids), 1))
    need = int(cfg.context * cpt * 1.3)
    out = []
    for i, start in enumerate(_windows(text, cfg.samples, need)):
        context = _cut(text, start, cfg.context - 8 - int(cfg.prompt_chars / cpt * 1.5), tok)
        # the passage: a whole-word stretch inside the chunk, spread over samples (never the very end)
        lo, hi = len(context) // 10, len(context) - cfg.prompt_chars - cfg.reference_chars - 2
        if hi <= lo:
            raise SparqError(f"repetition task file {where}: a context of {cfg.context} tokens is too short for "
                             f"a {cfg.prompt_chars}-character passage and {cfg.reference_chars} characters to repeat")
        p0 = _word_start(context, lo + (hi - lo) * ((i * 7919) % 97) // 97)
        m = re.compile(r"\S\s").search(context, p0 + cfg.prompt_chars - 1)
        if m is None:
            raise SparqError(f"repetition task file {where}: sample {i} has no word boundary after its passage")
        p1 = m.start() + 1
        passage = context[p0:p1]
        reference = context[p1: p1 + cfg.reference_chars]
        prompt = tok.encode(context + "\n" + passage, bos=True)
        out.append(Sample("repetition", f"repetition-{i}", "generate", prompt, reference=reference,
                          max_new=min(cfg.max_new, len(tok.encode(reference)) + 2),
                          meta={"char_offset": start, "passage": passage}))
    return out


def _depth_cut(text: str, depth: float) -> int:
    """A sentence boundary (after '. ', '? ', '! ' or a blank line) near depth * len(text)."""
    i = int(depth * len(text))
    if i <= 0:
        return 0
    if i >= len(text):
        return len(text)
    m = re.compile(r"[.!?]\s+|\n\s*\n").search(text, i)
    return m.end() if m else len(text)


def needle_samples(text: str, tok: Tokenizer, cfg: TaskConfig, where: str) -> list[Sample]:
    f = parse_needle(text, where)
    prefix = f.get("answer_prefix", "")
    question = f"\n\nQuestion: {f['question']}\nAnswer:" + (f" {prefix}" if prefix else "")
    overhead = len(tok.encode(f["needle"] + " " + question)) + 2
    out = []
    for length in cfg.lengths:
        hay = _cut(f["haystack"], 0, length - overhead, tok)
        if len(tok.encode(hay)) < 0.8 * (length - overhead):
            raise SparqError(f"needle task file {where}: the haystack is too short for a length of {length} tokens")
        for depth in cfg.depths:
            i = _depth_cut(hay, depth)
            body = hay[:i] + ("" if i == 0 or hay[i - 1].isspace() else " ") + f["needle"] + " " + hay[i:]
            prompt = tok.encode(body.rstrip() + question, bos=True)
            out.append(Sample("needle", f"needle-L{length}-d{depth:g}", "generate", prompt, reference=f["answer"],
                              max_new=len(tok.encode(" " + f["answer"])) + 8,
                              meta={"length": length, "depth": depth}))
    return out


KV_INTRO = "Extract the value corresponding to the specified key in the JSON object below.\n\n"


def kv_samples(text: str, tok: Tokenizer, cfg: TaskConfig, where: str) -> list[Sample]:
    pairs = parse_kv(text, where)
    per_pair = max(1.0, len(tok.encode(json.dumps(dict(pairs[:20])))) / min(20, len(pairs)))
    out = []
    for li, length in enumerate(cfg.lengths):
        tail_len = len(tok.encode(f'\n\nKey: "{pairs[0][0]}"\nCorresponding value: "')) + 4
        budget = length - len(tok.encode(KV_INTRO)) - tail_len
        n = min(len(pairs), max(2, int(budget / per_pair)))
        o = li * 7 % len(pairs)  # each length starts elsewhere in the file
        rotated = pairs[o:] + pairs[:o]
        while True:
            chosen = rotated[:n]
            body = KV_INTRO + json.dumps(dict(chosen), indent=1)
            if len(tok.encode(body)) + tail_len <= length:
                break
            if n <= 2:
                raise SparqError(f"kv task file {where}: a length of {length} tokens does not hold 2 pairs "
                                 f"({len(tok.encode(body)) + tail_len} tokens); use longer --lengths or shorter keys")
            n = max(2, min(n - 1, int(n * 0.95)))
        if n == len(pairs) and len(tok.encode(body)) + tail_len < 0.8 * length:
            raise SparqError(f"kv task file {where}: {len(pairs)} pairs do not fill a length of {length} tokens")
        for depth in cfg.depths:
            key, value = chosen[round(depth * (len(chosen) - 1))]
            prompt = tok.encode(body + f'\n\nKey: "{key}"\nCorresponding value: "', bos=True)
            out.append(Sample("kv", f"kv-L{length}-d{depth:g}", "generate", prompt, reference=value,
                              max_new=len(tok.encode(value)) + 4,
                              meta={"length": length, "depth": depth, "pairs": len(chosen), "key": key}))
    return out


COPY_VOCAB = 300  # the copy task draws its words from the file's most common words


def copy_samples(text: str, tok: Tokenizer, cfg: TaskConfig, where: str) -> list[Sample]:
    counts: dict[str, int] = {}
    for w in re.findall(r"[A-Za-z]+", text[:400_000]):
        counts[w] = counts.get(w, 0) + 1
    # the most common words that are one token each (after a space) in this model's vocabulary
    vocab = [w for w in sorted(counts, key=lambda w: (-counts[w], w))[:3 * COPY_VOCAB]
             if len(tok.encode(" " + w)) == 1][:COPY_VOCAB]
    if len(vocab) < 50:
        raise SparqError(f"copy task file {where}: {len(vocab)} distinct one-token words; the task draws from 50 "
                         "or more")
    rng = np.random.default_rng(len(text))
    n_words = cfg.copy_words
    out = []
    ids = tok.encode(text[: 20_000])
    cpt = max(1.0, len(text[: 20_000]) / max(len(ids), 1))
    for i, start in enumerate(_windows(text, cfg.samples, int(cfg.context * cpt * 1.3))):
        words = [str(w) for w in rng.choice(vocab, n_words)]
        para = " ".join(words)
        budget = cfg.context - 2 * len(tok.encode(" " + para)) - 8
        if budget < cfg.context // 2:
            raise SparqError(f"copy: --context {cfg.context} is too short for {n_words} copied words")
        body = _cut(text, start, budget, tok)
        cut = _depth_cut(body, 0.1)  # a sentence boundary near the first tenth
        given = n_words // 2
        head = body[:cut].rstrip() + "\n\n" + para + "\n\n" + body[cut:].lstrip() + "\n\n" + " ".join(words[:given])
        prompt = tok.encode(head, bos=True)
        full = tok.encode(head + " " + " ".join(words[given:]), bos=True)
        if full[:len(prompt)] != prompt:
            raise SparqError(f"copy task file {where}: the tokenizer merges across a word boundary")
        target = full[len(prompt):]
        chars = len(tok.decode(target, prev=prompt))
        out.append(Sample("copy", f"copy-{i}", "score", prompt, target=target, n_chars=chars,
                          meta={"char_offset": start, "words": n_words}))
    return out


BUILDERS = {"bpc": bpc_samples, "repetition": repetition_samples, "needle": needle_samples, "kv": kv_samples,
            "copy": copy_samples}


def build(task: str, tok: Tokenizer, cfg: TaskConfig, path=None, seed: int = 0) -> list[Sample]:
    """The task's samples; a domain's bits per character ("bpc:NAME") from its file, its samples under that task."""
    kind = base(task)
    if kind not in BUILDERS or (kind != task and kind != "bpc"):
        raise SparqError(f"unknown task {task!r} (known: {', '.join(TASKS)}, bpc:DOMAIN)")
    if kind != task and path is None:
        raise SparqError(f"{task} needs its domain's text file (--domain {task.split(':', 1)[1]}=PATH)")
    text = read_text(path, kind) if path is not None else default_text(task, seed)
    where = str(path) if path is not None else f"(default {task} data)"
    samples = BUILDERS[kind](text, tok, cfg, where)
    if not samples:
        raise SparqError(f"{task} task file {where} gave no samples")
    for s in samples:
        s.task = task
    return samples


# ---- scoring ------------------------------------------------------------------------------

def match_length(output: str, reference: str) -> int:
    """Characters matched before the first difference, leading whitespace stripped (the paper's rule)."""
    a, b = output.lstrip(), reference.lstrip()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _norm(s: str) -> str:
    return " ".join(s.lower().split())


def score_generation(sample: Sample, output: str) -> float:
    if sample.task == "repetition":
        return float(match_length(output, sample.reference))
    if sample.task == "needle":
        return float(_norm(sample.reference) in _norm(output))
    if sample.task == "kv":
        return float(output.lstrip().startswith(sample.reference))
    raise SparqError(f"task {sample.task!r} does not generate")
