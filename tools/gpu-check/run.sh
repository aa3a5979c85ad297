#!/usr/bin/env bash
# sparq-cpp GPU check, written by tools/gpu_check.py (`make gpu-check`): builds the patched llama.cpp of the bundle
# with CUDA, checks GGML_OP_SPARSE_ATTN against the CPU, times it beside flash attention, measures the copy
# bandwidth, writes an 8-layer Llama 2 7B-shaped q8_0 model and runs llama-bench dense against SparQ.
#
#   run.sh [--dry-run] [--budget SECONDS] [STAGE ...]
#
# Stages, in order (default: all): env unpack model configure build build-e2e test opbench bandwidth e2e profile.
# `model` (the model writer) and `build-e2e` (libllama, common, llama-bench) run in the background beside the stages
# after them; e2e waits for both. The whole run has one deadline, --budget seconds from the start (default 570,
# GPU_CHECK_BUDGET): each stage's time limit is min(its own maximum, what is left minus what the stages after it
# keep back), and a stage with less than its minimum left is skipped. A stage that fails or times out does not stop
# the run: every later stage runs unless what it needs is missing (then it is "skipped" with the reason).
# Logs are appended as they grow; $OUT (else <bundle>/out) gets summary.json (rewritten after every stage) and at
# most 7 logs. --dry-run prints every stage, its limit and its commands, with each earlier stage taking its typical
# time on a 16-core H100 machine (--dry-run=worst: its whole limit), writes summary.json with status "planned", and
# runs nothing (no GPU needed).
#
# Environment: CUDACXX (nvcc; else /usr/local/cuda/bin/nvcc, else PATH's), CUDA_ARCH (else the GPU's compute
# capability from nvidia-smi), GPU_CHECK_LIMITS ("stage=max[:reserve[:minimum]],..." seconds), CUBLAS_ROOT (a
# folder holding cublas_v2.h, libcublas.so* and libcublasLt.so*; else the toolkit's cuBLAS, else an nvidia cuBLAS
# wheel in python3's site-packages, as PyTorch installs one), JOBS (build jobs, default nproc), PYTHON (default python3), GPU_CHECK_WORK (sources, build and
# model; default <bundle>-work, kept between runs), E2E_DEPTHS, E2E_SPARSE, E2E_LOKI, E2E_LOKI_DEPTHS, E2E_LAYERS.
set -u -o pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DRY=0
WORST=0
BUDGET="${GPU_CHECK_BUDGET:-570}"
ALL_STAGES=(env unpack model configure build build-e2e test opbench bandwidth e2e profile)
SELECTED=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --dry-run=worst) DRY=1; WORST=1 ;;
        --budget) BUDGET="${2:-}"; shift ;;
        --budget=*) BUDGET="${1#*=}" ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *)  if [[ " ${ALL_STAGES[*]} " == *" $1 "* ]]; then SELECTED+=("$1")
            else echo "run.sh: unknown argument '$1' (stages: ${ALL_STAGES[*]})" >&2; exit 2; fi ;;
    esac
    shift
done
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "run.sh: --budget takes whole seconds, got '$BUDGET'" >&2; exit 2; }
[ ${#SELECTED[@]} -gt 0 ] || SELECTED=("${ALL_STAGES[@]}")

LOGS="${OUT:-$HERE/out}"
WORK="${GPU_CHECK_WORK:-$HERE-work}"
SRC="$WORK/src"
BUILD="$WORK/build"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 16)}"
E2E_LAYERS="${E2E_LAYERS:-8}"
MODEL="$WORK/llama2-7b-L${E2E_LAYERS}.q8_0.gguf"
PROJ="${MODEL%.gguf}.loki.gguf"
E2E_DEPTHS="${E2E_DEPTHS:-32768,4096,16384,65536,8192}"  # 32k first: the depth the targets name
E2E_SPARSE="${E2E_SPARSE:-sparq:r=16,k=128}"
E2E_LOKI="${E2E_LOKI:-loki:d=32,k=128}"          # through LLAMA_SPARSE_ATTN, with proj= the model writer's projection
E2E_LOKI_DEPTHS="${E2E_LOKI_DEPTHS:-32768}"
mkdir -p "$LOGS"
[ $DRY = 1 ] || mkdir -p "$WORK"

# ---- time: one deadline for the run ---------------------------------------------------------------------------
T0=$(date +%s)
VCLOCK=0   # the dry run's clock: each planned stage takes its typical time (--dry-run=worst: its whole limit)
elapsed() { if [ $DRY = 1 ]; then echo $VCLOCK; else echo $(( $(date +%s) - T0 )); fi; }

# stage: maximum seconds, seconds kept back for the stages after it, minimum worth starting; bg: background
declare -A MAX=( [env]=30 [unpack]=60 [model]=300 [configure]=120 [build]=480 [test]=120 [opbench]=180 [bandwidth]=45 [build-e2e]=300 [e2e]=600 [profile]=120 )
declare -A RESERVE=( [env]=0 [unpack]=0 [model]=20 [configure]=0 [build]=160 [test]=100 [opbench]=50 [bandwidth]=30 [build-e2e]=30 [e2e]=5 [profile]=0 )
declare -A MINIMUM=( [env]=5 [unpack]=5 [model]=30 [configure]=10 [build]=60 [test]=15 [opbench]=15 [bandwidth]=5 [build-e2e]=20 [e2e]=20 [profile]=30 )
# typical seconds on a 16-core H100 machine, for the dry run's clock (--dry-run=worst: each stage its whole limit)
declare -A EXPECT=( [env]=5 [unpack]=3 [model]=90 [configure]=30 [build]=300 [test]=40 [opbench]=90 [bandwidth]=10 [build-e2e]=150 [e2e]=120 [profile]=60 )
declare -A BG=( [model]=1 [build-e2e]=1 )
# GPU_CHECK_LIMITS="stage=max[:reserve[:minimum]],...": other limits
for spec in ${GPU_CHECK_LIMITS:+${GPU_CHECK_LIMITS//,/ }}; do
    st=${spec%%=*}; IFS=: read -r mx rs mn <<< "${spec#*=}"
    [ -n "${MAX[$st]:-}" ] && [[ "$mx" =~ ^[0-9]+$ ]] || { echo "run.sh: GPU_CHECK_LIMITS: bad '$spec'" >&2; exit 2; }
    MAX[$st]=$mx; [[ "${rs:-}" =~ ^[0-9]+$ ]] && RESERVE[$st]=$rs; [[ "${mn:-}" =~ ^[0-9]+$ ]] && MINIMUM[$st]=$mn
done

declare -A ST_STATUS ST_RC ST_START ST_SECS ST_LIMIT ST_NOTE ST_CMDS ST_NUMS ST_LOG ST_PID
for s in "${ALL_STAGES[@]}"; do ST_STATUS[$s]="not selected"; ST_RC[$s]=""; ST_START[$s]=""; ST_SECS[$s]=""; ST_LIMIT[$s]=""; ST_NOTE[$s]=""; ST_CMDS[$s]=""; ST_NUMS[$s]=""; ST_LOG[$s]=""; done
for s in "${SELECTED[@]}"; do ST_STATUS[$s]="pending"; done

limit_for() {  # the stage's time limit now (0: not enough time left)
    local s=$1 left lim
    left=$(( BUDGET - $(elapsed) - ${RESERVE[$s]} ))
    lim=${MAX[$s]}
    [ $left -lt $lim ] && lim=$left
    [ $lim -lt ${MINIMUM[$s]} ] && lim=0
    echo $lim
}

# ---- JSON ----------------------------------------------------------------------------------------------------
jstr() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\t'/\\t}; s=${s//$'\r'/}; s=${s//$'\n'/\\n}; s=${s//$'\e'/}; printf '"%s"' "$s"; }
jnum() { if [[ "${1:-}" =~ ^-?[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?$ ]]; then printf '%s' "$1"; else printf 'null'; fi; }
num() {  # num KEY VALUE: a number (or null) into the current stage's numbers
    ST_NUMS[$STAGE]+="${ST_NUMS[$STAGE]:+, }$(jstr "$1"): $(jnum "${2:-}")"; }
str() {  # str KEY VALUE: a string into the current stage's numbers
    ST_NUMS[$STAGE]+="${ST_NUMS[$STAGE]:+, }$(jstr "$1"): $(jstr "${2:-}")"; }
raw() {  # raw KEY JSON
    ST_NUMS[$STAGE]+="${ST_NUMS[$STAGE]:+, }$(jstr "$1"): $2"; }

# the same into REPLY, without a subshell (the summary is written often)
jstr_r() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\t'/\\t}; s=${s//$'\r'/}; s=${s//$'\n'/\\n}; s=${s//$'\e'/}; REPLY="\"$s\""; }
jnum_r() { if [[ "${1:-}" =~ ^-?[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?$ ]]; then REPLY=$1; else REPLY=null; fi; }

SERIES_LINE=""
[ -f "$HERE/SERIES" ] && SERIES_LINE=$(tr '\n' ' ' < "$HERE/SERIES" | cut -c1-400)

write_summary() {
    local f="$LOGS/summary.json" s c cmds body="" e
    for s in "${ALL_STAGES[@]}"; do
        cmds=""
        while IFS= read -r c; do [ -n "$c" ] && { jstr_r "$c"; cmds+="${cmds:+, }$REPLY"; }; done <<< "${ST_CMDS[$s]}"
        jstr_r "$s"; e="{\"name\": $REPLY"
        jstr_r "${ST_STATUS[$s]}"; e+=", \"status\": $REPLY"
        [ -n "${BG[$s]:-}" ] && e+=", \"background\": true" || e+=", \"background\": false"
        jnum_r "${ST_RC[$s]}"; e+=", \"rc\": $REPLY"
        jnum_r "${ST_START[$s]}"; e+=", \"start_s\": $REPLY"
        jnum_r "${ST_SECS[$s]}"; e+=", \"seconds\": $REPLY"
        jnum_r "${ST_LIMIT[$s]}"; e+=", \"limit_s\": $REPLY"
        jstr_r "${ST_LOG[$s]}"; e+=", \"log\": $REPLY"
        jstr_r "${ST_NOTE[$s]}"; e+=", \"note\": $REPLY"
        e+=", \"commands\": [$cmds], \"numbers\": {${ST_NUMS[$s]}}}"
        body+="${body:+,}"$'\n  '"$e"
    done
    local head
    jstr_r "$SERIES_LINE"; head="{\"schema\": 1, \"dry_run\": $([ $DRY = 1 ] && echo true || echo false), \"budget_s\": $BUDGET, \"elapsed_s\": $(elapsed), \"bundle\": $REPLY"
    jstr_r "$WORK"; head+=", \"work\": $REPLY"
    jstr_r "$LOGS"; head+=", \"out\": $REPLY"
    printf '%s,\n "stages": [%s\n]}\n' "$head" "$body" > "$f.tmp" && mv -f "$f.tmp" "$f"
}

# ---- running commands ----------------------------------------------------------------------------------------
STAGE=""
STAGE_END=0
note() { ST_NOTE[$STAGE]+="${ST_NOTE[$STAGE]:+; }$*"; }

record() { ST_CMDS[$STAGE]+="$*"$'\n'; }

exec_cmd() {  # exec_cmd LOG CMD...: run CMD, killed at the stage's deadline, its output appended to LOG
    local log=$1; shift
    if [ $DRY = 1 ]; then echo "      \$ $*    >> $log"; return 0; fi
    local left=$(( STAGE_END - $(date +%s) ))
    if [ $left -le 0 ]; then echo "[$STAGE: deadline passed before: $*]" >> "$LOGS/$log"; return 124; fi
    echo "[$STAGE +$(elapsed)s, ${left}s left] \$ $*" >> "$LOGS/$log"
    timeout -k 10 "$left" "$@" >> "$LOGS/$log" 2>&1 < /dev/null
    local rc=$?
    echo "[$STAGE +$(elapsed)s] rc=$rc" >> "$LOGS/$log"
    return $rc
}

run() { record "${@:2}"; exec_cmd "$@"; }  # run LOG CMD...: one command of the current stage

bg_run() {  # bg_run LOG CMD...: as run, in the background; its exit status goes to $WORK/.<stage>.rc
    record "${@:2}"
    if [ $DRY = 1 ]; then exec_cmd "$@"; finish 0; return; fi
    rm -f "$WORK/.$STAGE.rc"
    ( exec_cmd "$@"; echo $? > "$WORK/.$STAGE.rc.tmp"; mv "$WORK/.$STAGE.rc.tmp" "$WORK/.$STAGE.rc" ) &
    ST_PID[$STAGE]=$!
}

run_to() {  # run_to FILE LOG CMD...: as run, stdout to FILE (kept as it grows, then appended to LOG), stderr to LOG
    local file=$1 log=$2; shift 2
    record "$* > $(basename "$file")"
    if [ $DRY = 1 ]; then echo "      \$ $* > $(basename "$file")  2>> $log"; return 0; fi
    local left=$(( STAGE_END - $(date +%s) ))
    if [ $left -le 0 ]; then echo "[$STAGE: deadline passed before: $*]" >> "$LOGS/$log"; return 124; fi
    echo "[$STAGE +$(elapsed)s, ${left}s left] \$ $* > $file" >> "$LOGS/$log"
    timeout -k 10 "$left" "$@" > "$file" 2>> "$LOGS/$log" < /dev/null
    local rc=$?
    cat "$file" >> "$LOGS/$log"
    echo "[$STAGE +$(elapsed)s] rc=$rc" >> "$LOGS/$log"
    return $rc
}

q() {  # a quick probe whose output is a value: at most 20 s, and not past the stage's deadline
    local left=$(( STAGE_END - $(date +%s) ))
    [ $left -gt 20 ] && left=20
    [ $left -lt 1 ] && left=1
    timeout -k 2 "$left" "$@" 2>/dev/null
}

status_of() { case $1 in 0) echo ok ;; 124|137) echo timeout ;; *) echo failed ;; esac; }

begin() {  # begin STAGE LOG: 0 when the stage is to run (its limit set), 1 when skipped
    STAGE=$1
    ST_LOG[$STAGE]=$2
    local lim; lim=$(limit_for "$STAGE")
    ST_START[$STAGE]=$(elapsed)
    ST_LIMIT[$STAGE]=$lim
    if [ "$lim" -le 0 ]; then
        ST_STATUS[$STAGE]="skipped"; note "not enough time left ($(( BUDGET - $(elapsed) ))s of ${BUDGET}s, minimum ${MINIMUM[$STAGE]}s, ${RESERVE[$STAGE]}s kept for later stages)"
        echo "== $STAGE: skipped (time)"
        write_summary; return 1
    fi
    STAGE_END=$(( $(date +%s) + lim ))
    ST_STATUS[$STAGE]=$([ $DRY = 1 ] && echo planned || echo running)
    echo "== $STAGE: limit ${lim}s, starts at +${ST_START[$STAGE]}s$([ -n "${BG[$STAGE]:-}" ] && echo ' (background)')"
    write_summary
    return 0
}

finish() {  # finish RC: the current stage's status from the exit status of its last (or first failing) command
    local rc=$1
    if [ $DRY = 1 ]; then
        local t=${EXPECT[$STAGE]}
        [ $WORST = 1 ] || [ "$t" -gt "${ST_LIMIT[$STAGE]}" ] && t=${ST_LIMIT[$STAGE]}
        ST_STATUS[$STAGE]=planned; ST_SECS[$STAGE]=$t
        [ -n "${BG[$STAGE]:-}" ] || VCLOCK=$(( VCLOCK + t ))
    else
        ST_RC[$STAGE]=$rc; ST_STATUS[$STAGE]=$(status_of "$rc"); ST_SECS[$STAGE]=$(( $(elapsed) - ST_START[$STAGE] ))
        echo "== $STAGE: ${ST_STATUS[$STAGE]} (rc $rc, ${ST_SECS[$STAGE]}s)"
        [ -n "${ST_LOG[$STAGE]}" ] && [ -f "$LOGS/${ST_LOG[$STAGE]}" ] && tail -n 6 "$LOGS/${ST_LOG[$STAGE]}" | sed 's/^/   | /' | cut -c1-220
    fi
    write_summary
}

skip() {  # skip REASON: the current stage cannot run (what it needs is missing)
    ST_STATUS[$STAGE]=skipped; note "$*"; echo "== $STAGE: skipped: $*"; write_summary; }

selected() { [[ " ${SELECTED[*]} " == *" $1 "* ]]; }

# ---- what env finds (placeholders in a dry run) --------------------------------------------------------------
NVCC="<nvcc>"; CUDA_ROOT="<toolkit>"; ARCH="${CUDA_ARCH:-<compute capability from nvidia-smi>}"
CUBLAS_ARGS=(); VMM_ARGS=(); CUBLAS_LIB=""; GEN=(-G Ninja)
[ $DRY = 1 ] && CUBLAS_ARGS=("<cuBLAS: the toolkit's, or -DCMAKE_CUDA_FLAGS=-I<wheel>/include -DCUDA_cublas_LIBRARY=... -DCUDA_cublasLt_LIBRARY=...>") \
             && VMM_ARGS=("<-DGGML_CUDA_NO_VMM=ON when no libcuda.so is found>")
BIN="$BUILD/bin"
RUN_LD() { echo "LD_LIBRARY_PATH=$BIN${CUBLAS_LIB:+:$CUBLAS_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; }

CUBLAS_WHERE=""; DRIVER_WHERE=""; CUBLAS_INC=""
find_cublas() {  # sets CUBLAS_WHERE, CUBLAS_ARGS, CUBLAS_LIB
    local d inc lib lt cand=()
    [ -n "${CUBLAS_ROOT:-}" ] && from_wheel "$CUBLAS_ROOT" && { CUBLAS_WHERE="CUBLAS_ROOT $CUBLAS_ROOT"; return 0; }
    for d in "$CUDA_ROOT" "$CUDA_ROOT/targets/x86_64-linux"; do
        [ -f "$d/include/cublas_v2.h" ] || continue
        for lib in "$d/lib64" "$d/lib"; do
            if compgen -G "$lib/libcublas.so*" > /dev/null; then CUBLAS_WHERE="toolkit $d"; CUBLAS_LIB=$lib; return 0; fi
        done
    done
    while IFS= read -r d; do [ -d "$d/nvidia" ] && cand+=("$d/nvidia"); done < <(q "$PYTHON" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path[1:]))')
    for d in /opt/*/.venv/lib/python3*/site-packages /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages; do
        [ -d "$d/nvidia" ] && cand+=("$d/nvidia")
    done
    for d in "${cand[@]}"; do
        from_wheel "$d" && { CUBLAS_WHERE="wheel $(dirname "$CUBLAS_INC")"; return 0; }
    done
    CUBLAS_WHERE="none found (CUBLAS_ROOT, toolkit, python site-packages)"; return 1
}

from_wheel() {  # from_wheel DIR: cuBLAS's header and libraries under DIR (a wheel's layout) -> CUBLAS_ARGS, CUBLAS_LIB
    local d=$1 inc lib lt
    [ -d "$d" ] || return 1
    inc=$(find -L "$d" -maxdepth 4 -name cublas_v2.h 2>/dev/null | sort | head -1)
    lib=$(find -L "$d" -maxdepth 4 -name 'libcublas.so*' 2>/dev/null | sort | head -1)
    lt=$(find -L "$d" -maxdepth 4 -name 'libcublasLt.so*' 2>/dev/null | sort | head -1)
    [ -n "$inc" ] && [ -n "$lib" ] && [ -n "$lt" ] || return 1
    # cuBLAS's headers alone: a wheel folder can hold other CUDA headers, of another version than nvcc's
    local only="$WORK/cublas-include" h
    rm -rf "$only"; mkdir -p "$only"
    for h in "$(dirname "$inc")"/cublas*.h; do ln -s "$h" "$only/"; done
    CUBLAS_ARGS=("-DCMAKE_CUDA_FLAGS=-I$only" "-DCUDA_cublas_LIBRARY=$lib" "-DCUDA_cublasLt_LIBRARY=$lt")
    CUBLAS_LIB=$(dirname "$lib")
    CUBLAS_INC=$(dirname "$inc")
}

find_driver_lib() {  # sets DRIVER_WHERE, VMM_ARGS: the driver library that ggml's VMM pool links, else NO_VMM
    local d p
    for d in lib64 lib targets/x86_64-linux/lib; do
        [ -f "$CUDA_ROOT/$d/stubs/libcuda.so" ] && { DRIVER_WHERE="stub $CUDA_ROOT/$d/stubs/libcuda.so"; return 0; }
    done
    p=$(q ldconfig -p | awk '$1 == "libcuda.so" {print $NF; exit}')
    for d in "$p" /usr/lib/x86_64-linux-gnu/libcuda.so /usr/lib64/libcuda.so /usr/local/nvidia/lib64/libcuda.so /usr/local/nvidia/lib/libcuda.so; do
        [ -n "$d" ] && [ -e "$d" ] && { VMM_ARGS=("-DCUDA_cuda_driver_LIBRARY=$d"); DRIVER_WHERE="driver $d"; return 0; }
    done
    VMM_ARGS=(-DGGML_CUDA_NO_VMM=ON)
    DRIVER_WHERE="none (GGML_CUDA_NO_VMM=ON)"; return 1
}

# ---- stages --------------------------------------------------------------------------------------------------
stage_env() {
    begin env env.log || return
    run env.log uname -a
    run env.log nvidia-smi
    run env.log nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    run env.log bash -c 'nproc; free -g; df -h .; command -v nvcc cmake ninja gcc g++ python3 ncu; cmake --version; ninja --version; g++ --version; nvcc --version; ldconfig -p | grep -E "libcuda\.so|libcublas" || true'
    if [ $DRY = 1 ]; then finish 0; return; fi
    local cap gpu drv cub drvlib
    gpu=$(q nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    cap=$(q nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' ')
    drv=$(q nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
    if [ -n "${CUDA_ARCH:-}" ]; then ARCH=$CUDA_ARCH; note "CUDA_ARCH=$CUDA_ARCH given"
    elif [[ "$cap" =~ ^[0-9]+\.[0-9]+$ ]]; then ARCH=${cap/./}
    else ARCH=90; note "no compute capability from nvidia-smi: building sm_90"; fi
    if [ -n "${CUDACXX:-}" ]; then NVCC=$CUDACXX
    elif [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc
    else NVCC=$(command -v nvcc || echo ""); fi
    [ -n "$NVCC" ] && CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")") || { NVCC=nvcc; CUDA_ROOT=/usr/local/cuda; note "nvcc not found"; }
    command -v ninja > /dev/null || GEN=()
    find_cublas; cub=$CUBLAS_WHERE
    find_driver_lib; drvlib=$DRIVER_WHERE
    { echo "gpu: $gpu"; echo "compute capability: $cap -> CMAKE_CUDA_ARCHITECTURES=$ARCH"; echo "driver: $drv";
      echo "nvcc: $NVCC (toolkit $CUDA_ROOT)"; echo "cuBLAS: $cub ${CUBLAS_ARGS[*]}"; echo "driver library: $drvlib ${VMM_ARGS[*]}"; } >> "$LOGS/env.log"
    str gpu "$gpu"; str compute_cap "$cap"; str cuda_arch "$ARCH"; str driver "$drv"
    str nvcc "$NVCC"; str nvcc_version "$(q "$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
    str cmake_version "$(q cmake --version | head -1 | awk '{print $3}')"; str ninja "$(q ninja --version)"
    str cxx "$(q g++ --version | head -1)"; str python "$(q "$PYTHON" -c 'import sys, numpy; print(sys.executable, sys.version.split()[0], "numpy", numpy.__version__)')"
    str cublas "$cub"; str driver_library "$drvlib"; num jobs "$JOBS"; num nproc "$(nproc)"
    num gpu_memory_mib "$(q nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)"
    [ -n "$gpu" ] || note "nvidia-smi found no GPU"
    finish 0
}

stage_unpack() {
    begin unpack env.log || return
    if [ $DRY = 0 ] && cmp -s "$HERE/SERIES" "$WORK/SERIES" && [ -f "$SRC/CMakeLists.txt" ]; then
        note "sources of this bundle already unpacked"; finish 0; return
    fi
    # new sources: the builds go too (the tarball's file times may be older than objects built from other sources)
    run env.log rm -rf "$SRC" "$WORK/SERIES" "$BUILD" "$WORK/build-ops"
    run env.log mkdir -p "$SRC"
    run env.log tar xzf "$HERE/llama-trimmed.tar.gz" -C "$SRC"
    local rc=$?
    [ $rc = 0 ] && [ $DRY = 0 ] && cp "$HERE/SERIES" "$WORK/SERIES"
    finish $rc
}

stage_model() {  # background: the model writer (numpy, the bundle's copy of gguf and sparq_cpp)
    begin model model.log || return
    if [ $DRY = 0 ] && [ -f "$MODEL" ] && [ -f "$PROJ" ]; then note "model already written: $MODEL"; finish 0; return; fi
    if [ $DRY = 0 ] && [ ! -f "$SRC/sparq/write_model.py" ]; then skip "no model writer (unpack failed)"; return; fi
    bg_run model.log "$PYTHON" "$SRC/sparq/write_model.py" "$MODEL" "$E2E_LAYERS" --loki
}

stage_configure() {
    begin configure configure.log || return
    if [ $DRY = 0 ] && [ ! -f "$SRC/CMakeLists.txt" ]; then skip "no sources (unpack failed)"; return; fi
    local common=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DGGML_CUDA=ON
        "-DCMAKE_CUDA_ARCHITECTURES=$ARCH" "-DCMAKE_CUDA_COMPILER=$NVCC" -DGGML_CUDA_GRAPHS=ON
        -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_FA_QUANTS=f16-f16,q8_0-q8_0 -DGGML_CUDA_NCCL=OFF
        "${CUBLAS_ARGS[@]}" "${VMM_ARGS[@]}")
    run configure.log cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" "${common[@]}" -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=ON \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF
    local rc=$?
    str tree "llama.cpp (ggml, libllama, common, test-backend-ops, sparq-op-bench, llama-bench)"
    if [ $rc != 0 ] || [ $DRY = 1 ]; then
        # ggml and test-backend-ops alone (the bundle's sparq-ops/CMakeLists.txt), without the VMM pool
        [ $DRY = 1 ] && echo "      (if that fails:)" || { note "the whole tree did not configure (rc $rc): ggml and test-backend-ops only, GGML_CUDA_NO_VMM=ON"; BUILD="$WORK/build-ops"; BIN="$BUILD/bin"; E2E_OK=0; }
        local ops=() a
        for a in "${common[@]}"; do [[ "$a" == -DCUDA_cuda_driver_LIBRARY=* || "$a" == -DGGML_CUDA_NO_VMM* || "$a" == "<-D"* ]] || ops+=("$a"); done
        run configure.log cmake -S "$SRC/sparq-ops" -B "$WORK/build-ops" "${GEN[@]}" "${ops[@]}" -DGGML_CUDA_NO_VMM=ON
        local rc2=$?
        [ $DRY = 1 ] || { rc=$rc2; ST_NUMS[configure]=""; str tree "ggml, test-backend-ops, sparq-op-bench (sparq-ops)"; }
    fi
    finish $rc
}
E2E_OK=1

stage_build() {
    begin build build.log || return
    if [ $DRY = 0 ] && [ ! -f "$BUILD/CMakeCache.txt" ]; then skip "not configured"; return; fi
    run build.log cmake --build "$BUILD" --target test-backend-ops -j "$JOBS"
    local rc=$?
    run build.log cmake --build "$BUILD" --target sparq-op-bench -j "$JOBS"  # one file more, after the one that matters
    [ $DRY = 1 ] || { num objects_built "$(grep -cE '^\[[0-9]+/[0-9]+\] ' "$LOGS/build.log")"
                      str test_backend_ops "$([ -x "$BIN/test-backend-ops" ] && echo built || echo missing)"
                      str sparq_op_bench "$([ -x "$BIN/sparq-op-bench" ] && echo built || echo missing)"; }
    finish $rc
}

stage_test() {
    begin test test.log || return
    if [ $DRY = 0 ] && [ ! -x "$BIN/test-backend-ops" ]; then skip "test-backend-ops not built"; return; fi
    run test.log env "$(RUN_LD)" "$BIN/test-backend-ops" test -o SPARSE_ATTN -b CUDA0
    local rc=$?
    if [ $DRY = 0 ]; then
        local line; line=$(grep -oE '[0-9]+/[0-9]+ tests passed' "$LOGS/test.log" | tail -1)
        num passed "${line%%/*}"; line=${line#*/}; num total "${line%% *}"
        num failed "$(grep -cE '^ +[A-Z_]+\(.*FAIL' "$LOGS/test.log")"; num not_supported "$(grep -c 'not supported' "$LOGS/test.log")"
    fi
    finish $rc
}

perf_cases() {  # perf_cases FILE: the timed cases of a test-backend-ops perf log as a JSON list
    local out="" line name us gbs
    while IFS= read -r line; do
        name=$(sed -E 's/^ *([A-Z_]+\([^)]*\)):.*/\1/' <<< "$line")
        us=$(sed -nE 's/.* ([0-9.]+) us\/run.*/\1/p' <<< "$line")
        gbs=$(sed -nE 's/.* ([0-9.]+) GB\/s.*/\1/p' <<< "$line")
        out+="${out:+, }{\"case\": $(jstr "$name"), \"us_per_run\": $(jnum "$us"), \"gb_s\": $(jnum "$gbs")}"
    done < <(grep -E 'us/run' "$1" 2>/dev/null)
    echo "[$out]"
}

layered_cases() {  # layered_cases FILE: sparq-op-bench's lines as a JSON list: SparQ's speed-up over flash attention
    # (fused and composed), and the composed path's against the fused op (fused us / composed us: above 1, composed is faster)
    local out="" line key op us gbs scratch
    declare -A flash=() fused=()
    ratio() {  # ratio A B: A / B to 3 decimals, empty unless both are positive
        [ -n "${1:-}" ] && [ -n "${2:-}" ] && awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", a / b }'
    }
    while IFS= read -r line; do
        key=$(sed -nE 's/^op=(flash|sparq) (type=[^ ]+ nh=[0-9]+ kv=[0-9]+).*us_per_layer=([0-9.]+).*/\1 \2 \3/p' <<< "$line")
        case "$key" in
            flash\ *) key=${key#flash }; flash[${key% *}]=${key##* } ;;
            sparq\ *) key=${key#sparq }; fused[${key% *}]=${key##* } ;;
        esac
    done < <(grep -E '^op=(flash|sparq) .*us_per_layer=' "$1" 2>/dev/null)
    while IFS= read -r line; do
        op=$(sed -nE 's/^op=([a-z-]+) .*/\1/p' <<< "$line")
        key=$(sed -nE 's/^op=[a-z-]+ (type=[^ ]+ nh=[0-9]+ kv=[0-9]+).*/\1/p' <<< "$line")
        us=$(sed -nE 's/.*us_per_layer=([0-9.]+).*/\1/p' <<< "$line")
        gbs=$(sed -nE 's/.*gb_s=([0-9.]+).*/\1/p' <<< "$line")
        local extra=""
        if [ "$op" != flash ]; then
            extra=", \"speedup_over_flash\": $(jnum "$(ratio "${flash[$key]:-}" "$us")")"
        fi
        if [ "$op" = sparq-composed ]; then
            scratch=$(sed -nE 's/.*scratch_bytes_per_layer=([0-9]+).*/\1/p' <<< "$line")
            extra+=", \"speedup_over_fused\": $(jnum "$(ratio "${fused[$key]:-}" "$us")"), \"scratch_bytes_per_layer\": $(jnum "$scratch")"
        fi
        out+="${out:+, }{\"op\": $(jstr "$op"), \"case\": $(jstr "$key"), \"us_per_layer\": $(jnum "$us"), \"gb_s\": $(jnum "$gbs")$extra}"
    done < <(grep -E '^op=[a-z-]+ .*us_per_layer=' "$1" 2>/dev/null)
    echo "[$out]"
}

stage_opbench() {
    begin opbench bench.log || return
    if [ $DRY = 0 ] && [ ! -x "$BIN/test-backend-ops" ]; then skip "test-backend-ops not built"; return; fi
    # SparQ and Loki at the decode shapes (4k-32k cells; each case repeats the op on one set of tensors, so the parts
    # of the cache that fit in L2 stay there), then flash attention there
    run_to "$WORK/perf-sparse.txt" bench.log env "$(RUN_LD)" "$BIN/test-backend-ops" perf -o SPARSE_ATTN -b CUDA0
    local rc1=$?
    run_to "$WORK/perf-fa.txt" bench.log env "$(RUN_LD)" "$BIN/test-backend-ops" perf -o FLASH_ATTN_EXT -b CUDA0 \
        -p 'hsk=128,hsv=128,nh=(32|8),nr23=\[(1|4),1\],kv=(4096|16384|32768),nb=1,'
    local rc2=$?
    [ $DRY = 1 ] || { raw sparse_attn "$(perf_cases "$WORK/perf-sparse.txt")"; raw flash_attn "$(perf_cases "$WORK/perf-fa.txt")"; }
    # the same shapes over many layers' caches (SparQ reads 256 MiB per pass, more than L2 holds), beside flash attention
    local rc3=0
    if [ $DRY = 1 ] || [ -x "$BIN/sparq-op-bench" ]; then
        run_to "$WORK/op-bench.txt" bench.log env "$(RUN_LD)" "$BIN/sparq-op-bench" -b CUDA0 -r 20
        rc3=$?
        [ $DRY = 1 ] || raw layered "$(layered_cases "$WORK/op-bench.txt")"
    else
        note "sparq-op-bench not built"
    fi
    finish $(( rc1 != 0 ? rc1 : rc2 != 0 ? rc2 : rc3 ))
}

stage_bandwidth() {
    begin bandwidth bench.log || return
    if [ $DRY = 0 ] && [ ! -f "$SRC/sparq/bw.cu" ]; then skip "no sources"; return; fi
    run bench.log "$NVCC" -O2 "-arch=sm_$ARCH" -o "$WORK/sparq-bw" "$SRC/sparq/bw.cu"
    local rc=$?
    run_to "$WORK/bw.txt" bench.log "$WORK/sparq-bw" 1024 20
    rc=$(( rc != 0 ? rc : $? ))
    [ $DRY = 1 ] || { num copy_gb_s "$(sed -nE 's/^copy_gb_s ([0-9.]+).*/\1/p' "$WORK/bw.txt" 2>/dev/null)"
                      num kernel_copy_gb_s "$(sed -nE 's/^kernel_copy_gb_s ([0-9.]+).*/\1/p' "$WORK/bw.txt" 2>/dev/null)"
                      str device "$(sed -n 's/^device //p' "$WORK/bw.txt" 2>/dev/null)"; }
    finish $rc
}

stage_build_e2e() {  # background, niced, beside test/opbench/bandwidth (which use the GPU)
    begin build-e2e build.log || return
    note "runs beside test, opbench and bandwidth at nice 19 with 2 cores left free"
    if [ $DRY = 0 ] && { [ $E2E_OK = 0 ] || [ ! -f "$BUILD/CMakeCache.txt" ]; }; then skip "the tree with libllama did not configure"; return; fi
    local j=$(( JOBS > 4 ? JOBS - 2 : JOBS ))
    bg_run build.log nice -n 19 cmake --build "$BUILD" --target llama-bench -j "$j"
}

wait_bg() {  # wait_bg STAGE: the background stage's result
    local s=$1 pid=${ST_PID[$1]:-} rc
    [ -n "$pid" ] || return 0
    wait "$pid"
    rc=$(cat "$WORK/.$s.rc" 2>/dev/null || echo 1)
    local keep=$STAGE; STAGE=$s
    ST_RC[$s]=$rc; ST_STATUS[$s]=$(status_of "$rc"); ST_SECS[$s]=$(( $(stat -c %Y "$WORK/.$s.rc" 2>/dev/null || date +%s) - T0 - ST_START[$s] ))
    [ $s = build-e2e ] && str llama_bench "$([ -x "$BIN/llama-bench" ] && echo built || echo missing)"
    [ $s = model ] && { str model "$MODEL"; num bytes "$(stat -c %s "$MODEL" 2>/dev/null)"; }
    echo "== $s (background): ${ST_STATUS[$s]} (rc $rc, ${ST_SECS[$s]}s)"
    STAGE=$keep
    ST_PID[$s]=""
    write_summary
}

stage_e2e() {
    begin e2e e2e.log || return
    [ $DRY = 1 ] && echo "      (waits for model and build-e2e)"
    [ $DRY = 1 ] || { wait_bg model; wait_bg build-e2e; STAGE=e2e; }
    if [ $DRY = 0 ]; then
        [ -x "$BIN/llama-bench" ] || { skip "llama-bench not built"; return; }
        [ -f "$MODEL" ] || { skip "no model"; return; }
    fi
    local d rc=0 r dense sparse loki depths="" dl="" sl="" su="" ll="" lu=""
    # per depth, dense then sparse, so that a deadline cuts the last pairs only
    for d in ${E2E_DEPTHS//,/ }; do
        run_to "$WORK/e2e-dense-$d.jsonl" e2e.log env "$(RUN_LD)" "$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -p 0 -n 32 -r 3 -d "$d" -o jsonl
        r=$?; [ $r != 0 ] && rc=$r
        run_to "$WORK/e2e-sparse-$d.jsonl" e2e.log env "$(RUN_LD)" "$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -p 0 -n 32 -r 3 -d "$d" -o jsonl --sparse-attn "$E2E_SPARSE"
        r=$?; [ $r != 0 ] && rc=$r
        if [[ ",$E2E_LOKI_DEPTHS," == *",$d,"* ]] && { [ $DRY = 1 ] || [ -f "$PROJ" ]; }; then
            run_to "$WORK/e2e-loki-$d.jsonl" e2e.log env "$(RUN_LD)" "LLAMA_SPARSE_ATTN=$E2E_LOKI,proj=$PROJ" "$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -p 0 -n 32 -r 3 -d "$d" -o jsonl
            r=$?; [ $r != 0 ] && rc=$r
        fi
        [ $DRY = 1 ] && continue
        loki=$(sed -nE 's/.*"avg_ts": *([0-9.eE+-]+).*/\1/p' "$WORK/e2e-loki-$d.jsonl" 2>/dev/null | head -1)
        [ -n "$loki" ] && { ll+="${ll:+, }\"$d\": $(jnum "$loki")"
            lu+="${lu:+, }\"$d\": $(jnum "$(awk -v a="$(sed -nE 's/.*"avg_ts": *([0-9.eE+-]+).*/\1/p' "$WORK/e2e-dense-$d.jsonl" 2>/dev/null | head -1)" -v b="$loki" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", b / a }')")"; }
        dense=$(sed -nE 's/.*"avg_ts": *([0-9.eE+-]+).*/\1/p' "$WORK/e2e-dense-$d.jsonl" 2>/dev/null | head -1)
        sparse=$(sed -nE 's/.*"avg_ts": *([0-9.eE+-]+).*/\1/p' "$WORK/e2e-sparse-$d.jsonl" 2>/dev/null | head -1)
        depths+="${depths:+, }$d"; dl+="${dl:+, }\"$d\": $(jnum "$dense")"; sl+="${sl:+, }\"$d\": $(jnum "$sparse")"
        su+="${su:+, }\"$d\": $(jnum "$(awk -v a="$dense" -v b="$sparse" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", b / a }')")"
        ST_NUMS[e2e]=""; str sparse_attn "$E2E_SPARSE"; str model "$MODEL"; raw depths "[$depths]"
        raw dense_tg_ts "{$dl}"; raw sparse_tg_ts "{$sl}"; raw speedup "{$su}"
        [ -n "$ll" ] && { str loki "$E2E_LOKI"; raw loki_tg_ts "{$ll}"; raw loki_speedup "{$lu}"; }
        write_summary
    done
    finish $rc
}

stage_profile() {  # what time e2e leaves: Nsight Compute's per-kernel summary of both ops at 32k (one layer, f16 and q8_0)
    begin profile bench.log || return
    local ncu="<ncu>"
    if [ $DRY = 0 ]; then
        ncu=$(command -v ncu || ls -d /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
        [ -n "$ncu" ] && [ -x "$ncu" ] || { skip "ncu not found"; return; }
        [ -x "$BIN/sparq-op-bench" ] || { skip "sparq-op-bench not built"; return; }
    fi
    run_to "$WORK/ncu.txt" bench.log env "$(RUN_LD)" "$ncu" --clock-control none --print-summary per-kernel --section SpeedOfLight --launch-count 200 \
        -k 'regex:sparse_attn|flash_attn' "$BIN/sparq-op-bench" -b CUDA0 --types f16,q8_0 --nh 8,32 --kv 32768 -l 1 -r 1 --ops sparq,flash
    finish $?
}

echo "sparq-cpp GPU check: budget ${BUDGET}s, logs in $LOGS$([ $DRY = 1 ] && echo ', dry run: nothing is executed')"
write_summary
for s in "${ALL_STAGES[@]}"; do
    selected "$s" || continue
    case $s in
        env) stage_env ;; unpack) stage_unpack ;; model) stage_model ;; configure) stage_configure ;;
        build) stage_build ;; build-e2e) stage_build_e2e ;; test) stage_test ;; opbench) stage_opbench ;;
        bandwidth) stage_bandwidth ;; e2e) stage_e2e ;; profile) stage_profile ;;
    esac
done
[ $DRY = 1 ] || { wait_bg model; wait_bg build-e2e; }
write_summary
echo "summary: $LOGS/summary.json ($(elapsed)s of ${BUDGET}s)"
