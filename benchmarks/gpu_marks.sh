#!/bin/bash
# The GPU figures benchmarks/README.md ("On a GPU") reports, in one bounded run: each step has a
# time limit of its own, writes its output to DIR/STEP.log and the script goes on to the next
# whatever it printed, so one slow or failing step costs its limit and no more.
#
#   bash benchmarks/gpu_marks.sh DIR                # every step, in the order below
#   bash benchmarks/gpu_marks.sh DIR 1.4b serve     # the steps named
#
# Steps, their limits adding up to 20.5 minutes (a lent machine's command may run 10 and a
# session has 15 in all: name the steps; "1.4b profile" first says most). On 2026-11-29 an
# H200 took 176, 61, 138 and 59 s for 1.4b, profile, 7b and serve (a fresh machine's start
# and the transfers another 33 s):
#   1.4b    transformers and mmserve on the llava-1.4b checkpoint, mixed workload, 256 requests,
#           with the GPU's busy share, the float32 check and the bfloat16 comparison
#   profile mmserve bench on the same under torch's profiler, steps 30-69: the step's phases
#           (host and GPU time) and the kernels, in DIR/profile (mmserve/bench/profile.py)
#   ahead   mmserve bench on the same: scheduled in step and ahead, alternating, twice each
#   ab      mmserve bench on the same: the fused Triton kernels off and on (MMSERVE_GPU_KERNELS)
#           by 2048- and 8192-token steps, one run each (the first is the runner before both)
#   7b      transformers and mmserve on the llava-7b checkpoint (no float32 check)
#   serve   mmserve serve (the engine in a process of its own, the GPU default) under
#           mmserve bench serve: 256 requests of the mixed workload, 64 at a time
#
# Runs from the repository's root, the project installed, on a machine with a CUDA GPU.
set -u
out=${1:?usage: gpu_marks.sh DIR [STEP...]}
shift
mkdir -p "$out"
[ $# -gt 0 ] || set -- 1.4b profile ab ahead 7b serve

mixed=(--num-prompts 256 --image-sizes mixed --unique-images 128 --shared-prefix-len 64
       --output-len 16:96)

step() {  # step NAME SECONDS COMMAND...: the command, bounded, its output in DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "=== $name (at most $limit s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit status $rc after $((SECONDS - start)) s"
    tail -n 40 "$out/$name.log"
}

for name in "$@"; do
    case $name in
    1.4b)
        step 1.4b 240 python3 benchmarks/compare_transformers.py --device cuda \
            --bench-checkpoint llava-1.4b --workloads mixed --num-prompts 256 \
            --image-sizes mixed --hf-batch-size 64 --mmserve-configs default \
            --fp32-check 32 --fp32-max-tokens 48 ;;
    profile)
        step profile 90 python3 -m mmserve.entrypoints.cli bench throughput \
            --bench-checkpoint llava-1.4b "${mixed[@]}" --no-peak --no-progress \
            --profile "$out/profile" --profile-steps 30:70 ;;
    ahead)
        for turn in 1 2; do
            for mode in --no-async-scheduling --async-scheduling; do
                step "ahead-$turn$mode" 60 python3 -m mmserve.entrypoints.cli bench \
                    throughput --bench-checkpoint llava-1.4b "${mixed[@]}" --no-peak "$mode"
            done
        done ;;
    ab)
        for budget in 2048 8192; do
            for kernels in torch triton; do
                step "ab-$kernels-$budget" 60 env MMSERVE_GPU_KERNELS=$kernels python3 -m \
                    mmserve.entrypoints.cli bench throughput --bench-checkpoint llava-1.4b \
                    "${mixed[@]}" --no-peak --no-progress --max-num-batched-tokens "$budget"
            done
        done ;;
    7b)
        step 7b 240 python3 benchmarks/compare_transformers.py --device cuda \
            --bench-checkpoint llava-7b --workloads mixed --num-prompts 256 \
            --image-sizes mixed --hf-batch-size 64 --mmserve-configs default \
            --fp32-check 0 ;;
    serve)
        step serve 180 python3 -m mmserve.entrypoints.cli bench serve \
            --bench-checkpoint llava-1.4b "${mixed[@]}" --max-concurrency 64 ;;
    *)
        echo "unknown step $name (steps: 1.4b profile ahead ab 7b serve)" >&2
        exit 2 ;;
    esac
done
