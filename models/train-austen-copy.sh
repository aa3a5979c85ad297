#!/usr/bin/env bash
# The phases that made models/austen.q8_0.gguf and models/austen-gqa.q8_0.gguf (the second stage), in order, as they
# were run. They start from the first-stage MHA model (train-austen.sh), whose torch checkpoint is gone: the first
# phase reads its GGUF file from git history (--init MODEL.gguf: its q8_0 weights, dequantized).
# Needs `pip install -e '.[train]'`; ~50 minutes with 2 threads on a CPU with AVX512-BF16.
set -euo pipefail
B=${BUILD:-build}
T="python -m sparq_cpp.train train"
mkdir -p "$B"
git show 98c7b45:models/austen.q8_0.gguf > "$B/austen-stage1.q8_0.gguf"
# 1. random-word chunks (runs of one passage from random places), the passage's words drawn from only 6-48
#    distinct words (--rand-vocab), half of the sequences; copying of random-word chunks rises from 0.12 to 0.84
$T --out $B/copy1 --init $B/austen-stage1.q8_0.gguf --ctx 512 --batch 4 --steps 2000 --lr 1e-3 --p-random 0.5 \
   --random-layout chunks --rand-vocab 6:48 --eval-every 250 --bf16 --threads 2
# 2. the same chunks cut from passages of training text (--rand-text): common tokens recur, so copying has to
#    match several tokens back, as in ordinary text
$T --out $B/copy2 --init $B/copy1 --ctx 512 --batch 4 --steps 3000 --lr 1e-3 --p-random 0.6 \
   --random-layout chunks --rand-text --eval-every 500 --bf16 --threads 2
# 3. the same at the full 2048 context: copying of text forms within 2000 steps (copy_repeat 0.38 -> 0.88)
$T --out $B/austen --init $B/copy2 --ctx 2048 --batch 1 --steps 6000 --lr 1e-3 --p-random 0.5 \
   --random-layout chunks --rand-text --eval-every 1000 --bf16 --threads 2
# 4. the GQA model: phase 3's model with its two KV heads mean-pooled into one, trained on the same way
$T --out $B/austen-gqa --init $B/austen --n-head-kv 1 --ctx 2048 --batch 1 --steps 4000 --lr 1e-3 \
   --p-random 0.5 --random-layout chunks --rand-text --eval-every 1000 --bf16 --threads 2
