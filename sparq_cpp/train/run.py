"""The training loop: AdamW, warm-up then cosine decay, fixed steps, a checkpoint at every eval.
From scratch or warm-started from a checkpoint (--init), which is how the curriculum's phases chain."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import open_gguf
from sparq_cpp.train import corpus, data, evaluate, hf
from sparq_cpp.train.from_gguf import config_of, load_model
from sparq_cpp.train.model import LlamaConfig, LlamaForCausalLM
from sparq_cpp.train.tasks import TaskBuilder
from sparq_cpp.train.tokenize import Tokenizer


@dataclass
class TrainArgs:
    out: str
    n_vocab: int = 2048
    n_embd: int = 256
    n_head: int = 2
    n_head_kv: int = 2
    n_layer: int = 4
    n_ff: int = 768
    ctx: int = 2048
    batch: int = 2
    steps: int = 900
    lr: float = 3e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 1
    eval_every: int = 200
    n_eval: int = 16
    eval_ctx: int = 2048
    p_rand: float = 0.0
    p_rand_end: float | None = None  # p_rand moves linearly to this over the steps
    rand_layout: str = "repeat"  # data.RAND_LAYOUTS
    rand_vocab: tuple[int, int] | None = None  # random passages draw from this many words (log-uniform), not all
    rand_text: bool = False  # the "random-word" passages are passages of text instead
    init: str | None = None
    bf16: bool = False  # matmuls in bfloat16 under autocast (weights and optimizer stay float32)
    stop_at: int | None = None  # end after this step (with a checkpoint), the schedule still that of `steps`


GEOMETRY = {"n_vocab": 2048, "n_embd": 256, "n_head": 2, "n_head_kv": 2, "n_layer": 4, "n_ff": 768}


def geometry(flags: dict, init: str | None) -> dict:
    """The model geometry: the flags given (None: not given) over the defaults, or over the geometry
    of the checkpoint `init`, which they must agree with, except that n_head_kv may divide the
    checkpoint's (its KV heads are then mean-pooled in groups)."""
    if init is None:
        return {k: GEOMETRY[k] if v is None else v for k, v in flags.items()}
    c = _init_config(init)
    ck = {"n_vocab": c.vocab_size, "n_embd": c.hidden_size, "n_head": c.num_attention_heads,
          "n_head_kv": c.num_key_value_heads, "n_layer": c.num_hidden_layers, "n_ff": c.intermediate_size}
    for k, v in flags.items():
        pooled = k == "n_head_kv" and v is not None and ck[k] % v == 0
        if v is not None and v != ck[k] and not pooled:
            hint = " or a divisor of it, to pool KV heads" if k == "n_head_kv" else ""
            raise SparqError(f"--{k.replace('_', '-')} {v} disagrees with the --init checkpoint {init} "
                             f"({ck[k]}); leave the flag out to keep the checkpoint's{hint}")
    return {k: ck[k] if flags[k] is None else flags[k] for k in ck}


def _is_gguf(init: str) -> bool:
    return Path(init).is_file() and str(init).endswith(".gguf")


def _init_config(init: str) -> LlamaConfig:
    if _is_gguf(init):
        return config_of(open_gguf(Path(init)))
    return hf.load_config(init)


def warm_start(args: TrainArgs) -> tuple[LlamaForCausalLM, dict]:
    """The --init checkpoint's model (a checkpoint directory, or a GGUF model: its weights as stored,
    dequantized), with its KV heads mean-pooled down to args.n_head_kv if that is fewer (GQA
    "uptraining", Ainslie et al. 2023), and what training.json records about it."""
    if _is_gguf(args.init):
        src = load_model(args.init)
    else:
        src = hf.load(args.init)
    n_kv = src.config.num_key_value_heads
    sd = src.state_dict()
    if args.n_head_kv != n_kv:
        g = n_kv // args.n_head_kv  # new KV head j = mean of old heads j*g .. j*g+g-1, the query heads it serves
        for name, w in sd.items():
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                sd[name] = w.view(args.n_head_kv, g, -1, w.shape[1]).mean(1).reshape(-1, w.shape[1])
    model = LlamaForCausalLM(replace(src.config, num_key_value_heads=args.n_head_kv,
                                     max_position_embeddings=args.ctx))
    model.load_state_dict(sd)
    parent = Path(args.init) / "training.json"
    return model, {"checkpoint": args.init,
                   "kv_heads_mean_pooled_from": n_kv if n_kv != args.n_head_kv else None,
                   "training": json.loads(parent.read_text()) if parent.is_file() else None}


def parse_fraction_ramp(text: str) -> tuple[float, float | None]:
    """"P" -> (P, None); "START:END" -> (START, END); each a fraction in [0, 1]."""
    try:
        vals = [float(x) for x in str(text).split(":")]
    except ValueError:
        vals = []
    if len(vals) not in (1, 2) or not all(0 <= v <= 1 for v in vals):
        raise SparqError(f"--p-random wants a fraction in [0, 1] or START:END of two, not {text!r}")
    return vals[0], (vals[1] if len(vals) == 2 else None)


def parse_size_range(text: str) -> tuple[int, int]:
    """"N" -> (N, N); "LO:HI" -> (LO, HI)."""
    try:
        vals = [int(x) for x in str(text).split(":")]
    except ValueError:
        vals = []
    if len(vals) not in (1, 2) or vals[0] > vals[-1]:
        raise SparqError(f"--rand-vocab wants N or LO:HI (LO <= HI), not {text!r}")
    return vals[0], vals[-1]


def p_random_at(args: TrainArgs, step: int) -> float:
    if args.p_rand_end is None:
        return args.p_rand
    return args.p_rand + (args.p_rand_end - args.p_rand) * step / max(1, args.steps)


def _lr(args: TrainArgs, step: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _optimizer(model, args: TrainArgs):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))


def next_token_loss(model, ids: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """Mean cross-entropy of predicting ids[:, 1:] from ids[:, :-1]; with bf16 the model runs under
    bfloat16 autocast (its matmuls in bf16, the loss in float32)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())


def _log(msg: str) -> None:
    print(msg, flush=True)


def train(args: TrainArgs, command: str = "", deb=None) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = Tokenizer(args.n_vocab)
    train_books, val_books = data.tokenized_books(tok, deb)
    stream = data.Stream(TaskBuilder(train_books, tok.encode, tok.bos_id, rand_vocab=args.rand_vocab,
                                     rand_text=args.rand_text),
                         args.ctx + 1, args.seed, p_rand=args.p_rand, rand_layout=args.rand_layout)
    val_builder = TaskBuilder(val_books, tok.encode, tok.bos_id)
    val_windows = data.text_windows(val_books, args.eval_ctx + 1, args.n_eval)
    eval_set = data.eval_samples(val_builder, args.eval_ctx, args.n_eval)
    # induction on its own (random words) at the training context, to watch a short-context phase
    probe_set = data.eval_samples(val_builder, args.ctx, args.n_eval, random_words=True)

    init = None
    if args.init:
        model, init = warm_start(args)
    else:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=args.n_vocab, hidden_size=args.n_embd, intermediate_size=args.n_ff,
            num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
            num_key_value_heads=args.n_head_kv, max_position_embeddings=args.ctx))
        model.init_weights(args.seed)
    cfg = model.config
    opt = _optimizer(model, args)
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"model: {n_params / 1e6:.2f}M parameters, head_dim {cfg.head_dim}; "
         f"{sum(len(p) for b in train_books for p in b)} training tokens in the corpus")

    history, t0, ema = [], time.time(), None
    record = {}
    last = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    for step in range(last + 1):
        if step % args.eval_every == 0 or step == last:
            record = {"step": step, "tokens": step * args.batch * args.ctx,
                      "minutes": round((time.time() - t0) / 60, 2),
                      "val_loss": round(evaluate.val_loss(model, val_windows), 4),
                      "task_accuracy": {k: round(v, 4) for k, v in evaluate.task_accuracy(model, eval_set).items()},
                      "probe": {"ctx": args.ctx, "task_accuracy": {
                          k: round(v, 4) for k, v in evaluate.task_accuracy(model, probe_set).items()}},
                      "train_loss_ema": None if ema is None else round(ema, 4),
                      "p_random": round(p_random_at(args, step), 4)}
            history.append(record)
            _log(json.dumps(record))
            extra = {"command": command, "args": asdict(args), "data": corpus.SOURCE,
                     "n_params": n_params, "init": init, "history": history}
            hf.save(model, args.out, extra)
            model.train()
        if step == last:
            break
        for g in opt.param_groups:
            g["lr"] = _lr(args, step)
        stream.p_rand = p_random_at(args, step)
        ids = torch.from_numpy(stream.batch(args.batch)).long()
        loss = next_token_loss(model, ids, args.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 20 == 0:
            el = time.time() - t0
            _log(f"step {step} loss {loss.item():.4f} ema {ema:.4f} lr {_lr(args, step):.2e} "
                 f"{(step + 1) * args.batch * args.ctx / el:.0f} tok/s {el / 60:.1f} min")
    return record
