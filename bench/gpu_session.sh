#!/usr/bin/env bash
# One call on the lent GPU machine: build, then the named stages, each under its own time limit,
# logs and JSON under $OUT (default ./gpu-out). A stage cut short still leaves its progress lines.
#
#   bash bench/gpu_session.sh tests kernels cache                        # about 8 minutes
#   bash bench/gpu_session.sh kv-grow kv-grow-skewed                      # about 6 minutes
#   bash bench/gpu_session.sh offload                                     # about 7 minutes
#   PACK=1 OUT=$OUT bash bench/gpu_session.sh tests profile-decode16     # one .tgz back
#
# Stages (minutes, roughly): tests (4: pytest -m cuda over CUDA_TESTS, default tests, under
# TESTS_TIMEOUT seconds, default 420, TESTS_K a -k expression, a test's stacks dumped past
# TESTS_DUMP_S seconds, default 45), kernels (1:
# bench/grouped_experts.py, the bf16 and the quantized decode kernels; KERNELS_ARGS adds
# flags, e.g. `--presets qwen3-30b-a3b --valid-rows 2,3`: the quantized kernels over a split
# call's few valid rows),
# host (0.2: bench/cache_host.py, the host's share of a cache layer call, on that machine's
# CPU), layer-call (1: bench/layer_call.py on the GPU, one-token calls through the decode path
# and the general one, split into the CPU kernel, the hits' launches, the wait and the rest:
# tiny widths, then olmoe-1b-7b's widths cut to 2 layers, half the experts cached, one JSON
# object a line in layer-call.jsonl), layer-call-passive (0.5: its real widths again with
# OMP_WAIT_POLICY=PASSIVE), cache (3: bench/cache.py at 4 GiB against accelerate),
# kv-grow (2: the short chat at the reference's proportions, start cells 1/12 of the window),
# kv-grow-skewed (2.5: the same on a model whose routing favours some experts), kv-grow-32k
# (3: the 32K prompt, start cells 1/12 too), kv-grow-32k-skewed (4: the same on the skewed
# model), kv-int8 (4: the kv-grow stage's runs with the K/V's cells in bf16 and in int8, on
# the skewed model, 2 rounds: decode and prefill tok/s and slots, int8 against bf16),
# kv-int8-32k (4: the elastic K/V alone, bf16 and int8, the 32K prompt's prefill and the
# decode after it), agents (4: the reference's agent scenario through Engine, bench/agents.py,
# on the kv-grow checkpoint), serve (6: the same scenario at half its lengths, in-process and
# through `strata serve` with the openai client,
# bench/serve.py; the machine has no network, so its packages come from wheels carried in
# build/serve-wheels: `python -m pip download --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 -d build/serve-wheels fastapi uvicorn prometheus-client
# openai httpx`), cpu-experts (1.5: bench/cpu_experts.py, strata's CPU kernel against torch's
# matmuls and the host's read bandwidth, olmoe and qwen3 experts), prefill (7: bench/decode.py
# at 32, 512, 4,096 and 16,384 prompt tokens against transformers, on olmoe and qwen3 cut to 4
# layers and mixtral cut to 2), offload (7: issue 17's figures, bench/offload.py, one JSON
# object a line in
# offload.jsonl: decode with --stream-misses auto, 0 and 4 (or OFFLOAD_STREAMS, comma-separated)
# beside the bounds, then a 4,096-token prefill with the loan; offload-olmoe (2: olmoe-1b-7b at a 4 GiB budget), offload-qwen3 and
# offload-qwen3-skewed (2.5 each: qwen3-30b-a3b, 16 layers, 22% of the experts cached, router
# skew 0 and 0.5, on the kv-grow checkpoints), offload-olmoe-torch (1.5: the olmoe run with
# STRATA_CPU_KERNEL=torch, the CPU kernel's baseline), offload-split (4: decode on both at
# --stream-misses 0 and 4, each with the calls split around the piecewise graphs, the default,
# and whole),
# quant-offload-olmoe (5: the olmoe run at --stream-misses QUANT_STREAMS, default 3, with the
# experts in each of QUANT_DTYPES, default auto,int8,int4, the same cache MiB, and the prefill of
# QUANT_PREFILL tokens, default 4096, 0 for none),
# quant-offload-qwen3 (6: the same on qwen3's 16 layers, QUANT_DTYPES default auto,int8;
# QUANT_ARGS=--share-per-format caches 22% of the experts in each format), offload-int8 (4:
# issue 17's decode condition alone, qwen3's 16 layers, int8 experts at 22%, --stream-misses
# auto, no prefill, uniform and then --router-skew 0.5, each on its checkpoint, the split's
# rates measured by the first and read back by the second), quant-decode (3:
# bench/decode.py with every expert resident, bf16 against int8 and int4 experts, each against
# the bandwidth bound at its bytes, an 8-layer olmoe cut), profile (4: bench/decode_profile.py,
# the kernels of prompt chunks of 32, 512 and 4,096 tokens and of a decode round, eager, graph
# and compiled, on a 4-layer olmoe cut), profile-shapes (6: the same for qwen3-30b-a3b cut to
# 4 layers and mixtral-8x7b cut to 2, prompt chunks of 32 and 4,096), profile-long (2: the
# decode round at cell 16,384, eager and graph: attention's share at a long context), decode16
# (7: bench/decode.py on the whole olmoe-1b-7b,
# the plain graphs, --compile and transformers, decode against the bound, the first request's
# seconds, then prefill at 512, 4,096 and 16,384 tokens against transformers with the MoE's
# share), decode16-default (4: the same without --compile, no compile time: the default path
# alone beside transformers, greedy and with `strata generate`'s default sampling),
# decode16-ahead (2: the default path alone, greedy, greedy with each round's token read
# before the next is launched, greedy with the pick on the other side of the graph
# (`--pick-in-graph`), greedy with the other argmax (`--argmax-kernel`), and with `strata
# generate`'s sampling), decode16-picks (1.5: the default greedy, the pick in the graph and the
# other argmax alone, under PICKS_TIMEOUT seconds, default 200), decode16-ab (2.5: the default
# greedy decode with the tree's sources, then with AB_BASE's copies of some, then the tree's
# again: an A/B of kernels that have no switch, decode16-ab-{1-a,2-b,3-a}.json),
# decode-shapes-sampling
# (3: the same on qwen3-30b-a3b cut to 4 layers and mixtral-8x7b cut to 2, one JSON object a
# line in decode-shapes-sampling.jsonl),
# profile-decode (1.5: the profile stage's decode rounds and prompt
# chunks of 32 and 4,096 without --compile), profile-decode16 (3.5: the decode round's A/Bs on
# the whole olmoe-1b-7b, under PROFILE_TIMEOUT seconds, default 250), graph-launch (0.3:
# bench/graph_launch.py, the host's time to launch a graph by torch's replay and by the driver's
# cuGraphLaunch, graphs of 8 and 30 kernels, one JSON object a line in graph-launch.jsonl),
# profile-decode-shapes (2.5: the same on qwen3-30b-a3b cut to 4 layers and
# mixtral-8x7b cut to 2), stream-issue (0.5: bench/stream_issue.py, the
# host's time issuing streamed misses, part by part, olmoe and qwen3 shapes, sync-checked),
# router-route (2: bench/router_route.py, the decode router kernel's launch shapes swept),
# decode-attention (2: bench/decode_attention.py, the decode attention kernel's launch shapes
# against the fused SDPA it replaced, each preset's heads at 256 to 16,384 cells),
# offload-prefetch (5: decode on both, without the next layer's
# predicted misses prefetched and with up to N of them, for each N of PREFETCH_CAPS,
# comma-separated, default 1,2,4, both at PREFETCH_STREAMS, comma-separated, default 4;
# offload-prefetch-olmoe, 3: olmoe's alone),
# offload-balance-olmoe and offload-balance-qwen3 (3 and 4: decode at --stream-misses auto, the
# kept rates' split, with 2 and 3 streamed through its staging buffer, the requests
# interleaved; the first run on a machine measures the rates), offload-loan (4: the 4,096-token
# prefill with the loan's uploads in 1 and in 4 pipelined batches, qwen3 then olmoe),
# l2-keep (1: bench/l2_keep.py, whether a weight read ahead stays in L2 across the
# experts' reads; then again with 30 MiB of L2 set aside for lines marked evict_last),
# decode-shapes (3: bench/decode_shapes.py, the experts' decode kernels' launch shapes
# timed inside the whole olmoe-1b-7b's decode round, side by side; SHAPES_KERNELS=down sweeps
# one kernel's, SHAPES_KERNELS=products the dense products' kernel's against cuBLAS,
# SHAPES_KERNELS=norm_product the norm inside q/k/v's product at its tiles against the two
# kernels, SHAPES_KERNELS=logits,router,attention the logits' kernel, the router's splits and
# the short attention's forms against the default, SHAPES_KERNELS=hints the L2 marks;
# SHAPES_ARGS more of its flags, e.g. --position 1024; SHAPES_TIMEOUT its seconds, default 300),
# decode-shapes-others (3: the same on qwen3-30b-a3b cut to 4 layers and mixtral-8x7b cut to
# 2), offload-profile (2: olmoe-1b-7b at 4 GiB, --stream-misses 4 with and without prefetch,
# each decode run profiled: the device's copy engine and compute busy a round, the host's top
# functions in $OUT/profile; offload-profile-qwen3, 3: the same on qwen3-30b-a3b's 16 layers
# at 22% of the experts; PROFILE_STREAMS sets their --stream-misses, default 4, and
# PROFILE_PREFETCH their prefetch flag, default --prefetch 4, empty for none; PROFILE_ARGS more
# of offload.py's flags, e.g. --experts-dtype int8 --share-per-format), sampling (1: bench/sampling.py, a decode round's sampling, the race's
# kernels against the sort they replaced, at olmoe's vocabulary and qwen3's), cpu-wake (1: bench/cpu_experts.py over 2 and 3 experts after an
# 800 us gap, with and without the kernel's threads started 300 us before the call, olmoe's and
# qwen3's shapes), offload-wake (4: olmoe-1b-7b at 4 GiB and qwen3-30b-a3b's 16 layers at 22%,
# --stream-misses 3,4, each with and without `wake_cpu`), offload-ahead (4: issue 17's decode
# round, qwen3-30b-a3b's 16 layers at 22% in int8, each split call's next graph launched ahead of
# the CPU's rows (`graph_call.LAUNCH_AHEAD`) against after them, interleaved in one process;
# run `CUDA_TESTS="tests/engine/cache/test_host_signal.py tests/engine/cache/test_token_path.py"
# ... tests` first; AHEAD_ARGS adds offload.py flags, e.g. "--cpu-team 13" to interleave a team
# size too), offload-rows (4: the same round with the CPU kernel reading CPU_ROWS weight rows at
# once, GxD: G of gate's and up's, D of down's, default 4x1,1x2,1x4, against the defaults,
# interleaved, `CpuExperts.gate_up_rows`, `down_rows`; ROWS_ARGS adds flags),
# offload-down-block (4: the same round with the CPU kernel's pass-2 tasks CPU_DOWN_BLOCKS rows
# of down each, default 16, against the default 64, interleaved, `CpuExperts.down_block_rows`;
# DOWN_BLOCK_ARGS adds flags; offload-down-block-olmoe, 3: the same on olmoe-1b-7b at 4 GiB),
# offload-tables (6: qwen3's 16 layers at 22% in int8, uniform then `--router-skew 0.5`
# (TABLES_SKEWS), auto's kept split against each of SPLIT_TABLES' tables (default
# 0,0,1,1,1,2,2,3,3, the rule's split by least squares on split-rule-upload-h100-2026-12-08.md's
# first machine, and 0,0,1,1,2,2,2,3,3, the best table of split-rule-h100-2026-12-07.md), the
# kept rates' split by each of SPLIT_RULES
# (default none, `rates.SPLIT_RULES`; the base run's staging buffer holds the largest count
# any of them streams, `--split-room`) and the splits of rates
# timed RATES_GAPS (default none) microseconds apart, interleaved, TABLES_REPEAT requests
# each, default 4; an empty variable runs none of its kind), offload-team (4:
# the same round with the CPU's own thread's team of CPU_TEAMS threads, default 15,11,
# against the default 12 (`default_team`) on 16 cores, interleaved: a team as large as the cores left
# waits for any thread the scheduler takes a core from; each run's threads' sleeps,
# preemptions and time waiting for a core are in its JSON, bench/thread_sched.py), cpu-schedule (1.5: bench/cpu_experts.py
# over 2, 3 and 4 experts after no gap and an 800 us gap, the kernel's tasks handed out
# (compute-main) against fixed, guided and stolen shares (compute-static, compute-guided,
# compute-steal), and on the worker thread as a round's decode call runs (start-dynamic against
# start-steal, whose waiter takes part, and start-steal-alone, whose waiter only waits), olmoe's
# and qwen3's shapes), offload-schedule (7: olmoe-1b-7b at 4 GiB at --stream-misses 2,3 and
# qwen3-30b-a3b's 16 layers at 22% at 3,4, each with the kernel's tasks handed out and in each
# of CPU_SCHEDULES' shares, default steal,static (steal-alone: steal, the engine's thread
# only waiting), their requests interleaved), offload-counts
# (4: both at --stream-misses 4 with 2 and 3 streamed through the same staging buffer, the
# requests interleaved, 5 repeats), offload-counts-async (5: the same, 4 repeats, each count
# also with the CPU's misses on the engine's thread, --sync-cpu), cpu-prefetch (2: bench/cpu_experts.py over 2
# and 4 experts after no gap and an 800 us gap, the kernel's weights also prefetched each of
# PREFETCH_BYTES ahead, default 0,8192,16384 (compute-main's is 4096): compute-pfN, the shapes
# of CPU_PRESETS, default olmoe-1b-7b and qwen3-30b-a3b, the store in MEMORY's pages, default
# pinned),
# offload-cpu-prefetch (4: olmoe at 4 GiB and qwen3's 16 layers at --stream-misses 3, each
# also with the weights prefetched each of ROUND_PREFETCH_BYTES ahead, default 0, against the
# default 4096, interleaved), offload-cpu-spin (4: the same runs, each also with the CPU's
# thread keeping its team spinning between calls, `CpuExperts.keep_team_up`, interleaved),
# offload-pin (3: issue 17's int8 round, qwen3 at 22%, then olmoe at 4 GiB, each also with
# the CPU's team pinned one CPU a thread, `CpuExperts.pin_team`, interleaved, PIN_ARGS added),
# offload-steps (3: the same two rounds, then one more request each with a layer call's host
# steps timed by the host's clock, `--host-steps`: `host_steps` in offload.jsonl, µs a layer
# call; STEPS_ARGS adds flags),
# cpu-sleeps (0.5: bench/cpu_sleeps.py, how often the CPU thread's OpenMP threads sleep a call
# beside the engine thread's team and with it shrunk, olmoe's and qwen3's shapes),
# offload-cpu-shrink (4: the same runs, each also with the engine thread's OpenMP pool left
# grown, not shrunk before the CPU's thread computes, `CpuExperts.shrink_caller_team` off,
# interleaved), offload-counts-shrink (4: 3 and 2 streamed, each with the pool shrunk and not,
# interleaved), prompt-experts (1: bench/prompt_experts.py, a prompt chunk's grouped experts
# step by step on one layer of each shape at PROMPT_TOKENS, default 4096,16384, and the
# activation as one kernel against torch's two; PROMPT_DTYPES, e.g. int8,int4-g32: each
# format's resident prompt call too, grouped a batch at a time against the loop),
# store-load (6: bench/store_load.py on the 16-layer qwen3 cut, the expert store in strata's
# host pages, 4 KiB and huge, against a pinned torch tensor a layer, bf16 twice each, int8
# once each: load seconds, host memory taken, the CPU kernel's and the uploads' GB/s),
# park (5: bench/park.py, two conversations of qwen3-30b-a3b's whole K/V taking turns, of
# 4,096 and 16,384 cells, in strata's host pages with spares (4 KiB and huge pages, locked,
# and 4 KiB unlocked), against
# torch's pinned tensors: park and restore seconds and GB/s, host memory held; each run a
# fresh process of about 25 s),
# offload-ab (4: the int8 loaned prompt on an AB_LAYERS-layer (default 8) qwen3 cut, a
# baseline tree (src/ with AB_PATCH, `git diff BASE -- src`, taken back) against this one,
# interleaved AB_ROUNDS times, default 2, both run by this tree's bench/offload.py;
# AB_ARGS adds offload.py flags, which win over the stage's own: `--stream-misses auto
# --new-tokens 48 --prefill-tokens 0` makes it the decode round's A/B), dequant
# (0.5: bench/dequant.py on qwen3-30b-a3b's experts, a prompt batch's dequantization by
# the Triton kernels against torch's float32 copies, int8 and int4-g32), routed-sort (0.2:
# bench/routed_sort.py, a prompt chunk's routing grouped by expert on the host, narrow sort keys
# against int64), cpu-int8 (1: bench/cpu_experts.py on qwen3's
# shape, 3 and 4 experts a call (CPU_INT8_EXPERTS) after a 500 us gap, bf16 against int8
# experts, pinned, each also on the worker thread under dynamic and steal: start-*, with where
# their time went: the runs' and passes' GB/s, team up, hand-over, notice; CPU_INT8_ARGS adds
# flags, e.g. "--weight-rows 4x1,1x2", CPU_INT8_TIMEOUT its seconds, default 150), dot-stream
# (3: bench/dot_stream.py, the kernel's int8 dot products over 2 GiB of rows from memory on
# DOT_THREADS threads, default 1,16: rows of 768 and 2,048 bytes, 1, 2 and 4 at once adjacent
# and apart, prefetched 0 and 4096 bytes ahead, each thread its own part or blocks handed out
# as they come; DOT_ARGS adds flags, e.g. "--schedules dynamic"), rates-probe (1.5: bench/rates_probe.py, every timed call of
# `--stream-misses auto`'s rates round by round, qwen3-30b-a3b's and olmoe-1b-7b's shapes;
# RATES_ARGS adds flags, e.g. "--experts-dtype int8": the rates of int8 experts),
# offload-async (5: olmoe at --stream-misses 2,4 and qwen3's 16 layers at 3,4, each with the
# CPU's misses on their own thread, `CachedExperts.async_cpu`, and on the engine's, -sync,
# interleaved), offload-sampled (4: the same runs
# greedy and with `strata generate`'s default sampling), offload-trace (3: qwen3's 16 layers
# at 22% in int8, `--stream-misses auto`, a decode request traced with each layer call's host
# steps marked, bench/round_trace.py: $OUT/trace/*.trace.json.gz and offload-trace.jsonl);
# `offload` runs the first three; the first
# `--stream-misses auto` on the machine measures its rates into ~/.cache/strata/rates.json, a
# few seconds, and later runs read them). A new checkpoint adds about a minute to the first
# stage that uses it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: stages pass it to scripts run from bench/
if [ -n "${PACK:-}" ]; then  # every output in one file, $OUT/gpu-out.tgz: the device tool
    PACKED=$OUT/gpu-out.tgz  # brings back at most 8 files a call. A second packed session in
    n=1                      # one call writes gpu-out-2.tgz, and so on: none overwrites another.
    while [ -e "$PACKED" ]; do n=$((n + 1)); PACKED=$OUT/gpu-out-$n.tgz; done
    OUT=$(mktemp -d)
    trap 'tar -C "$OUT" -czf "$PACKED" . && rm -rf "$OUT"' EXIT
fi
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
# The kv-grow stages share their checkpoints (18 GiB each) across stages and calls while the
# machine stays warm: written once under /tmp by `strata init-model`.
checkpoint() {  # checkpoint SKEW -> prints the directory, writing it when absent
    local dir=/tmp/strata-qwen3-16l-skew$1
    [ -f "$dir/config.json" ] || python3 -c "import sys; from strata.cli.main import main; \
        sys.exit(main())" init-model --preset qwen3-30b-a3b --layers 16 --router-skew "$1" \
        "$dir" > /dev/null 2>> "$OUT/init-model.log"
    echo "$dir"
}
olmoe_checkpoint() {  # prints the olmoe-1b-7b checkpoint's directory, writing it when absent
    local dir=/tmp/strata-olmoe-1b-7b
    [ -f "$dir/config.json" ] || python3 -c "import sys; from strata.cli.main import main; \
        sys.exit(main())" init-model --preset olmoe-1b-7b "$dir" > /dev/null \
        2>> "$OUT/init-model.log"
    echo "$dir"
}
offload() {  # offload MODEL PRESET ARGS...: a JSON line in offload.jsonl, its progress lines
    local model=$1 preset=$2
    shift 2
    (cd bench && timeout "${OFFLOAD_TIMEOUT:-280}" python3 offload.py --model "$model" \
        --preset "$preset" \
        --stream-misses auto,0,4 --new-tokens 48 --repeat 3 --json "$@") \
        >> "$OUT/offload.jsonl" 2> /tmp/strata-offload.err
    grep "bench/" /tmp/strata-offload.err; cat /tmp/strata-offload.err >> "$OUT/offload.err"
}
KV="--rounds 3 --chat-new 48 --long-tokens 1024 --long-new 8 --kv-floor 32 --kv-init 4096
    --profile-prompts 2 --json"
for stage in "$@"; do
    echo "gpu_session.sh: $stage at $(date +%T)"
    case $stage in
    tests) # tests/serve needs the serve stage's packages (carried wheels), not there by default.
           skip=$(python3 -c "import openai" 2> /dev/null || echo "--ignore=tests/serve")
           # A test past TESTS_DUMP_S seconds dumps every thread's stack into the log and goes
           # on: three whole runs on 2026-12-07 were cut with nothing printed, the third before
           # a 120 s dump could come (h100-figures-2026-12-07c.md, h200-figures-2026-12-07.md).
           timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m cuda ${CUDA_TESTS:-tests} -q \
               -p no:cacheprovider -o faulthandler_timeout="${TESTS_DUMP_S:-45}" $skip \
               ${TESTS_K:+-k "$TESTS_K"} \
               > "$OUT/cuda-tests.txt" 2>&1; tail -3 "$OUT/cuda-tests.txt" ;;
    kernels) (cd bench && timeout 300 python3 grouped_experts.py ${KERNELS_ARGS:-}) \
                 > "$OUT/kernels.txt" 2>&1
             cat "$OUT/kernels.txt" ;;
    routed-sort) (cd bench && timeout 60 python3 routed_sort.py \
                     --json-out "$OUT/routed-sort.json") 2>&1 | tee "$OUT/routed-sort.txt" ;;
    offload-trace) (cd bench && timeout 280 python3 offload.py --model "$(checkpoint 0)" \
               --preset qwen3-30b-a3b --stream-misses auto --new-tokens 48 --repeat 3 --json \
               --expert-share 0.22 --experts-dtype int8 --share-per-format --prefill-tokens 0 \
               --trace "$OUT/trace") > "$OUT/offload-trace.jsonl" 2> "$OUT/offload-trace.err"
           grep "bench/" "$OUT/offload-trace.err" | tail -6 ;;
    offload-ab) # The 4,096-token loaned prompt of qwen3-30b-a3b's 8-layer cut in int8 at 22% of
           # its experts, the baseline and this tree interleaved AB_ROUNDS times (default 2):
           # the baseline is src/ with AB_PATCH (`git diff BASE -- src`) taken back, run from
           # a copy through PYTHONPATH (the built modules shared: the patch must not touch them)
           base=/tmp/strata-ab-base; rm -rf "$base"; mkdir -p "$base"; cp -r src "$base/"
           patch -s -R -p1 -d "$base" < "${AB_PATCH:?a diff of src/ from the baseline}" || exit 1
           dir=/tmp/strata-qwen3-${AB_LAYERS:-8}l
           # 16 layers: the shared checkpoint the store-load and offload stages write anyway
           [ "${AB_LAYERS:-8}" = 16 ] && dir=$(checkpoint 0)
           [ -f "$dir/config.json" ] || python3 -c "import sys; from strata.cli.main import \
               main; sys.exit(main())" init-model --preset qwen3-30b-a3b --layers \
               "${AB_LAYERS:-8}" "$dir" > /dev/null 2>> "$OUT/init-model.log"
           for round in $(seq "${AB_ROUNDS:-2}"); do
             for side in base new; do
               path=$([ $side = base ] && echo "$base/src" || echo "")
               (cd bench && PYTHONPATH=$path timeout 200 python3 offload.py --model "$dir" \
                  --preset qwen3-30b-a3b --stream-misses 0 --new-tokens 2 --repeat 3 --json \
                  --expert-share 0.22 --experts-dtype int8 --share-per-format \
                  --prefill-tokens 4096 ${AB_ARGS:-}) 2>> "$OUT/offload-ab.err" \
                  | sed "s/^{/{\"side\": \"$side\", \"round\": $round, /" >> "$OUT/offload-ab.jsonl"
               echo "$side $round: $(grep -c . "$OUT/offload-ab.jsonl") lines"
             done
           done; grep "bench/" "$OUT/offload-ab.err" | tail -8 ;;
    store-load) model=$(checkpoint 0)  # each load a fresh process: a user's start
           (cd bench && timeout 280 python3 store_load.py --model "$model" --repeat 2 --json) \
               > "$OUT/store-load.jsonl" 2> "$OUT/store-load.err"
           (cd bench && timeout 280 python3 store_load.py --model "$model" --repeat 1 \
               --experts-dtype int8 --json) >> "$OUT/store-load.jsonl" 2>> "$OUT/store-load.err"
           tail -3 "$OUT/store-load.err"; cut -c1-300 "$OUT/store-load.jsonl" ;;
    park) for shape in "--cells 4096 --repeat 2" "--cells 16384 --repeat 1"; do  # ~25 s a run
             (cd bench && timeout 200 python3 park.py --preset qwen3-30b-a3b $shape --json) \
                 >> "$OUT/park.jsonl" 2>> "$OUT/park.err"
           done; tail -3 "$OUT/park.err"; cut -c1-300 "$OUT/park.jsonl" ;;
    dequant) (cd bench && timeout 120 python3 dequant.py --device cuda --formats int8,int4-g32 \
                 --repeat 20 --json-out "$OUT/dequant.json") 2>&1 | tee "$OUT/dequant.txt" ;;
    prompt-experts) (cd bench && timeout 200 python3 prompt_experts.py \
                        --tokens "${PROMPT_TOKENS:-4096,16384}" --json-out "$OUT/prompt-experts.json" \
                        --experts-dtype "${PROMPT_DTYPES:-}") \
                        > "$OUT/prompt-experts.txt" 2>&1
                    cat "$OUT/prompt-experts.txt" ;;
    host) (cd bench && timeout 120 python3 cache_host.py) > "$OUT/host.txt" 2>&1
          cat "$OUT/host.txt" ;;
    layer-call) # Real widths: the CPU's experts on every core, as the engine runs them.
                for run in "--widths tiny" "--widths real --threads 16 --calls 100 --repeat 3"; do
                  (cd bench && timeout 100 python3 layer_call.py --device cuda $run \
                     --paths token,general --stream 0,4 --json)
                done > "$OUT/layer-call.jsonl" 2> "$OUT/layer-call.err"
                wc -l < "$OUT/layer-call.jsonl"; tail -3 "$OUT/layer-call.err" ;;
    layer-call-passive) # The real widths again, OpenMP's idle threads sleeping instead of
                # spinning: whether the CPU kernel's 16 spinning threads slow the host's work
                # after it (its rest was 0.56 ms at real widths against 0.26 at tiny ones).
                (cd bench && OMP_WAIT_POLICY=PASSIVE timeout 100 python3 layer_call.py \
                   --device cuda --widths real --threads 16 --calls 100 --repeat 3 \
                   --paths token --stream 0,4 --json) > "$OUT/layer-call-passive.jsonl" \
                   2> "$OUT/layer-call-passive.err"
                wc -l < "$OUT/layer-call-passive.jsonl"; tail -3 "$OUT/layer-call-passive.err" ;;
    cache) (cd bench && timeout 420 python3 cache.py --preset olmoe-1b-7b --device cuda \
               --budget-mib 4096 --repeat 3 --peer-new-tokens 8 --stream-misses 4 --piecewise \
               --json) > "$OUT/cache.json" 2> "$OUT/cache.err"; grep "bench/" "$OUT/cache.err" ;;
    kv-grow) model=$(checkpoint 0)
             (cd bench && timeout 290 python3 kv_grow.py --model "$model" $KV) \
               > "$OUT/kv-grow.json" 2> "$OUT/kv-grow.err"; grep "bench/" "$OUT/kv-grow.err" ;;
    kv-grow-skewed) model=$(checkpoint 0.5)
               (cd bench && timeout 290 python3 kv_grow.py --model "$model" $KV) \
               > "$OUT/kv-grow-skewed.json" 2> "$OUT/kv-grow-skewed.err"
               grep "bench/" "$OUT/kv-grow-skewed.err" ;;
    kv-int8) model=$(checkpoint 0.5)  # int8 K/V cells against bf16's, both variants, one run
             (cd bench && timeout 560 python3 kv_grow.py --model "$model" $KV --rounds 2 \
               --kv-dtype bf16,int8) > "$OUT/kv-int8.json" 2> "$OUT/kv-int8.err"
             grep "bench/" "$OUT/kv-int8.err" ;;
    kv-int8-32k) model=$(checkpoint 0.5)  # the 32K prompt's prefill and decode after it
             (cd bench && timeout 560 python3 kv_grow.py --model "$model" --rounds 1 \
               --chat-new 32 --long-new 16 --kv-floor 32 --kv-init 4096 --variants kv-grow \
               --kv-dtype bf16,int8 --json) > "$OUT/kv-int8-32k.json" 2> "$OUT/kv-int8-32k.err"
             grep "bench/" "$OUT/kv-int8-32k.err" ;;
    kv-grow-32k|kv-grow-32k-skewed)
               [ "$stage" = kv-grow-32k ] && model=$(checkpoint 0) || model=$(checkpoint 0.5)
               (cd bench && timeout 540 python3 kv_grow.py --model "$model" --rounds 1 \
               --chat-new 32 --long-new 16 --kv-floor 32 --kv-init 4096 --json) \
               > "$OUT/$stage.json" 2> "$OUT/$stage.err"
               grep "bench/" "$OUT/$stage.err" ;;
    agents) model=$(checkpoint 0)
            (cd bench && timeout 540 python3 agents.py --model "$model" --kv-floor 32 \
               --kv-init 4096 --main2-tokens 32768 --json) \
               > "$OUT/agents.json" 2> "$OUT/agents.err"
            grep "bench/" "$OUT/agents.err" ;;
    cpu-experts) for preset in olmoe-1b-7b qwen3-30b-a3b; do
                   (cd bench && timeout 150 python3 cpu_experts.py --preset $preset \
                      --dtypes bf16 --tokens 1,2,4,16 --repeat 10)
                 done > "$OUT/cpu-experts.txt" 2>&1; cat "$OUT/cpu-experts.txt" ;;
    prefill) # One JSON object a line in prefill.jsonl (the machine returns at most 8 files):
             # each shape's prefill at 32 (its own prompt), 512, 4,096 and 16,384 tokens.
             # PREFILL_SHAPES (comma-separated) runs some of them.
             IFS=, read -ra shapes <<< "${PREFILL_SHAPES:-olmoe-1b-7b --layers 4,qwen3-30b-a3b \
--layers 4,mixtral-8x7b --layers 2}"
             for shape in "${shapes[@]}"; do
               (cd bench && timeout 240 python3 decode.py --preset $shape --prompt-tokens 32 \
                  --prefill-lengths 512,4096,16384 --new-tokens 32 --repeat 3 --json) \
                  >> "$OUT/prefill.jsonl" 2>> "$OUT/prefill.err"
             done
             wc -l "$OUT/prefill.jsonl"; grep -i "error" "$OUT/prefill.err" | tail -5 ;;
    serve) python3 -c "import fastapi, uvicorn, prometheus_client, openai, httpx" 2> /dev/null \
             || python3 -m pip install --no-index --find-links build/serve-wheels fastapi \
                uvicorn prometheus-client openai httpx > "$OUT/serve-pip.log" 2>&1 \
             || { echo "gpu_session.sh: serve: no packages (build/serve-wheels?)"; continue; }
           model=$(checkpoint 0)
           (cd bench && timeout 540 python3 serve.py --model "$model" --kv-floor 32 \
              --kv-init 4096 --main-tokens 8192 --side-tokens 2048 --main2-tokens 13824 --json) \
              > "$OUT/serve.json" 2> "$OUT/serve.err"; grep "bench/" "$OUT/serve.err" ;;
    offload-olmoe-torch)  # the same with torch's matmuls for the CPU's experts: the A/B
           STRATA_CPU_KERNEL=torch offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 \
               --stream-misses auto,0 ;;
    stream-issue) for preset in olmoe-1b-7b qwen3-30b-a3b; do
                    (cd bench && timeout 100 python3 stream_issue.py --preset $preset \
                       --sync-check)
                  done > "$OUT/stream-issue.json" 2>&1; grep "bench/" "$OUT/stream-issue.json" ;;
    decode-attention) (cd bench && timeout 300 python3 decode_attention.py) \
                      > "$OUT/decode-attention.json" 2> "$OUT/decode-attention.err"
                  grep "bench/" "$OUT/decode-attention.json"; tail -3 "$OUT/decode-attention.err" ;;
    cpu-int8) (cd bench && timeout "${CPU_INT8_TIMEOUT:-150}" python3 cpu_experts.py \
                  --preset qwen3-30b-a3b --dtypes bf16 --tokens 1 \
                  --experts "${CPU_INT8_EXPERTS:-3,4}" --gap-us 500 --repeat 15 \
                  --memory pinned ${CPU_INT8_ARGS:-}) > "$OUT/cpu-int8.txt" 2>&1
              grep "| pinned\|bandwidth\|^start-" "$OUT/cpu-int8.txt" | cut -c1-400 ;;
    dot-stream) (cd bench && timeout 300 python3 dot_stream.py --formats int8 \
                    --threads "${DOT_THREADS:-1,16}" --weight-mib 2048 ${DOT_ARGS:-}) \
                    > "$OUT/dot-stream.txt" 2>&1; cat "$OUT/dot-stream.txt" ;;
    rates-probe) (cd bench && timeout 200 python3 rates_probe.py ${RATES_ARGS:-} \
                     --json-out "$OUT/rates-probe.jsonl") 2>&1 | tee "$OUT/rates-probe.txt" ;;
    cpu-wake) for preset in olmoe-1b-7b qwen3-30b-a3b; do
                (cd bench && timeout 100 python3 cpu_experts.py --preset $preset --dtypes bf16 \
                   --tokens 1 --experts 2,3 --gap-us 800 --wake-us 300 --repeat 15 \
                   --memory pinned)
              done > "$OUT/cpu-wake.txt" 2>&1; grep "| pinned" "$OUT/cpu-wake.txt" | cut -c1-120 ;;
    cpu-schedule) for preset in olmoe-1b-7b qwen3-30b-a3b; do  # tasks handed out or fixed
                (cd bench && timeout 120 python3 cpu_experts.py --preset $preset --dtypes bf16 \
                   --tokens 1 --experts 2,3,4 --gap-us 0,800 --repeat 15 --memory pinned)
              done > "$OUT/cpu-schedule.txt" 2>&1; grep "| pinned" "$OUT/cpu-schedule.txt" \
              | cut -c1-400 ;;
    cpu-prefetch) for preset in ${CPU_PRESETS:-olmoe-1b-7b qwen3-30b-a3b}; do  # prefetched
                (cd bench && timeout 150 python3 cpu_experts.py --preset $preset --dtypes bf16 \
                   --tokens 1 --experts 2,4 --gap-us 0,800 --repeat 15 \
                   --memory "${MEMORY:-pinned}" --prefetch-bytes "${PREFETCH_BYTES:-0,8192,16384}")
              done > "$OUT/cpu-prefetch.txt" 2>&1
              grep -E "^\| (pinned|pages|huge|pageable) " "$OUT/cpu-prefetch.txt" | cut -c1-100 ;;
    offload-cpu-prefetch)  # the same in the round, interleaved with the hardware's alone
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 3 \
               --cpu-prefetch "${ROUND_PREFETCH_BYTES:-0}" --interleave --repeat 4 \
               --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 3 \
               --cpu-prefetch "${ROUND_PREFETCH_BYTES:-0}" --interleave --repeat 4 \
               --prefill-tokens 0 ;;
    offload-schedule)  # the CPU kernel's tasks handed out against fixed shares, in the round
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 2,3 \
               --cpu-schedule "${CPU_SCHEDULES:-steal,static}" --interleave --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 3,4 \
               --cpu-schedule "${CPU_SCHEDULES:-steal,static}" --interleave --prefill-tokens 0 ;;
    offload-pin)  # the CPU's team pinned one CPU a thread, or not: A/B in one process
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --experts-dtype int8 \
               --share-per-format --stream-misses auto --cpu-pin --interleave \
               --prefill-tokens 0 ${PIN_ARGS:-}
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses auto \
               --cpu-pin --interleave --prefill-tokens 0 ${PIN_ARGS:-} ;;
    offload-steps)  # a layer call's host steps by the host's clock, after the timed requests
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --experts-dtype int8 \
               --share-per-format --stream-misses auto --prefill-tokens 0 --host-steps \
               ${STEPS_ARGS:-}
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses auto \
               --prefill-tokens 0 --host-steps ${STEPS_ARGS:-} ;;
    offload-cpu-spin)  # the CPU's team spinning between a round's calls, or not
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 3 \
               --cpu-spin --interleave --repeat 4 --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 3 \
               --cpu-spin --interleave --repeat 4 --prefill-tokens 0 ;;
    cpu-sleeps) for preset in olmoe-1b-7b qwen3-30b-a3b; do  # the worker's threads' sleeps a call
                  (cd bench && timeout 120 python3 cpu_sleeps.py --preset $preset)
                done > "$OUT/cpu-sleeps.txt" 2>&1; cat "$OUT/cpu-sleeps.txt" ;;
    offload-cpu-shrink)  # the engine thread's pool shrunk before the CPU's calls (the default) or not
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 3 \
               --no-cpu-shrink --interleave --repeat 4 --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 3 \
               --no-cpu-shrink --interleave --repeat 4 --prefill-tokens 0 ;;
    offload-counts-shrink)  # 3 and 2 streamed, each with the engine thread's pool shrunk or not
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 3 \
               --no-cpu-shrink --interleave --split-counts 2 --repeat 5 --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 3 \
               --no-cpu-shrink --interleave --split-counts 2 --repeat 5 --prefill-tokens 0 ;;
    offload-async)  # the CPU's misses on their own thread against the engine's, interleaved
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 2,4 \
               --sync-cpu --interleave --repeat 5 --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 3,4 \
               --sync-cpu --interleave --repeat 5 --prefill-tokens 0 ;;
    offload-counts)  # how many misses to stream: 4 (the default), 3 and 2 interleaved
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 4 \
               --interleave --split-counts 2,3 --repeat 5 --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 4 \
               --interleave --split-counts 2,3 --repeat 5 --prefill-tokens 0 ;;
    offload-counts-async)  # the counts, each with the CPU's own thread and without
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 4 \
               --interleave --split-counts 2,3 --sync-cpu --repeat 4 --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 4 \
               --interleave --split-counts 2,3 --sync-cpu --repeat 4 --prefill-tokens 0 ;;
    offload-sampled)  # the CLI's default sampling against greedy in the host-bound round
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 3,4 \
               --cli-sampling --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 3,4 \
               --cli-sampling --prefill-tokens 0 ;;
    offload-wake)  # the CPU's threads started before each routing read: A/B in one process
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 3,4 \
               --wake-cpu --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 3,4 \
               --wake-cpu --prefill-tokens 0 ;;
    offload-ahead)  # the next graph launched ahead of the CPU's rows: A/B in one process
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --experts-dtype int8 \
               --share-per-format --stream-misses auto --launch-ahead --interleave \
               --prefill-tokens 0 ${AHEAD_ARGS:-} ;;
    offload-rows)  # the CPU kernel's weight rows at once against the defaults: A/B in one process
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --experts-dtype int8 \
               --share-per-format --stream-misses auto --cpu-weight-rows "${CPU_ROWS:-4x1,1x2,1x4}" \
               --interleave --prefill-tokens 0 ${ROWS_ARGS:-} ;;
    offload-down-block)  # the CPU kernel's pass-2 tasks of more rows: A/B in one process
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --experts-dtype int8 \
               --share-per-format --stream-misses auto \
               --cpu-down-block-rows "${CPU_DOWN_BLOCKS:-16}" --interleave \
               --prefill-tokens 0 ${DOWN_BLOCK_ARGS:-} ;;
    offload-down-block-olmoe)  # the same on olmoe-1b-7b at 4 GiB (bf16 experts, 2 KiB rows of down)
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses auto \
               --cpu-down-block-rows "${CPU_DOWN_BLOCKS:-16}" --interleave \
               --prefill-tokens 0 ${DOWN_BLOCK_ARGS:-} ;;
    offload-tables)  # split tables, rules and the splits of rates timed at other gaps,
           # against auto's kept split: A/B in one process, uniform then skewed routing
           for skew in ${TABLES_SKEWS:-0 0.5}; do
               offload "$(checkpoint "$skew")" qwen3-30b-a3b --expert-share 0.22 \
                   --experts-dtype int8 --share-per-format --stream-misses auto --interleave \
                   --prefill-tokens 0 --repeat "${TABLES_REPEAT:-4}" \
                   --split-tables "${SPLIT_TABLES-0,0,1,1,1,2,2,3,3/0,0,1,1,2,2,2,3,3}" \
                   --rates-gaps "${RATES_GAPS-}" --split-rules "${SPLIT_RULES-}" --split-room
           done ;;
    offload-team)  # the CPU's team smaller than the cores left: A/B in one process
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --experts-dtype int8 \
               --share-per-format --stream-misses auto --cpu-team "${CPU_TEAMS:-15,11}" \
               --interleave --prefill-tokens 0 ;;
    sampling) for vocab in 50304 151936; do
                  (cd bench && timeout 120 python3 sampling.py --vocab $vocab)
              done > "$OUT/sampling.txt" 2>&1; grep -v "^{" "$OUT/sampling.txt" ;;
    router-route) (cd bench && timeout 240 python3 router_route.py) > "$OUT/router-route.json" \
                      2> "$OUT/router-route.err"; grep "bench/" "$OUT/router-route.json" ;;
    offload-prefetch|offload-prefetch-olmoe)  # the next layer's predicted misses ahead: A/B
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 \
               --stream-misses "${PREFETCH_STREAMS:-4}" --prefetch "${PREFETCH_CAPS:-1,2,4}" \
               --prefill-tokens 0
           [ "$stage" = offload-prefetch-olmoe ] || offload "$(checkpoint 0)" qwen3-30b-a3b \
               --expert-share 0.22 --stream-misses "${PREFETCH_STREAMS:-4}" --prefetch "${PREFETCH_CAPS:-1,2,4}" \
               --prefill-tokens 0 ;;
    offload-loan)  # the loan's uploads in 4 pipelined batches against 1: the prefill's A/B
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 4 \
               --new-tokens 2 --loan-upload-batches 1,4
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 4 \
               --new-tokens 2 --loan-upload-batches 1,4 ;;
    offload-balance-olmoe)  # how many misses to stream: the kept rates' auto against fixed
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses auto \
               --interleave --split-counts 2,3 --repeat 4 --prefill-tokens 0 ;;
    offload-balance-qwen3)
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses auto \
               --interleave --split-counts 2,3 --repeat 4 --prefill-tokens 0 ;;
    offload-profile|offload-profile-qwen3)  # where a round goes: the device's engines, the host
           [ "$stage" = offload-profile-qwen3 ] || offload "$(olmoe_checkpoint)" olmoe-1b-7b \
               --budget-mib 4096 --stream-misses "${PROFILE_STREAMS:-4}" \
               ${PROFILE_PREFETCH---prefetch 4} --prefill-tokens 0 \
               --new-tokens 32 --repeat 2 --profile "$OUT/profile" ${PROFILE_ARGS:-}
           [ "$stage" = offload-profile ] || offload "$(checkpoint 0)" qwen3-30b-a3b \
               --expert-share 0.22 --stream-misses "${PROFILE_STREAMS:-4}" \
               ${PROFILE_PREFETCH---prefetch 4} --prefill-tokens 0 \
               --new-tokens 32 --repeat 2 --profile "$OUT/profile" ${PROFILE_ARGS:-} ;;
    offload-split)  # the decode calls split around the graphs (`graph_call`) and whole: A/B
           offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 --stream-misses 0,4 \
               --whole-calls --prefill-tokens 0
           offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 --stream-misses 0,4 \
               --whole-calls --prefill-tokens 0 ;;
    offload|offload-olmoe|offload-qwen3|offload-qwen3-skewed)
           streams=${OFFLOAD_STREAMS:+--stream-misses $OFFLOAD_STREAMS}  # else auto,0,4
           if [ "$stage" = offload ] || [ "$stage" = offload-olmoe ]; then
               offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 $streams
           fi
           if [ "$stage" = offload ] || [ "$stage" = offload-qwen3 ]; then
               offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 $streams
           fi
           if [ "$stage" = offload ] || [ "$stage" = offload-qwen3-skewed ]; then
               offload "$(checkpoint 0.5)" qwen3-30b-a3b --expert-share 0.22 $streams
           fi ;;
    offload-int8)  # issue 17's decode condition, uniform then skewed
           for skew in 0 0.5; do
               offload "$(checkpoint $skew)" qwen3-30b-a3b --expert-share 0.22 \
                   --experts-dtype int8 --share-per-format --stream-misses auto --prefill-tokens 0
           done ;;
    quant-offload-olmoe)
           OFFLOAD_TIMEOUT=400 offload "$(olmoe_checkpoint)" olmoe-1b-7b --budget-mib 4096 \
               --stream-misses "${QUANT_STREAMS:-3}" --experts-dtype "${QUANT_DTYPES:-auto,int8,int4}" \
               --prefill-tokens "${QUANT_PREFILL:-4096}" ;;
    quant-offload-qwen3)
           OFFLOAD_TIMEOUT=480 offload "$(checkpoint 0)" qwen3-30b-a3b --expert-share 0.22 \
               --stream-misses "${QUANT_STREAMS:-3}" --experts-dtype "${QUANT_DTYPES:-auto,int8}" \
               --prefill-tokens "${QUANT_PREFILL:-4096}" ${QUANT_ARGS:-} ;;
    quant-decode) (cd bench && timeout 300 python3 decode.py --preset olmoe-1b-7b --layers 8 \
                     --new-tokens 64 --repeat 3 --no-transformers --experts-dtype int8,int4 \
                     --json) > "$OUT/quant-decode.json" 2> "$OUT/quant-decode.err"
                  tail -2 "$OUT/quant-decode.err" ;;
    profile-shapes) for shape in "qwen3-30b-a3b --layers 4" "mixtral-8x7b --layers 2"; do
                      (cd bench && timeout 240 python3 decode_profile.py --preset $shape \
                         --prompt-tokens 32,4096 --json "$OUT/profile-${shape%% *}.json") \
                         >> "$OUT/profile-shapes.txt" 2>> "$OUT/profile-shapes.err"
                    done; grep -E "^(prompt|decode)|^ +[0-9.]+ ms +[0-9]+\.[0-9]+x \(" "$OUT/profile-shapes.txt" ;;
    decode16) (cd bench && timeout 540 python3 decode.py --model "$(olmoe_checkpoint)" \
                 --compile --new-tokens 64 --repeat 3 --prefill-lengths 512,4096,16384 \
                 --json) > "$OUT/decode16.json" \
                 2> "$OUT/decode16.err"; tail -2 "$OUT/decode16.err" ;;
    decode16-ahead) # the default path greedy, with the rounds read one at a time, with the greedy
                    # pick on the other side of the graph, by the other argmax, and sampled
              (cd bench && timeout 270 python3 decode.py --model "$(olmoe_checkpoint)" \
                 --new-tokens 64 --repeat 5 --plain-loop --pick-in-graph --argmax-kernel \
                 --cli-sampling --no-transformers --json) > "$OUT/decode16-ahead.json" 2> "$OUT/decode16-ahead.err"
              tail -2 "$OUT/decode16-ahead.err" ;;
    decode16-picks) # decode16-ahead's greedy A/Bs alone: the pick in the graph, the other argmax
              (cd bench && timeout "${PICKS_TIMEOUT:-200}" python3 decode.py \
                 --model "$(olmoe_checkpoint)" --new-tokens 64 --repeat 5 --pick-in-graph \
                 --argmax-kernel --no-transformers --json) > "$OUT/decode16-picks.json" \
                 2> "$OUT/decode16-picks.err"
              tail -2 "$OUT/decode16-picks.err" ;;
    decode16-ab) # the tree's default greedy decode (a) against AB_BASE's copies of some of its
                 # source files (b: a folder holding them at their paths in the tree), a, b, a
              if [ ! -d "${AB_BASE:-}" ]; then echo "decode16-ab: AB_BASE names no folder"
              else
                  model=$(olmoe_checkpoint); kept=$(mktemp -d)
                  files=$(cd "$AB_BASE" && find . -type f -name "*.py")
                  for f in $files; do mkdir -p "$kept/$(dirname "$f")"; cp "$f" "$kept/$f"; done
                  for run in 1-a 2-b 3-a; do
                      from=$kept; [ "$run" = 2-b ] && from=$AB_BASE
                      for f in $files; do cp "$from/$f" "$f"; done
                      (cd bench && timeout 150 python3 decode.py --model "$model" \
                          --new-tokens 64 --repeat 5 --no-transformers --json) \
                          > "$OUT/decode16-ab-$run.json" 2> "$OUT/decode16-ab-$run.err"
                      tail -1 "$OUT/decode16-ab-$run.err"
                  done
                  for f in $files; do cp "$kept/$f" "$f"; done
              fi ;;
    decode-shapes-sampling) # the default path, greedy and with the CLI's sampling, on the cuts
              for shape in "qwen3-30b-a3b --layers 4" "mixtral-8x7b --layers 2"; do
                (cd bench && timeout 150 python3 decode.py --preset $shape --new-tokens 64 \
                   --repeat 5 --plain-loop --cli-sampling --no-transformers --json) \
                   >> "$OUT/decode-shapes-sampling.jsonl" 2>> "$OUT/decode-shapes-sampling.err"
              done; tail -4 "$OUT/decode-shapes-sampling.err" ;;
    decode16-default) (cd bench && timeout 300 python3 decode.py --model "$(olmoe_checkpoint)" \
                 --new-tokens 64 --repeat 3 --prefill-lengths 512,4096,16384 --cli-sampling \
                 --json) > "$OUT/decode16-default.json" \
                 2> "$OUT/decode16-default.err"; tail -2 "$OUT/decode16-default.err" ;;
    profile-decode) (cd bench && timeout 150 python3 decode_profile.py --preset olmoe-1b-7b \
                 --layers 4 --prompt-tokens 32,4096 --no-compile \
                 --json "$OUT/profile-decode.json") > "$OUT/profile-decode.txt" \
                 2> "$OUT/profile-decode.err"
                    grep -E "^(prompt|decode)|^ +[0-9.]+ ms +[0-9]+\.[0-9]+x \(" "$OUT/profile-decode.txt" ;;
    profile-decode16) # the decode round's A/Bs on the whole olmoe-1b-7b (16 layers)
              (cd bench && timeout "${PROFILE_TIMEOUT:-250}" python3 decode_profile.py \
                 --model "$(olmoe_checkpoint)" --prompt-tokens 32 --no-compile --json "$OUT/profile-decode16.json") \
                 > "$OUT/profile-decode16.txt" 2> "$OUT/profile-decode16.err"
                    grep -E "^(prompt|decode)|^ +[0-9.]+ ms +[0-9]+\.[0-9]+x \(" "$OUT/profile-decode16.txt" ;;
    graph-launch) for kernels in 8 30; do  # the launch call alone, by the host's clock
                      (cd bench && timeout 60 python3 graph_launch.py --kernels $kernels --json) \
                          >> "$OUT/graph-launch.jsonl" 2>> "$OUT/graph-launch.err"
                  done; cat "$OUT/graph-launch.jsonl" ;;
    profile-decode-shapes) # the decode round's A/Bs on qwen3-30b-a3b (4 layers), mixtral (2)
              for shape in "qwen3-30b-a3b 4" "mixtral-8x7b 2"; do
                  set -- $shape
                  (cd bench && timeout 150 python3 decode_profile.py --preset "$1" --layers "$2" \
                     --prompt-tokens 32 --no-compile --json "$OUT/profile-decode-$1.json") \
                     > "$OUT/profile-decode-$1.txt" 2> "$OUT/profile-decode-$1.err"
                  grep -E "^decode|^ +[0-9.]+ ms +[0-9]+\.[0-9]+x \(" "$OUT/profile-decode-$1.txt"
              done ;;
    l2-keep) (cd bench && timeout 120 python3 l2_keep.py --json "$OUT/l2-keep.json" \
                 && timeout 120 python3 l2_keep.py --persisting-mib 30 \
                 --json "$OUT/l2-keep-persisting.json") > "$OUT/l2-keep.txt" 2>&1
             cat "$OUT/l2-keep.txt" ;;
    decode-shapes) (cd bench && timeout "${SHAPES_TIMEOUT:-300}" python3 decode_shapes.py --model \
                 "$(olmoe_checkpoint)" --kernels "${SHAPES_KERNELS:-gate_up,down}" \
                 ${SHAPES_ARGS:-} --json "$OUT/decode-shapes.json") \
                 > "$OUT/decode-shapes.txt" 2> "$OUT/decode-shapes.err"
                 head -8 "$OUT/decode-shapes.txt"; tail -3 "$OUT/decode-shapes.err" ;;
    decode-shapes-others)
              for shape in "qwen3-30b-a3b 4" "mixtral-8x7b 2"; do
                  set -- $shape
                  (cd bench && timeout 150 python3 decode_shapes.py --preset "$1" --layers "$2" \
                     --kernels "${SHAPES_KERNELS:-gate_up,down}" \
                     --json "$OUT/decode-shapes-$1.json") > "$OUT/decode-shapes-$1.txt" \
                     2> "$OUT/decode-shapes-$1.err"
                  head -5 "$OUT/decode-shapes-$1.txt"; tail -3 "$OUT/decode-shapes-$1.err"
              done ;;
    profile-long) # a decode round at cell 16,384: what attention costs at a long context
              (cd bench && timeout 240 python3 decode_profile.py --preset olmoe-1b-7b --layers 4 \
                 --prompt-tokens 32 --position 16384 --no-compile \
                 --json "$OUT/profile-long.json") > "$OUT/profile-long.txt" \
                 2> "$OUT/profile-long.err"; grep -E "^(prompt|decode)|^ +[0-9.]+ ms +[0-9]+\.[0-9]+x \(" "$OUT/profile-long.txt" ;;
    profile) (cd bench && timeout 420 python3 decode_profile.py --preset olmoe-1b-7b --layers 4 \
                --prompt-tokens 32,512,4096 --gathered-compile --json "$OUT/profile.json") \
                > "$OUT/profile.txt" 2> "$OUT/profile.err"; tail -3 "$OUT/profile.err" ;;
    *) echo "gpu_session.sh: unknown stage $stage" >&2; exit 2 ;;
    esac
done
# The rates `--stream-misses auto` kept on this machine (its tables a k at a time), if any.
cp "${STRATA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}/rates.json" "$OUT/" 2> /dev/null \
    || true
