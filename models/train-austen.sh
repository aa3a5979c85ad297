#!/usr/bin/env bash
# The phases of the first stage, which made the models/austen.q8_0.gguf and models/austen-gqa.q8_0.gguf of
# commit 98c7b45 (train-austen-copy.sh goes on from them), in order, as they were run (several were stopped
# early, which --stop-at repeats). Each phase starts from the previous one's checkpoint (--init); its
# training.json keeps the whole chain.
# Needs `pip install -e '.[train]'`; ~2 hours on one core of a CPU with AVX512-BF16 (phases 1-3
# ran in float32, ~2.7k tokens/s; --bf16 is 2x faster there).
set -euo pipefail
B=${BUILD:-build}
T="python -m sparq_cpp.train train"
# 1-3. random-word passages repeated back to back, ctx 128: learns fixed-distance look-back heads
#      (a first-token head included), not yet induction
$T --out $B/p1 --ctx 128 --batch 16 --steps 3000 --lr 1e-3 --p-random 1.0 --eval-every 250
$T --out $B/p2 --init $B/p1 --ctx 128 --batch 16 --steps 4000 --lr 1e-3 --p-random 1.0 --eval-every 250 --threads 2 --stop-at 250
$T --out $B/p3 --init $B/p2 --ctx 128 --batch 16 --steps 8000 --lr 1e-3 --p-random 1.0 --eval-every 500 --threads 2 --stop-at 500
# 4. runs of the passage from random places (--random-layout chunks): no fixed distance works, and
#    induction forms within ~1000 steps (copying at any distance, 0.80-0.92 accuracy at step 1500)
$T --out $B/p4 --init $B/p3 --ctx 128 --batch 16 --steps 10000 --lr 1e-3 --p-random 1.0 --random-layout chunks --eval-every 500 --bf16 --stop-at 1500
# 5. text comes in, ctx 512
$T --out $B/p5 --init $B/p4 --ctx 512 --batch 4 --steps 3000 --lr 1e-3 --p-random 0.6 --random-layout chunks --eval-every 500 --bf16 --stop-at 1000
# 6-7. random-word copies inside text (induction learned on random-word sequences alone is not used in text)
$T --out $B/p6 --init $B/p5 --ctx 512 --batch 4 --steps 2000 --lr 1e-3 --p-random 0.7 --random-layout text --eval-every 250 --bf16 --stop-at 250
$T --out $B/p7 --init $B/p6 --ctx 2048 --batch 1 --steps 1500 --lr 1e-3 --p-random 0.6 --random-layout text --eval-every 250 --bf16 --stop-at 500
# 8. mostly text at 2048: the MHA model; the GQA model is the same phase with the KV heads mean-pooled
$T --out $B/austen --init $B/p7 --ctx 2048 --batch 1 --steps 3000 --lr 1e-3 --p-random 0.3 --random-layout text --eval-every 500 --bf16
$T --out $B/austen-gqa --init $B/p7 --n-head-kv 1 --ctx 2048 --batch 1 --steps 3000 --lr 1e-3 --p-random 0.3 --random-layout text --eval-every 500 --bf16
