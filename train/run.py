"""The training loop: AdamW, warm-up then cosine decay, fixed steps, a checkpoint at every eval."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from sparq_cpp.train import corpus, data, evaluate, hf
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


def _log(msg: str) -> None:
    print(msg, flush=True)


def train(args: TrainArgs, command: str = "", deb=None) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = Tokenizer(args.n_vocab)
    train_books, val_books = data.tokenized_books(tok, deb)
    stream = data.Stream(TaskBuilder(train_books, tok.encode, tok.bos_id), args.ctx + 1, args.seed)
    val_windows = data.text_windows(val_books, args.ctx + 1, args.n_eval)
    eval_set = data.eval_samples(TaskBuilder(val_books, tok.encode, tok.bos_id), args.ctx, args.n_eval)

    cfg = LlamaConfig(vocab_size=args.n_vocab, hidden_size=args.n_embd, intermediate_size=args.n_ff,
                      num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                      num_key_value_heads=args.n_head_kv, max_position_embeddings=args.ctx)
    model = LlamaForCausalLM(cfg)
    model.init_weights(args.seed)
    opt = _optimizer(model, args)
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"model: {n_params / 1e6:.2f}M parameters, head_dim {cfg.head_dim}; "
         f"{sum(len(p) for b in train_books for p in b)} training tokens in the corpus")

    history, t0, ema = [], time.time(), None
    record = {}
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            record = {"step": step, "tokens": step * args.batch * args.ctx,
                      "minutes": round((time.time() - t0) / 60, 2),
                      "val_loss": round(evaluate.val_loss(model, val_windows), 4),
                      "task_accuracy": {k: round(v, 4) for k, v in evaluate.task_accuracy(model, eval_set).items()},
                      "train_loss_ema": None if ema is None else round(ema, 4)}
            history.append(record)
            _log(json.dumps(record))
            extra = {"command": command, "args": asdict(args), "data": corpus.SOURCE,
                     "n_params": n_params, "history": history}
            hf.save(model, args.out, extra)
            model.train()
        if step == args.steps:
            break
        for g in opt.param_groups:
            g["lr"] = _lr(args, step)
        ids = torch.from_numpy(stream.batch(args.batch)).long()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
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
