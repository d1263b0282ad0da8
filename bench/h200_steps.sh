#!/usr/bin/env bash
# The H200 checks and benchmarks the open issues wait for, as named steps, each capped with
# `timeout` and logged into $OUT (a cut step still returns what it wrote). Run from a clean
# snapshot (bench/README.md, "One H200 session, in few calls"), e.g. through the device tool:
#
#   cd .snap && bash bench/h200_steps.sh setup mma-glu-tests serve-35b
#
# `setup` unpacks the MLX CUDA bundle (../.device/mlx-cuda-sm90.tar.xz, ../shared/device/README.md)
# into /tmp/site once per warm machine and installs this tree there; every step runs with
# PYTHONPATH=/tmp/site.
# Steps run in the order given; `bash bench/h200_steps.sh list` prints them with their caps.
# Budget in held time: a cold start adds ~90 s to the first call.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/ptx}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} HF2Q_MLX_CACHE=${HF2Q_MLX_CACHE:-/tmp/hfc}
BUNDLE=${BUNDLE:-../.device/mlx-cuda-sm90.tar.xz}

declare -A CAP CMD
step() { CAP[$1]=$2; CMD[$1]=$3; ORDER+=("$1"); }
# Nsight Compute where it is installed, as the start of a step's command (the profiled command
# and ncu's options follow); a machine without it fails the step
NCU_RUN='NCU=$(ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute*/ncu 2>/dev/null | head -1); echo ncu: $NCU; [ -n "$NCU" ] || exit 1; "$NCU"'
ORDER=()
step setup 120 "mkdir -p /tmp/site && { [ -d /tmp/site/mlx ] || tar -xJf $BUNDLE -C /tmp/site; } && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . && python3 -c 'import mlx.core as mx, hf2q_mlx; print(mx.__version__, mx.default_device())'"
# does a custom kernel read a sliced input at its offset? (MLX CUDA probe)
step offset-probe 60 "python3 bench/offset_probe.py"
# kernels waiting for their GPU tests (docs/kernel_notes.md)
step expert-mma-tests 240 "python3 -m pytest -q -x -p no:cacheprovider -k gpu tests/kernels/test_expert_mma.py"
step mma-glu-tests 200 "python3 -m pytest -q -x -p no:cacheprovider -k 'gpu and (Q5_1 or Q5_K or Q3_K or Q2_K)' tests/kernels/test_dense_glu_mma.py"
step step-parity 240 "python3 -m pytest -q -x -p no:cacheprovider tests/test_step_row_parity.py"
# speed: MoE block with the grouped experts off and on (issue 14)
step moe-grouped 240 "HF2Q_GROUPED_EXPERTS=0 python3 bench/moe_launches.py --formats q4_k --batch 1 8 32 && HF2Q_GROUPED_EXPERTS=1 python3 bench/moe_launches.py --formats q4_k --batch 1 8 32"
# launch configurations of the routed-expert kernels (issues 14, 15), and their GPU parity
step expert-gpu-tests 300 "python3 -m pytest -q -x -p no:cacheprovider -k gpu tests/kernels/test_expert_mma.py tests/kernels/test_expert_glu.py tests/kernels/test_expert_down.py"
step wide-sweep 300 "python3 bench/expert_sweep.py --kernels grouped_glu grouped_down wide_glu wide_down --batch 32 512 --budget 240 --json $OUT/expert_sweep_wide.json"
step expert-sweep 300 "python3 bench/expert_sweep.py --budget 240 --json $OUT/expert_sweep.json"
# whole-model decode against mlx-lm, B = 1 (issue 15); the router split's parity and A/B
step router-tests 100 "python3 -m pytest -q -x -p no:cacheprovider -k gpu tests/kernels/test_moe_router.py"
step router-split-tests 150 "python3 -m pytest -q -x -p no:cacheprovider -k gpu_split tests/kernels/test_moe_router.py"
step decode-26b-split 420 "python3 bench/decode_step.py $OUT/decode_26b_split.json --shapes gemma4:26b-a4b --rounds 5 --tokens 32 --variants split --router-split-ab"
step attention-sweep 150 "python3 bench/attention_sweep.py --json $OUT/attention_sweep.json"
# prefill against mlx-lm, with the delta-net and routed-experts prefill switches (issues 14, 15)
step prefill 300 "python3 bench/prefill.py $OUT/prefill.json --shapes ${PREFILL_SHAPES:-gemma4:26b-a4b,qwen3_5:35b-a3b,qwen3_5:9b} --rounds 3 ${PREFILL_ENV:---env HF2Q_GDN_PREFILL=chunked}"
# the experts' slot-parallel down kernel (off by default): parity, kernel sweep, whole step
step down-slots-tests ${SLOT_TEST_CAP:-200} "python3 -m pytest -q -x -p no:cacheprovider -k gpu_slot tests/kernels/test_expert_down.py"
step down-slots-sweep 300 "python3 bench/expert_sweep.py --kernels down down_slots --budget 240 --json $OUT/expert_sweep_down_slots.json"
step decode-26b-slots ${SLOTS_CAP:-420} "python3 bench/decode_step.py $OUT/decode_26b_slots.json --shapes gemma4:26b-a4b --rounds 5 --tokens 32 --variants slots --down-slots-ab"
# where a B = 1 step's kernel time goes (CUPTI), today's defaults and the candidate mappings
step profile-26b 240 "python3 bench/decode_profile.py gemma4:26b-a4b q4_k --step compiled --steps 16 --json $OUT/profile_26b.json"
step profile-26b-var 240 "HF2Q_DOWN_SLOTS=8 HF2Q_ATTN_SPLIT=${ATTN_SPLIT:-4,8} HF2Q_ROUTER_SPLIT=1 python3 bench/decode_profile.py gemma4:26b-a4b q4_k --step compiled --steps 16 --json $OUT/profile_26b_var.json"
# the same for Qwen3.5-35B-A3B at B rows of the compiled step (issue 14: its 8-stream step is
# ~8.5 ms against 3.6 ms for one; BATCH=1 beside it)
step profile-35b 240 "python3 bench/decode_profile.py qwen3_5:35b-a3b ${FORMAT:-q4_k} --step compiled --batch ${BATCH:-8} --steps 16 --by-launch --json $OUT/profile_35b_b${BATCH:-8}.json"
# kernel switches at B = 8 distinct rows of the compiled step, one process (decode_step --patch)
step b8-ab 300 "python3 bench/decode_step.py $OUT/b8_ab.json --shapes ${SHAPES:-qwen3_5:35b-a3b} --formats q4_k --no-mlx-lm --variants B=8 --batch 8 --rounds 5 --tokens 32 ${B8_PATCHES:---patch expert_down.SLOT_ROWS=8 --patch expert_mma.MIN_TOKENS=8 --patch expert_mma.MIN_TOKENS_GLU=9}"
step decode-26b 300 "python3 bench/decode_step.py $OUT/decode_26b.json --shapes gemma4:26b-a4b --rounds 5 --tokens 32 --variants 'compiled B=1'"
# issue 15's table (ours Q4_K / MLX 4-bit against mlx-lm: decode, prefill, kernels, busy), one
# shape per call: SHAPES one of gemma4:26b-a4b, gemma4:31b, qwen3_5:35b-a3b, qwen3_5:9b
# (LLAMA=1: with llama.cpp on the same GGUF, the bundle copied into ../.device as for llama-peer)
# (GRAPH: formats also run as the CUDA graph step; unset: auto, every format where the graph is
# the default decode, i.e. on CUDA; GRAPH=none leaves the graph rows out)
PEER_UNPACK="mkdir -p /tmp/peer && { [ -x /tmp/peer/cuda/run.sh ] || tar -xJf ../.device/llama-cuda-sm90.tar.xz -C /tmp/peer; } &&"
PEER_ARGS="--llama /tmp/peer/cuda/run.sh --llama-args '-ngl 99' --gguf-dir /tmp"
step speed-table 540 "${LLAMA:+$PEER_UNPACK} python3 bench/speed_table.py $OUT/speed_table.json --shapes ${SHAPES:-gemma4:26b-a4b} --formats ${FORMATS:-q4_k,mlx4} ${SKIP:+--skip '$SKIP'} --rounds 5 --tokens 32 ${GRAPH:+--graph $GRAPH} ${LLAMA:+$PEER_ARGS}"
# serving targets (issue 14): one shape per call
step serve-26b 480 "python3 bench/serve_throughput.py --shapes gemma4-26b-a4b --formats q4_k --streams ${STREAMS:-1,2,4,8,16,32} --gen 128 --prefill-chunk 4096 --time-cap 420 --json $OUT/serve_26b.json"
# the engine through the graph (the CUDA default) and through the compiled step, one after the
# other in one call: where the graph's 32-stream ITL p99 (598 ms, session 21) comes from
step serve-26b-ab 540 "for m in graph compiled; do echo HF2Q_DECODE=\$m; HF2Q_DECODE=\$m python3 bench/serve_throughput.py --shapes gemma4-26b-a4b --formats q4_k --streams ${STREAMS:-1,32} --gen 128 --prefill-chunk 4096 --time-cap 240 --json $OUT/serve_26b_\$m.json | grep -a 'DecodeStep'; done"
step serve-35b 480 "python3 bench/serve_throughput.py --shapes qwen3.5-35b-a3b --formats q4_k --streams ${STREAMS:-1,2,4,8,16,32} --gen 128 --prefill-chunk 2048 --time-cap 420 --json $OUT/serve_35b.json"
step serve-26b-mlx 540 "python3 bench/serve_throughput.py --shapes gemma4-26b-a4b --formats mlx4 --streams ${STREAMS:-1,8,32} ${MLX_ONLY:+--mlx-lm-only} --gen 128 --prefill-chunk 4096 --time-cap 480 --json $OUT/serve_26b_mlx4.json"
# the packed slot-parallel down (HF2Q_DOWN_PACK, session 46): its GPU parity
step pack-tests 150 "python3 -m pytest -q -p no:cacheprovider -rf --tb=short -k 'gpu_packed_slot or gpu_slot_kernel_row_parity' tests/kernels/test_expert_down.py"
# 35B-A3B Q4_K serving at 1 and 8 streams, today's defaults and each NAME=VALUE of SERVE_ENVS
# (one process each; issue 14: the 8-stream ITL p99 <= 2x one stream's)
step serve-env-ab 420 "for e in default ${SERVE_ENVS:-HF2Q_ATTN_SHARED_KV=1}; do echo == \$e; env \$( [ \$e = default ] || echo \$e ) python3 bench/serve_throughput.py --shapes qwen3.5-35b-a3b --formats q4_k --no-mlx-lm --streams ${STREAMS:-1,8} --gen 128 --prefill-chunk 2048 --time-cap 150 --json $OUT/serve_\${e%%=*}.json | grep -a 'DecodeStep'; done"
# MLX 4-bit experts kept as GGML Q4_1 (HF2Q_AFFINE_EXPERTS=q4_1) against the affine kernels, one
# process, the two builds alternating per stream count (session 45: ours MLX 4-bit 35B-A3B 772
# steady tok/s at 32 streams against Q4_K's 2,089); then the GPU accuracy and graph tests
step serve-q4_1-ab 540 "python3 bench/serve_throughput.py --shapes ${SERVE_SHAPE:-qwen3.5-35b-a3b} --formats mlx4 --no-mlx-lm --affine-experts-ab --streams ${STREAMS:-1,8,32} --gen 128 --prefill-chunk 2048 --time-cap 420 --json $OUT/serve_q4_1_ab.json && python3 -m pytest -q -p no:cacheprovider -k 'gpu and q4_1' tests/test_affine_experts_q4_1.py tests/test_cuda_graph_step.py"
# speculative decoding (issue 12); `real` needs the pair in $HF2Q_MLX_CACHE (bench/README.md)
step replay-9b 300 "python3 bench/speculative.py replay --shapes 9b --acceptance 0.5 0.9 --rounds ${ROUNDS:-5} --tokens 128 --json $OUT/replay_9b.json"
step replay-35b 300 "python3 bench/speculative.py replay --shapes 35b-a3b --acceptance 0.5 0.9 --rounds 3 --tokens 128 --json $OUT/replay_35b.json"
step replay-9b-p 190 "python3 bench/speculative.py replay --shapes 9b --acceptance 0.5 0.9 --rounds 3 --tokens 128 --kinds fixed,pipelined,pipelined-adaptive --json $OUT/replay_9b_pipelined.json"
step replay-35b-p 220 "python3 bench/speculative.py replay --shapes 35b-a3b --acceptance 0.5 0.9 --rounds 3 --tokens 128 --kinds fixed,pipelined,pipelined-adaptive --json $OUT/replay_35b_pipelined.json"
step moe-prefill 100 "python3 bench/moe_prefill.py --tokens 256 1024 4096 --json $OUT/moe_prefill.json"
# the grouped-kernel MoE prefill: 32-token slices (the default) against one launch per 512 tokens (grouped-wide)
step moe-prefill-grouped 240 "python3 bench/moe_prefill.py --paths dequant32 grouped grouped-wide --tokens 64 256 1024 4096 --rounds 5 --json $OUT/moe_prefill_grouped.json"
# whole-model prefill: the default (grouped-wide) against dequant32 and grouped, one process
step prefill-wide 300 "python3 bench/prefill.py $OUT/prefill_wide.json --shapes ${PREFILL_SHAPES:-gemma4:26b-a4b} --formats q4_k --rounds 3 --env HF2Q_EXPERT_PREFILL=dequant32 --env HF2Q_EXPERT_PREFILL=grouped"
# issue 15's "first 512-token prefill under 2 s including compilation": a fresh process twice,
# the second with MLX's PTX disk cache warm (MLX keeps it in /tmp/mlx/<version>/ptx by default,
# so a user's second run is the warm case; the first run on a new machine is the cold one), with
# custom_kernels/cuda_cache on (KERNEL_CACHE=0: MLX's build, the default). Its
# own empty PTX and CUDA driver caches (and no cuda_cache cubins) make the cold run cold
# whatever steps ran before it.
step first-prefill 300 "rm -rf /tmp/ptx-first /tmp/cuda-first \$HF2Q_MLX_CACHE/cuda_kernels; for run in cold warm; do echo \$run; MLX_PTX_CACHE_DIR=/tmp/ptx-first CUDA_CACHE_PATH=/tmp/cuda-first HF2Q_CUDA_KERNEL_CACHE=\${KERNEL_CACHE:-auto} python3 bench/prefill.py $OUT/first_prefill_\$run.json --shapes ${PREFILL_SHAPES:-gemma4:26b-a4b} --formats q4_k --prompts 512 --rounds 1 --no-mlx-lm | grep -i 'first\|cuda_cache'; done"
# where the first prefill's time goes, per model class and ops function (bench/first_prefill.py),
# cold (its own empty PTX and CUDA driver caches) and then warm
step first-prefill-profile 300 "rm -rf /tmp/ptx-fpp /tmp/cuda-fpp \$HF2Q_MLX_CACHE/cuda_kernels; for run in cold warm; do MLX_PTX_CACHE_DIR=/tmp/ptx-fpp CUDA_CACHE_PATH=/tmp/cuda-fpp python3 bench/first_prefill.py $OUT/first_prefill_profile_\$run.json --shape ${PREFILL_SHAPES:-gemma4:26b-a4b} --top 25; done"
# HF2Q_AVOID_MLX_JIT's rows kernel and whole tiny MoE prefills against MLX's gathers (bit for bit)
step avoid-jit-tests 240 "python3 -m pytest -q -p no:cacheprovider -rf tests/test_avoid_mlx_jit.py --tb=short"
# the same first prefill four ways, each on empty kernel caches (ours and MLX's PTX): compile_ahead
# off, the default, the grouped prefill's token slices as views (no MLX gather to JIT), and every
# prefill gather HF2Q_AVOID_MLX_JIT takes away (slices, router picks, embedding rows); then warm
# (every cache kept from the last) with compile_ahead off and on: its dry pass's cost there
step first-prefill-ahead 480 "for v in HF2Q_COMPILE_AHEAD=0 HF2Q_NONE=1 HF2Q_GROUPED_SLICE_COPY=0 HF2Q_AVOID_MLX_JIT=1; do rm -rf /tmp/ptx-fpa /tmp/cuda-fpa \$HF2Q_MLX_CACHE/cuda_kernels; env \$v MLX_PTX_CACHE_DIR=/tmp/ptx-fpa CUDA_CACHE_PATH=/tmp/cuda-fpa python3 bench/first_prefill.py $OUT/first_prefill_\${v%%=*}.json --shape ${PREFILL_SHAPES:-gemma4:26b-a4b} --top 12; done; for v in HF2Q_COMPILE_AHEAD=0 HF2Q_NONE=1; do env \$v MLX_PTX_CACHE_DIR=/tmp/ptx-fpa CUDA_CACHE_PATH=/tmp/cuda-fpa python3 bench/first_prefill.py $OUT/first_prefill_warm_\${v%%=*}.json --shape ${PREFILL_SHAPES:-gemma4:26b-a4b} --top 5; done"
# what a fresh process pays on the first GPU call of single ops (bench/jit_probe.py), cold then
# warm on one PTX cache, then warm with the CUDA driver loading every module at start
step jit-probe 150 "rm -rf /tmp/ptx-jp /tmp/cuda-jp \$HF2Q_MLX_CACHE/cuda_kernels; for run in cold warm eager; do echo \$run; [ \$run = eager ] && export CUDA_MODULE_LOADING=EAGER; MLX_PTX_CACHE_DIR=/tmp/ptx-jp CUDA_CACHE_PATH=/tmp/cuda-jp HF2Q_CUDA_KERNEL_CACHE=1 python3 bench/jit_probe.py --json $OUT/jit_probe_\$run.json; done"
# our kernels through custom_kernels/cuda_cache's cubins (turned on here; off by default): its own
# GPU test and the GPU tests of the kernels a 26B-A4B prefill and decode run
step cache-gpu-tests 240 "HF2Q_CUDA_KERNEL_CACHE=1 python3 -m pytest -q -p no:cacheprovider --maxfail=5 -k gpu tests/kernels/test_cuda_cache.py tests/kernels/test_post_norm_residual.py tests/kernels/test_norm_rope.py tests/kernels/test_activations.py tests/kernels/test_moe_router.py tests/kernels/test_expert_prefill.py tests/kernels/test_decode_attention.py tests/kernels/test_sampling_kernels.py --tb=line"
# B = 1 decode of 26B-A4B with custom_kernels/cuda_cache on and off, alternating processes
step decode-cache-ab 240 "for i in 1 2; do for c in 1 0; do echo HF2Q_CUDA_KERNEL_CACHE=\$c; HF2Q_CUDA_KERNEL_CACHE=\$c python3 bench/serve_throughput.py --shapes gemma4-26b-a4b --formats q4_k --streams 1 --gen 128 --prefill-chunk 4096 | grep -a 'DecodeStep\\|cuda_cache'; done; done"
# where a gap between them would come from: the compiled B = 1 step under CUPTI, kernel time and
# host time per token, with the cache on and then off
step decode-cache-profile 300 "for c in 1 0; do echo HF2Q_CUDA_KERNEL_CACHE=\$c; HF2Q_CUDA_KERNEL_CACHE=\$c python3 bench/decode_profile.py gemma4:26b-a4b q4_k --step compiled --steps 16 --json $OUT/profile_26b_cache\$c.json | tail -25; done"
# the MoE router over G threadgroups per row (HF2Q_ROUTER_SPLIT) off and on, under CUPTI: its
# kernel time inside the compiled B = 1 step, and the step's
step profile-26b-split 200 "for s in 0 1; do echo HF2Q_ROUTER_SPLIT=\$s; HF2Q_ROUTER_SPLIT=\$s python3 bench/decode_profile.py gemma4:26b-a4b q4_k --step compiled --steps 16 --json $OUT/profile_26b_split\$s.json | grep -a 'ms/token\\|moe_router\\|qmv_mma_q4_k'; done"
step prefill-gpu-tests 150 "python3 -m pytest -q -p no:cacheprovider -k gpu tests/kernels/test_expert_prefill.py 2>&1 | grep -v \"^    \\|^E  \\|^$\""
step prefill-probe 120 "python3 bench/prefill_probe.py"
step kernel-floor 240 "python3 bench/kernel_floor.py --only \"${ONLY:-}\" --json $OUT/kernel_floor.json"
step clock-probe 90 "python3 bench/clock_probe.py --json $OUT/clock_probe.json"
# the kernels whose constants left the small pool (session 17), and the decode step that pads its inputs
step small-pool-tests 200 "python3 -m pytest -q -p no:cacheprovider --maxfail=3 -k 'gpu or compiled' tests/kernels/test_decode_attention.py tests/kernels/test_post_norm_residual.py tests/kernels/test_norm_rope.py tests/kernels/test_activations.py tests/kernels/test_sampling_kernels.py tests/test_dequant.py tests/kernels/test_gated_delta_decode.py tests/test_decode_step.py --tb=line"
# MLX's per-process settings in the compiled 26B-A4B decode: one worker each, interleaved rounds
step env-ab 300 "python3 bench/mlx_env_ab.py $OUT/env_ab.json --shape ${SHAPE:-gemma4:26b-a4b} --rounds 9 --tokens 64 --time-cap 200 --env '' --env MLX_MAX_OPS_PER_BUFFER=100 --env MLX_MAX_OPS_PER_BUFFER=500,MLX_MAX_MB_PER_BUFFER=4096 --env MLX_USE_CUDA_GRAPHS=0 --env MLX_CUDA_GRAPH_CACHE_SIZE=4096"
# session 18's device_array change (padded views returned evaluated) on the GPU: the test that found
# the Slice, the compiled step's GPU tests, the kernel wiring
step device-array-check 240 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_gated_delta_decode.py::test_gpu_block_decode_is_one_launch tests/test_decode_step.py tests/test_kernel_wiring.py --tb=short"
# which rows / steps differ alone and batched, and whether alone runs repeat (GPU diagnostic)
step parity-probe 200 "python3 bench/step_parity_probe.py ${PROBE:-llama:tiny gemma3:tiny}"
# one in 30 cases of every GPU test function (tests/conftest.py, HF2Q_GPU_SAMPLE); the files
# session 18's run did not reach first
step gpu-sample 270 "HF2Q_GPU_SAMPLE=\${GPU_SAMPLE:-30} python3 -m pytest -q -p no:cacheprovider --maxfail=5 -rf tests/kernels/test_expert_mma.py tests/kernels/test_expert_prefill.py tests/kernels/test_dense_glu_mma.py tests/kernels/test_qmatmul_mma.py tests/kernels/test_tq_kernels.py tests/test_kernel_wiring.py tests/kernels/test_gated_delta_decode.py tests/test_decode_step.py tests/kernels/test_decode_attention.py tests/kernels/test_post_norm_residual.py tests/kernels/test_moe_router.py tests/kernels/test_qmatmul.py tests/kernels/test_expert_glu_affine.py tests/kernels/test_expert_down.py tests/kernels/test_expert_glu.py tests/kernels/test_expert_matmul_kernel.py tests/kernels/test_sampling_kernels.py tests/kernels/test_activations.py tests/kernels/test_norm_rope.py tests/kernels/test_gated_delta.py --tb=short"
# our kernels from a CUDA graph of our own next to MLX: pointers, one launch, a replayed chain
step graph-probe 90 "python3 bench/cuda_graph_probe.py --json $OUT/graph_probe.json"
# the CUDA graph step (hf2q_mlx/cuda_graph_step.py): every one of its GPU tests (tiny Gemma 4 and
# Qwen 3.5 tokens against the compiled step, stream_generate and the serving engine through the
# graph), then Qwen 3.5's gate kernels, the norm + RoPE kernel and the cubin cache, one in 4
# cases each
step graph-tests 300 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/test_cuda_graph_step.py --tb=short; r=\$?; HF2Q_GPU_SAMPLE=\${GPU_SAMPLE:-4} python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_sigmoid_gate.py tests/kernels/test_norm_rope.py tests/kernels/test_cuda_cache.py --tb=short || r=1; exit \$r"
# the serving engine through the graph faulted on its first 26B-A4B replay (session 20): the same
# run launching the graph's work one launch at a time, each waited for, names the launch
step serve-graph-debug 240 "HF2Q_DECODE=graph HF2Q_GRAPH_DEBUG=1 PYTHONFAULTHANDLER=1 python3 bench/serve_throughput.py --shapes gemma4-26b-a4b --formats q4_k --streams 1 --gen 8 --prefill-chunk 4096 --time-cap 180 --json $OUT/serve_graph_debug.json"
# the graph against the compiled step on one shape (SHAPES), Q4_K only, no mlx-lm: tok/s,
# kernels per token, 64 greedy tokens compared
step graph-parity 420 "python3 bench/speed_table.py $OUT/graph_parity.json --shapes ${SHAPES:-qwen3_5:35b-a3b} --formats q4_k --graph q4_k --no-mlx-lm --rounds 3 --tokens 32 --parity 64"
step graph-26b 420 "python3 bench/speed_table.py $OUT/graph_26b.json --shapes gemma4:26b-a4b --formats q4_k --graph q4_k --no-mlx-lm --rounds 3 --tokens 32 --parity 64"
# session 22: split attention rows merged by their last part (no merge launch), the delta-net's
# states written in place in the graph; every GPU case of the attention and graph tests, one in 4
# of the delta-net kernel's
step merge-free-tests 300 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_decode_attention.py tests/test_cuda_graph_step.py --tb=short; r=\$?; HF2Q_GPU_SAMPLE=\${GPU_SAMPLE:-4} python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_gated_delta_decode.py --tb=short || r=1; exit \$r"
# a B-row compiled step under CUPTI (BATCH rows, 26B-A4B Q4_K): where an 8-stream serving step's
# kernel time goes (issue 14's 4x at 8 streams)
step profile-26b-batch 240 "python3 bench/decode_profile.py gemma4:26b-a4b q4_k --step compiled --batch ${BATCH:-8} --steps 16 --json $OUT/profile_26b_b${BATCH:-8}.json | tail -30"
# the decode attention with the query heads of a KV head sharing each key / value read
# (HF2Q_ATTN_SHARED_KV, off by default until this runs): every decode-attention GPU test (the
# default G = 1 body too: rewritten after its last GPU run), then the 8-row compiled 26B-A4B
# step under CUPTI with it off and on
step shared-kv-ab 360 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_decode_attention.py --tb=short; for v in 0 1; do echo HF2Q_ATTN_SHARED_KV=\$v; HF2Q_ATTN_SHARED_KV=\$v python3 bench/decode_profile.py gemma4:26b-a4b q4_k --step compiled --batch ${BATCH:-8} --steps 16 --json $OUT/profile_26b_b${BATCH:-8}_shared\$v.json | grep -a 'ms/token\\|decode_attention'; done"
# the grouped (tensor-core) experts' gate/up from 16 tokens a call (HF2Q_GROUPED_GLU_MIN=16, the
# default until session 24) against 8 (the default since): the 8-row compiled step under CUPTI
step grouped-glu-ab 240 "for v in 16 8; do echo HF2Q_GROUPED_GLU_MIN=\$v; HF2Q_GROUPED_GLU_MIN=\$v python3 bench/decode_profile.py ${PROFILE_SHAPE:-gemma4:26b-a4b} q4_k --step compiled --batch ${BATCH:-8} --steps 16 --json $OUT/profile_\$(echo ${PROFILE_SHAPE:-gemma4:26b-a4b} | tr : _)_b${BATCH:-8}_glu\$v.json | grep -a 'ms/token\\|expert'; done"
# the same switch in the serving engine: 1 and 8 streams (STREAMS) with the default 16 and with 8,
# one process each (SERVE_SHAPE: gemma4-26b-a4b or qwen3.5-35b-a3b)
step grouped-glu-serve 420 "for v in 16 8; do echo HF2Q_GROUPED_GLU_MIN=\$v; HF2Q_GROUPED_GLU_MIN=\$v python3 bench/serve_throughput.py --shapes ${SERVE_SHAPE:-gemma4-26b-a4b} --formats q4_k --streams ${STREAMS:-1,8} --gen 128 --prefill-chunk 4096 --time-cap 180 --json $OUT/serve_\$(echo ${SERVE_SHAPE:-gemma4-26b-a4b} | tr . _)_glu\$v.json; done"
# the graph captured over several streams (HF2Q_GRAPH_LANES, 1 by default until this runs):
# independent launches (a MoE layer's dense MLP beside its router and experts) run side by side.
# Its GPU tests with 4 lanes, then the graph against the compiled step with 1 and with 4 lanes
# (one process each, SHAPES, 64 greedy tokens compared)
step graph-lanes-tests 240 "HF2Q_GRAPH_LANES=4 python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/test_cuda_graph_step.py --tb=short"
step graph-lanes-ab 480 "for v in 1 4; do echo HF2Q_GRAPH_LANES=\$v; HF2Q_GRAPH_LANES=\$v python3 bench/speed_table.py $OUT/graph_lanes\$v.json --shapes ${SHAPES:-gemma4:26b-a4b} --formats q4_k --graph q4_k --no-mlx-lm --rounds 3 --tokens 32 --parity 64 | grep -a 'graph'; done"
# llama.cpp CUDA on the same random GGUF (issue 15); the bundle copied into ../.device from
# ../shared/peers/llama-cuda-sm90.tar.xz; SHAPE one of gemma4:26b-a4b, gemma4:31b, qwen3_5:9b, qwen3_5:35b-a3b
step llama-peer 540 "mkdir -p /tmp/peer && { [ -x /tmp/peer/cuda/run.sh ] || tar -xJf ../.device/llama-cuda-sm90.tar.xz -C /tmp/peer; } && python3 bench/llama_peer.py $OUT/llama_peer.json --shape ${SHAPE:-qwen3_5:9b} --llama /tmp/peer/cuda/run.sh --ngl 99 --rounds 2 --reps 2"
# the real Gemma 3 270M Q4_K_M on the H200 (default decode path, the graph) against the same
# greedy tokens on the CPU (bench/results/gemma3_270m_tokens_cpu.json, 3 prompts x 64): its pieces
# carried first into /tmp/g (bench/README.md, "One H200 session")
# the real Gemma 3 270M (its parts carried into /tmp/g, bench/README.md): greedy tokens on the
# GPU in float32 against the CPU's (float32; session 23 ran the default bf16), then every path's logits
# along the CPU's tokens (bench/forced_logits.py) in both dtypes against the CPU's: where an
# argmax flips, is the top-2 margin inside the logit error (a near tie) or not (a bug)?
CPU_TOKENS=bench/results/gemma3_270m_tokens_cpu.json
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
GEMMA_GGUF="cat /tmp/g/part0* > /tmp/gemma.gguf && echo '$GEMMA_SHA  /tmp/gemma.gguf' | sha256sum -c"
FORCED="python3 bench/forced_logits.py /tmp/gemma.gguf --tokens-from $CPU_TOKENS --against bench/results/gemma3_270m_forced_cpu_fp32.json"
step real-gemma3 360 "$GEMMA_GGUF && { python3 bench/kernels_vs_reference.py /tmp/gemma.gguf --tokens 64 --dtype float32 --expect $CPU_TOKENS --json $OUT/gemma3_270m_tokens_fp32.json; $FORCED --dtype float32 --json $OUT/gemma3_270m_forced_fp32.json; $FORCED --json $OUT/gemma3_270m_forced_bf16.json; }"
# llama.cpp CUDA against ours on the real small GGUFs (issue 15: decode >= 0.5x, prefill >=
# 0.25x): Gemma 3 270M Q4_K_M (parts in /tmp/g as for real-gemma3) and SmolLM2-135M-Instruct
# Q4_1 (parts in /tmp/s: bench/README.md), the llama.cpp bundle in ../.device; pp512 / tg128,
# ours decoding through the CUDA graph (bench/llama_peer.py)
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
step llama-small 420 "$PEER_UNPACK $GEMMA_GGUF && cat /tmp/s/part0* > /tmp/smollm2.gguf && echo '$SMOL_SHA  /tmp/smollm2.gguf' | sha256sum -c && for m in smollm2 gemma; do python3 bench/llama_peer.py $OUT/llama_small_\$m.json --gguf /tmp/\$m.gguf --llama /tmp/peer/cuda/run.sh --ngl 99 --rounds ${ROUNDS:-3} --reps 2; done"
# issue 14's batched lm_head row parity on the GPU: every head type, plain and tied, bf16 / fp16
# / fp32 x, each row's logits at B = 1..32 bit-identical to the row alone (dense heads past 16
# rows are an expected failure: MLX's matmul changes kernels)
# session 26: float / MLX affine mat-vecs (models/kernel_linears.py), dense heads' row parity, the
# MLX 4-bit / float steps in the graph, stream_generate's TurboQuant step through the graph
step dense-tests 300 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_dense_matvec.py --tb=short --maxfail=5 --durations=5; python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and (F32 or F16)' tests/test_lm_head_rows.py --tb=line; python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_stream_generate_turboquant or gpu_graph or gpu_stream_generate_graph or gpu_engine_graph' tests/test_decode_step.py tests/test_cuda_graph_step.py --tb=short --durations=8"
# session 26: dense_matvec's (W, R) at the 31B / 9B shapes against the copy bandwidth (issue 15)
step matvec-sweep 300 "python3 bench/matvec_sweep.py --json $OUT/matvec_sweep_mlx4.json && python3 bench/matvec_sweep.py --float --shapes '31b qkv,31b down' --json $OUT/matvec_sweep_bf16.json"
step lm-head-rows 300 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/test_lm_head_rows.py --tb=line"
# the dense heads alone (session 25: 16-row slices did not make MLX's matmul row-stable, not kept)
step lm-head-dense 150 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and (F32 or F16)' tests/test_lm_head_rows.py --tb=line"
# the types lm-head-rows did not reach in 300 s (session 25: all but Q6_K passed)
step lm-head-q6k 150 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and Q6_K' tests/test_lm_head_rows.py --tb=line"
# session 25: TurboQuant in the compiled step (per-row offsets and balance tables in both kernels)
step tq-tests 300 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_tq_kernels.py --tb=short; r=\$?; python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and turboquant' tests/test_decode_step.py --tb=short || r=1; exit \$r"
step tq-step-tests 240 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and turboquant' tests/test_decode_step.py --tb=short"
# TurboQuant's whole-model decode (26B-A4B Q4_K, 5 interleaved rounds) against bf16, as a command
# (tq_speed JSON_NAME DEFAULT_CONTEXTS [MORE_ARGS]; TQ_CONTEXTS overrides the contexts)
tq_speed() { echo "python3 bench/turboquant_speed.py --model-only --format q4_k --contexts ${TQ_CONTEXTS:-$2} --rounds 5 --decode 32 ${3:+$3 }--json $OUT/$1.json"; }
# TurboQuant through the CUDA graph (the default since session 25) against bf16 through it; the
# same with TurboQuant kept on the compiled step (session 25's run of that: TQ8 0.69x at 4K)
step tq-step 360 "$(tq_speed tq_step 4096,16384)"
# session 27: TurboQuant's fused launches (HF2Q_TQ_FOLD=1: the reduce folded into the last
# partition, the quantize writing the cache words): their GPU tests, then the A/B in one process
step tq-fold-tests 300 "HF2Q_TQ_FOLD=1 python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and (flash or quantize)' tests/kernels/test_tq_kernels.py --tb=short; HF2Q_TQ_FOLD=1 python3 -m pytest -q -p no:cacheprovider -rA -k 'gpu_graph_step_gives and tq8' tests/test_cuda_graph_step.py --tb=short"
step tq-fold-step 420 "$(tq_speed tq_fold_step 4096,16384 --fold-ab)"
step tq-step-compiled 360 "HF2Q_TQ_GRAPH=0 $(tq_speed tq_step_compiled 4096,16384)"
# the graph against the compiled step on tiny models (bf16 and TQ8 caches)
step tq-graph-tests 300 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu_graph_step_gives tests/test_cuda_graph_step.py --tb=short"
# session 25: the chunked delta-net prefill, the CUDA default now
step gdn-tests 120 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu_chunked tests/kernels/test_gated_delta.py --tb=short"
# session 30: head_gate with the element count out of its template (Qwen 3.5 compiled it for every
# prompt length and packed total), and the serving engine's warm-up (every prefill-length bucket,
# every span's graph before start() returns): their GPU tests, then the packed-prefill A/B on
# 35B-A3B again (session 29: packed lost, 343 against 514 tok/s at 32 streams), with warmup_s
step warmup-tests 300 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_sigmoid_gate.py tests/test_engine_warmup.py --tb=short; r=\$?; python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_graph_step_gives and qwen3_5' tests/test_cuda_graph_step.py --tb=short || r=1; exit \$r"
step pack-35b 480 "python3 bench/serve_throughput.py --shapes qwen3.5-35b-a3b --formats q4_k --streams 1,8,32 --gen 128 --prefill-chunk 4096 --batch-prefill-ab --time-cap 420 --json $OUT/serve_batch_prefill_35b.json"
# session 31: the TurboQuant flash-decode call at 26B-A4B's layer shapes, default split-K
# partitions against more / fewer (CUPTI time by kernel), then Nsight Compute on one partial
# launch (stall reasons, achieved occupancy: its cost does not follow its tokens per
# threadgroup, docs/kernel_notes.md session 31)
step tq-sweep 120 "python3 bench/tq_sweep.py --bits ${TQ_BITS:-8} --rounds 3 --json $OUT/tq_sweep.json"
step tq-ncu 240 "$NCU_RUN --kernel-name regex:tq_flash_decode_partial --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis python3 bench/tq_sweep.py --bits 8 --rounds 1 --chain 2 --only '${TQ_ONLY:-sliding}' --default-only"
# session 32: W = 8 SIMD groups per flash-decode threadgroup (its GPU tests, the whole model
# against W = 4 and bf16), and the TurboQuant paths through the graph and the decode step
step tq-w-tests 150 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and (eight_simd or sums_any or long_context)' tests/kernels/test_tq_kernels.py --tb=short"
step tq-w-step 300 "$(tq_speed tq_w_step 4096 '--tq-env HF2Q_TQ_W=8')"
step tq-path-tests 330 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and tq8' tests/test_cuda_graph_step.py --tb=short; r=\$?; python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and turboquant' tests/test_decode_step.py --tb=short --durations=8 || r=1; exit \$r"
# session 32: Gemma-4-31B's dense mat-vecs (issue 15: its weights read at 40 % of the copy
# bandwidth) run the tensor-core kernels at M = 1 (q | k | v 16384 x 5376, down 5376 x 21504,
# o 5376 x 8192; gate | up as the dense GLU, F 21504 x K 5376): their (U, W) swept under
# CUPTI against the default and the scalar kernel, M = 1 and 8, weights rotated past L2
# (mma_31b NAME MAT_VEC_CONFIGS GLU_CONFIGS: the command, JSONs mma_NAME / glu_NAME)
mma_31b() { echo "python3 bench/qmatmul.py $OUT/mma_$1.json --mma --profile --types Q4_K --shapes 16384x5376,5376x21504,5376x8192 --mma-rows 1,8 --mma-configs $2 && python3 bench/qmatmul.py $OUT/glu_$1.json --glu --profile --types Q4_K --shapes 21504x5376 --mma-rows 1,8 --mma-configs $3"; }
step mma-31b 420 "$(mma_31b 31b 1x4,1x8,2x4,4x4,4x8,3x8 1x2,2x2,2x4,1x8,2x8,3x4)"
# the tensor-core mat-vec and GLU with streaming weight loads (config S = 1: ld.global.cs, so
# x stays in L1) and loads a run ahead (PF = 1): GPU bit parity with the default, then the A/B
# at Gemma-4-31B's shapes
step mma-stream-ab 420 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_load_variants' tests/kernels/test_qmatmul_mma.py tests/kernels/test_dense_glu_mma.py --tb=short; $(mma_31b stream_31b 2x8s,2x8p,1x8p,1x8sp 1x4s,1x4p,1x4sp,1x8p)"
# the whole Gemma-4-31B decode with each load variant (one worker process per setting, rounds
# interleaved; ~18 GB a worker: four fit an H200, three an H100)
step mma-loads-ab 420 "python3 bench/mlx_env_ab.py $OUT/mma_loads_ab.json --shape ${SHAPE:-gemma4:31b} --rounds 7 --tokens 64 --time-cap 300 --env '' --env HF2Q_MMA_LOADS=s --env HF2Q_MMA_LOADS=p ${MORE_ENV:---env HF2Q_MMA_LOADS=sp}"
# Nsight Compute on one steady launch of the tensor-core mat-vec (MMA_SHAPE, MMA_ROWS rows of
# x, 1 unless set): stall reasons, issue efficiency and pipe use (session 32's sweep: 33-43 % of
# the copy bandwidth at 31B; session 54: 35B-A3B's 12,352 x 2,048 at 32 rows 0.33 TB/s)
step mma-ncu 240 "$NCU_RUN --kernel-name regex:${MMA_KERNEL:-qmv_mma} --launch-skip 40 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats python3 bench/qmatmul.py /tmp/ncu_mma.json ${MMA_MODE:---mma} --types ${MMA_TYPE:-Q4_K} --shapes ${MMA_SHAPE:-5376x21504} --mma-rows ${MMA_ROWS:-1} --reps 3"
# the tensor-core mat-vec's time per call at 1, 8, 16 and 32 rows of x (CUPTI) on 35B-A3B's
# shared-expert down, attention out and delta-net input shapes (session 54's 32-row step: 21,
# 21 and 42.6 us a call, far under the weights' bandwidth)
step mma-rows 200 "python3 bench/qmatmul.py $OUT/mma_rows.json --mma --profile --types Q4_K --shapes ${MMA_SHAPES:-2048x512,2048x4096,12352x2048} --mma-rows 1,8,16,32 --reps 9 --mma-configs ${MMA_CFGS:-2x8c1,2x8c2,1x8}"
# session 33: the cubin cache on by default outside per-token steps (HF2Q_CUDA_KERNEL_CACHE auto):
# whole-model decode through the graph, then through the compiled step, auto against 0 (one
# worker per setting, interleaved rounds; two 26B-A4B workers fit an H100)
step cache-auto-ab 420 "for s in graph compiled; do python3 bench/mlx_env_ab.py $OUT/cache_auto_ab_\$s.json --step \$s --shape ${SHAPE:-gemma4:26b-a4b} --rounds 5 --tokens 64 --time-cap 120 --env '' --env HF2Q_CUDA_KERNEL_CACHE=0; done"
# session 33: programmatic dependent launches in the graph (HF2Q_GRAPH_PDL=1: each kernel's
# blocks scheduled during the previous kernel's tail, waiting in their first instruction; 2,
# session 34: the wait without the early trigger): the graph's GPU parity with it (PDL, default
# 2; mode 1 passed in session 34), then the whole decode, both modes against the default
# (session 34, H200: mode 1 0.85x)
step graph-pdl-tests 300 "HF2Q_GRAPH_PDL=${PDL:-2} python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_graph_step_gives or gpu_stream_generate_graph or gpu_engine_graph' tests/test_cuda_graph_step.py tests/test_decode_step.py --tb=short"
step graph-pdl-ab 360 "python3 bench/mlx_env_ab.py $OUT/graph_pdl_ab.json --step graph --shape ${SHAPE:-gemma4:26b-a4b} --rounds 7 --tokens 64 --time-cap 240 --env '' --env HF2Q_GRAPH_PDL=1 --env HF2Q_GRAPH_PDL=2"
# TurboQuant's coalesced row reads (HF2Q_TQ_COALESCE=1: lanes own strided words, so a SIMD
# group's load is 128 consecutive bytes; CPU emulator only in session 33): GPU tests, the sweep
# (its "coal" variants), then the whole 26B-A4B model against the default and bf16
step tq-coal-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and coalesced' tests/kernels/test_tq_kernels.py --tb=short"
step tq-coal-step 360 "$(tq_speed tq_coal_step 4096,16384 '--tq-env HF2Q_TQ_COALESCE=1')"
# why TurboQuant's 8-bit partial kernel does not speed up with more threadgroups (keys/2 in the
# sweep: 0.95x) while the 4-bit one does (1.14-1.84x): stall reasons per issued instruction and
# shared-memory bank conflicts (the 256-entry codebook lookups) of one global-layer launch
TQ_STALL_METRICS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__cycles_active.avg,smsp__inst_executed_op_shared_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum'
step tq-stalls 240 "for b in 8 4; do $NCU_RUN --kernel-name regex:tq_flash_decode_partial --launch-skip 2 --launch-count 1 --metrics '$TQ_STALL_METRICS' python3 bench/tq_sweep.py --bits \$b --rounds 1 --chain 2 --only '${TQ_ONLY:-global 4K}' --default-only; done"
# session 34: interleaved copies of a codebook over 32 entries (HF2Q_TQ_CB_COPIES=16: lane l
# reads copy l % 16, so 32 lookups of a 256-entry codebook meet at most two addresses a bank;
# CPU emulator only so far): GPU tests, then the whole 26B-A4B model against the default and bf16
# (the sweep's "cb x16" variants; tq-stalls with it in the environment counts the conflicts)
step tq-copies-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and (codebook_copies or flash_decode_kernels_gpu)' tests/kernels/test_tq_kernels.py --tb=short"
step tq-copies-step 360 "$(tq_speed tq_copies_step 4096,16384 '--tq-env HF2Q_TQ_CB_COPIES=16')"
# session 34: where a dense Q4_K linear's prefill time goes at Gemma-4-31B's four shapes, T 512
# and 2,048 (issue 15: 31B prefill 0.72x mlx-lm): our path split into dequant / GEMM / rest,
# the dequantizer alone (GB/s), the bf16 GEMM alone, MLX's affine 4-bit quantized_matmul
step dense-prefill 240 "python3 bench/dense_prefill.py $OUT/dense_prefill.json"
# the dense linears' prefill as a one-expert grouped prefill (HF2Q_DENSE_PREFILL=grouped, CPU
# emulator only so far): GPU tests, then the whole prefill against the default and mlx-lm
step dense-grouped-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_dense_prefill_grouped.py --tb=short"
step dense-grouped-ab 480 "python3 bench/prefill.py $OUT/prefill_dense_grouped.json --shapes ${PREFILL_SHAPES:-gemma4:31b} --rounds 3 --env HF2Q_DENSE_PREFILL=grouped"
# session 34: the partial kernel's registers bounded for more threadgroups an SM (launch bounds on
# our cubins, HF2Q_TQ_MIN_BLOCKS; nvcc: a global TQ8 layer at half its rows per threadgroup, 128
# registers with no spills for 4 threadgroups an SM, against 224 for 2): GPU tests, then the
# whole 26B-A4B model at 4K and 16K (the sweep's "mb" variants time the kernel)
step tq-mb-tests 200 "HF2Q_TQ_ROW_REGS=64 HF2Q_TQ_MIN_BLOCKS=4 python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and flash' tests/kernels/test_tq_kernels.py --tb=short"
step tq-mb-step 360 "$(tq_speed tq_mb_step 4096,16384 '--tq-env HF2Q_TQ_ROW_REGS=64,HF2Q_TQ_MIN_BLOCKS=4')"
# session 34: the wide grouped kernels' n-tiles per column group (HF2Q_GROUPED_WIDE_NT, default 2,
# never timed; read at each plan now): GPU parity at 4, then the MoE prefill at 1 and 4 against
# 2 (issue 14's prefill-bound 32-stream figures), and the dense one-expert prefill likewise
# HF2Q_GROUPED_SORTED (the wide kernels' pairs from a list sorted by expert, not every
# threadgroup scanning all ids): GPU bits against the scanning kernels, then the whole 26B-A4B and
# 35B-A3B prefills against the default, with NT 4 beside it
step sorted-tests 240 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_grouped_sorted or gpu_grouped_wide' tests/kernels/test_expert_prefill.py --tb=short"
step sorted-ab 480 "python3 bench/prefill.py $OUT/prefill_sorted.json --shapes ${PREFILL_SHAPES:-gemma4:26b-a4b,qwen3_5:35b-a3b} --formats q4_k --no-mlx-lm --rounds 3 --env HF2Q_GROUPED_SORTED=1 --env HF2Q_GROUPED_SORTED=1,HF2Q_GROUPED_WIDE_NT=4 --env HF2Q_GROUPED_WIDE_NT=4"
# HF2Q_MMA_MIN_BLOCKS=3 (launch bounds on the mat-vec cubins: 3 threadgroups an SM, one wave at
# 31B's N = 5,376 shapes): the mat-vec's and the graph's GPU tests with it, then the whole 31B
# decode through the graph against the default
# (session 37: both files in one step ran past 300 s with 31 tests passed; split in two)
step mma-mb-tests 300 "HF2Q_MMA_MIN_BLOCKS=3 python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_qmatmul_mma.py --tb=short"
step mma-mb-graph-tests 300 "HF2Q_MMA_MIN_BLOCKS=3 python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_graph_step_gives or gpu_stream_generate_graph or gpu_engine_graph' tests/test_cuda_graph_step.py tests/test_decode_step.py --tb=short"
step mma-mb-ab 420 "python3 bench/mlx_env_ab.py $OUT/mma_mb_ab.json --step graph --shape ${SHAPE:-gemma4:31b} --rounds 7 --tokens 64 --time-cap 300 --env '' --env HF2Q_MMA_MIN_BLOCKS=3"
step wide-nt-tests 240 "HF2Q_GROUPED_WIDE_NT=4 python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_expert_prefill.py tests/kernels/test_dense_prefill_grouped.py --tb=short"
step wide-nt-ab 480 "python3 bench/prefill.py $OUT/prefill_wide_nt.json --shapes ${PREFILL_SHAPES:-gemma4:26b-a4b,qwen3_5:35b-a3b} --formats q4_k --no-mlx-lm --rounds 3 --env HF2Q_GROUPED_WIDE_NT=4 --env HF2Q_GROUPED_WIDE_NT=1"
# session 37's defaults (sorted wide kernels, HF2Q_AVOID_MLX_JIT on CUDA, the dense dequant path's
# 128-row chunks): Gemma-4-31B's whole prefill against mlx-lm (issue 15: was 0.72x; the odd
# chunk had run q|k|v and gate|up ~9x slow) with HF2Q_AVOID_MLX_JIT=0 beside it (its steady
# cost, if any), then a fresh machine's first prefill of 26B-A4B and 31B with the defaults
step prefill-31b 420 "python3 bench/prefill.py $OUT/prefill_31b.json --shapes ${PREFILL_SHAPES:-gemma4:31b} --rounds 3 --env HF2Q_AVOID_MLX_JIT=0"
step first-prefill-defaults 360 "for sh in ${FP_SHAPES:-gemma4:26b-a4b gemma4:31b}; do rm -rf /tmp/ptx-fpd /tmp/cuda-fpd \$HF2Q_MLX_CACHE/cuda_kernels; for run in cold warm; do MLX_PTX_CACHE_DIR=/tmp/ptx-fpd CUDA_CACHE_PATH=/tmp/cuda-fpd python3 bench/first_prefill.py $OUT/first_prefill_\${sh#*:}_\$run.json --shape \$sh --top 8; done; done"
# the dequantizer's stores staged through shared memory (HF2Q_DEQUANT_STAGED=1, session 37, CPU
# emulator and nvcc only): GPU bits against the plain kernel, then dense-prefill's "staged" rows
step staged-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_staged or gpu_get_rows' tests/kernels/test_qmatmul.py --tb=short"
# session 38: Gemma-4-31B through the CUDA graph decoded at 0.5 tok/s on an 80 GB H100 (weights
# read at 9 GB/s; beside its MLX 4-bit twin, or two 31B processes in mlx_env_ab). The capture now
# ends with mx.clear_cache(); speed_table prints MLX's and the driver's memory after each first
# prefill: 31B alone through the graph (no twin, no compiled variant), then beside its twin
# session 38: the norm + RoPE kernel's sin / cos without the dead large-argument path (the slowest
# compile of a fresh machine's first prefill): its GPU bits, before first-prefill-defaults
# and HF2Q_GRAPH_PREFETCH=1 (the graph's managed buffers migrated to the GPU after each capture)
# against the default, 31B in two worker processes at once (session 38's 0.5 tok/s case)
step graph-prefetch-ab 300 "python3 bench/mlx_env_ab.py $OUT/graph_prefetch_ab.json --step graph --shape ${SHAPE:-gemma4:31b} --rounds 3 --tokens 32 --time-cap 240 --env '' --env HF2Q_GRAPH_PREFETCH=1"
step norm-rope-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_norm_rope.py --tb=short"
# session 38: MLX 4-bit linears' prompt rows as dequantized chunks + cuBLAS (HF2Q_AFFINE_PREFILL=1,
# off; MLX's quantized_matmul JIT-compiles at first use, 45.6 s for 31B's first prefill on a fresh
# H100, and ran 31B's q|k|v 5.3x the plain matmul's time): GPU test, then 31B's MLX 4-bit prefill
step affine-prefill 420 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_affine_prefill.py --tb=short && python3 bench/prefill.py $OUT/prefill_affine.json --shapes ${PREFILL_SHAPES:-gemma4:31b} --formats mlx4 --rounds 3 --env HF2Q_AFFINE_PREFILL=1"
step graph-memory 420 "python3 bench/speed_table.py $OUT/graph_memory_31b.json --shapes gemma4:31b --formats q4_k --no-mlx-lm --skip 'ours q4_k' --graph q4_k --rounds 3 --tokens 32 && python3 bench/speed_table.py $OUT/graph_memory_31b_twin.json --shapes gemma4:31b --formats q4_k,mlx4 --skip 'ours mlx4,ours q4_k' --graph q4_k --rounds 3 --tokens 32"
# session 39: the chunked delta rule's identity without mx.eye (a scatter MLX's CUDA back end
# JIT-compiles: 4.6-5.2 s of Qwen 3.5's first prefill on a fresh H100): its GPU parity, then
# run first-prefill-defaults with FP_SHAPES="qwen3_5:35b-a3b qwen3_5:9b"
step delta-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu or inverse or chunked' tests/kernels/test_gated_delta.py --tb=short"
# HF2Q_AFFINE_PREFILL on by default with CUDA (session 39): the MLX 4-bit prefill with it and
# without it against mlx-lm, from an empty PTX cache (prefill.py's "first prefill" line of the
# default is then a fresh machine's, MLX's JIT included); first-prefill-mlx4 takes one apart
step first-prefill-mlx4 300 "for sh in ${FP_SHAPES:-gemma4:26b-a4b gemma4:31b}; do rm -rf /tmp/ptx-m4 /tmp/cuda-m4 \$HF2Q_MLX_CACHE/cuda_kernels; MLX_PTX_CACHE_DIR=/tmp/ptx-m4 CUDA_CACHE_PATH=/tmp/cuda-m4 python3 bench/first_prefill.py $OUT/first_prefill_mlx4_\${sh#*:}.json --shape \$sh --format mlx4 --top 8; done"
step prefill-mlx4 420 "rm -rf /tmp/ptx-m4 /tmp/cuda-m4; MLX_PTX_CACHE_DIR=/tmp/ptx-m4 CUDA_CACHE_PATH=/tmp/cuda-m4 python3 bench/prefill.py $OUT/prefill_mlx4.json --shapes ${PREFILL_SHAPES:-gemma4:26b-a4b,qwen3_5:35b-a3b,qwen3_5:9b} --formats mlx4 --rounds 3 --env HF2Q_AFFINE_PREFILL=0"
# session 39: MLX 4-bit experts transcoded to Q4_1 per prompt call, through the grouped kernels
# (HF2Q_AFFINE_EXPERT_PREFILL=1, built without a GPU): GPU tests, a fresh PTX cache's first
# MLX 4-bit prefill with it (MLX's gather_qmm JIT: 46.6 s / 50.2 s on 26B-A4B / 35B-A3B without),
# then the prefill with it against the default and mlx-lm; on a win default it on with CUDA
step affine-experts 560 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_affine_q4_1.py --tb=short; rm -rf /tmp/ptx-ae /tmp/cuda-ae; for sh in ${FP_SHAPES:-gemma4:26b-a4b}; do HF2Q_AFFINE_EXPERT_PREFILL=1 MLX_PTX_CACHE_DIR=/tmp/ptx-ae CUDA_CACHE_PATH=/tmp/cuda-ae python3 bench/first_prefill.py $OUT/first_prefill_ae_\${sh#*:}.json --shape \$sh --format mlx4 --top 8 | grep -v '^ops\\.'; done; python3 bench/prefill.py $OUT/prefill_affine_experts.json --shapes ${PREFILL_SHAPES:-gemma4:26b-a4b,qwen3_5:35b-a3b} --formats mlx4 --rounds 3 --env HF2Q_AFFINE_EXPERT_PREFILL=1"
# the transcoded experts' GPU tests at the ops (on by default with CUDA since session 40)
step affine-experts-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_affine_q4_1.py --tb=short"
# the MLX affine dense MLP's one-launch GLU (session 40) against the mat-vec + activation
# the delta-net prefill's conv kernel on the GPU, and compile_ahead's warm-ups (session 41)
step conv-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu' tests/kernels/test_gated_delta.py tests/test_compile_ahead.py --tb=short"
# a fresh machine's first prefill with compile_ahead's library warm-ups on (1) and off (0),
# every cache emptied before each run; the first run of the call also reads the libraries cold
step first-prefill-warm-ab 540 "for sh in ${FP_SHAPES:-gemma4:26b-a4b qwen3_5:35b-a3b}; do for fmt in ${FP_FORMATS:-mlx4 q4_k}; do for w in 1 0; do rm -rf /tmp/ptx-w /tmp/cuda-w \$HF2Q_MLX_CACHE/cuda_kernels; HF2Q_COMPILE_AHEAD_WARM=\$w MLX_PTX_CACHE_DIR=/tmp/ptx-w CUDA_CACHE_PATH=/tmp/cuda-w timeout 120 python3 bench/first_prefill.py $OUT/first_prefill_warm\${w}_\${fmt}_\${sh#*:}.json --shape \$sh --format \$fmt --top 5 > $OUT/first_prefill_warm\${w}_\${fmt}_\${sh#*:}.log 2>&1; echo \"warm=\$w\"; grep -E 'prefills: first|^compile_ahead' -A0 $OUT/first_prefill_warm\${w}_\${fmt}_\${sh#*:}.log; grep -A5 'largest one-time' $OUT/first_prefill_warm\${w}_\${fmt}_\${sh#*:}.log; done; done; done"
# how NVRTC compiles scale with threads on this machine (a first prefill compiles 12-15 at once)
step nvrtc-scaling 120 "nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null; python3 bench/nvrtc_compile.py $OUT/nvrtc_scaling.json --limit 16 --thread-counts 1,4,8,16"
# the affine rows kernel with its width as data (session 41): prompt rows and the graph step
step affine-rows-tests 300 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and (mlx4 or prompt_rows or affine)' tests/kernels/test_affine_prefill.py tests/test_cuda_graph_step.py --tb=short"
# the GPU tests that run Qwen 3.5 (its prefill's conv kernel, session 41), capped
step qwen-gpu-tests 420 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and (qwen or qwen3_5 or gated or delta)' tests --tb=short -x"
# the slot-parallel expert down (HF2Q_DOWN_SLOTS=8, off by default) through the graph step
# against the default, Q4_K, after its GPU row parity at the two models' down shapes (session 41)
step down-slots-graph-ab 300 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu_slot_kernel_row_parity tests/kernels/test_expert_down.py --tb=short; for sh in ${AB_SHAPES:-gemma4:26b-a4b qwen3_5:35b-a3b}; do python3 bench/mlx_env_ab.py $OUT/down_slots_ab_\${sh#*:}.json --step graph --format q4_k --shape \$sh --rounds 5 --tokens 64 --time-cap 100 --env '' --env HF2Q_DOWN_SLOTS=8 2>&1 | tail -4; done"
# the whole-model GPU tests under the slot-parallel expert down, the CUDA default since session 41
step down-slots-gpu-tests 540 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/test_cuda_graph_step.py tests/test_decode_step.py tests/test_step_row_parity.py tests/test_kernel_wiring.py tests/kernels/test_expert_down.py tests/kernels/test_moe_router.py --tb=short"
# one-time costs of single MLX ops (library loads, cuDNN plans) in a fresh process, then warm
step first-ops 120 "rm -rf /tmp/ptx-fo /tmp/cuda-fo; for run in fresh warm; do MLX_PTX_CACHE_DIR=/tmp/ptx-fo CUDA_CACHE_PATH=/tmp/cuda-fo python3 bench/first_ops.py $OUT/first_ops_\$run.json; done"
step dense-glu-ab 420 "python3 bench/mlx_env_ab.py $OUT/dense_glu_ab.json --step graph --format mlx4 --shape ${SHAPE:-gemma4:26b-a4b} --rounds 5 --tokens 64 --time-cap 300 --env '' --env HF2Q_AFFINE_DENSE_GLU=0"
# the router's row loaded in one round (HF2Q_ROUTER_BATCHED) and Gemma 4's join made by the router
# kernel (HF2Q_ROUTER_JOIN), session 42: GPU parity, the kernel alone against the loop form
# under CUPTI (with wider and narrower mappings), the whole step with each switched (JOIN_AB=1 for
# Gemma 4, whose join is off by default; 0 for Qwen 3.5)
step router-batched 300 "python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_moe_router.py --tb=short && python3 bench/router_split.py --profile --loop --batch 1 8 --formats f32,bf16,q8 --splits 32x4,64x2,32x8 --json $OUT/router_batched.json"
step router-batched-ab 420 "python3 bench/mlx_env_ab.py $OUT/router_batched_ab.json --step graph --format ${FORMAT:-q4_k} --shape ${SHAPE:-gemma4:26b-a4b} --rounds 5 --tokens 64 --time-cap 300 --env '' --env HF2Q_ROUTER_BATCHED=0 --env HF2Q_ROUTER_JOIN=${JOIN_AB:-0} ${AB_EXTRA:-}"
# Qwen 3.5's MoE end with the residual add and norm after it in one kernel (session 42, CPU-
# verified, off): its GPU tests, then 35B-A3B's graph decode with it on and off
step gate-norm-ab 420 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and shared_gate' tests/kernels/test_sigmoid_gate.py --tb=short && python3 bench/mlx_env_ab.py $OUT/gate_norm_ab.json --step graph --format ${FORMAT:-q4_k} --shape qwen3_5:35b-a3b --rounds 5 --tokens 64 --time-cap 300 --env '' --env HF2Q_SHARED_GATE_NORM=1 ${AB_EXTRA:-}"
# the per-pair expert kernels' (R, U, W) in the graph decode (HF2Q_EXPERT_RUN, session 44): the
# sweep that chose 4,1,1 timed whole calls with host cost inside; three 26B-A4B workers fit an H100
step expert-run-ab 420 "python3 bench/mlx_env_ab.py $OUT/expert_run_ab.json --step graph --format q4_k --shape ${SHAPE:-gemma4:26b-a4b} --rounds ${ROUNDS:-5} --tokens 64 --time-cap 300 --env '' ${RUN_ENVS:---env HF2Q_EXPERT_RUN=2,1,1 --env HF2Q_EXPERT_RUN=4,1,2}"
# wait-only programmatic launches in the graph (HF2Q_GRAPH_PDL=2: 1.02x in session 35, one run)
step pdl2-ab 300 "python3 bench/mlx_env_ab.py $OUT/pdl2_ab.json --step graph --format ${FORMAT:-q4_k} --shape ${SHAPE:-gemma4:26b-a4b} --rounds 7 --tokens 64 --time-cap 200 --env '' --env HF2Q_GRAPH_PDL=2"
step real-pair 300 "python3 bench/speculative.py real --k 2 4 --fixed --rounds 3 --json $OUT/spec_real.json"
# session 47: loads moved ahead of stores and barriers (same bits): the delta-net decode
# kernel's new conv state (HF2Q_GDN_PRELOAD=1; no faster on the H100, off) alone at 1 / 8 / 32
# rows; the GPU tests of it and of the MoE end's gate + residual + norm (HF2Q_GATE_NORM_EARLY; on
# with CUDA since: 1.03x on 35B-A3B, H100) with both on, and the tiny Qwen 3.5 graph steps'
# tokens (gdn-decode-tests); then 35B-A3B's graph decode against each flipped, 9B's (early-ab)
step gdn-decode-tests 240 "python3 bench/gdn_decode.py --json $OUT/gdn_decode.json && export HF2Q_GDN_PRELOAD=1 HF2Q_GATE_NORM_EARLY=1 && python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu' tests/kernels/test_gated_delta_decode.py --tb=short && python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and residual_norm' tests/kernels/test_sigmoid_gate.py --tb=short && python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_graph_step_gives and qwen3_5' tests/test_cuda_graph_step.py --tb=short"
step early-ab 300 "python3 bench/mlx_env_ab.py $OUT/early_ab_35b.json --step graph --format q4_k --shape qwen3_5:35b-a3b --rounds 5 --tokens 64 --time-cap 120 --env '' --env HF2Q_GDN_PRELOAD=1 --env HF2Q_GATE_NORM_EARLY=0 && python3 bench/mlx_env_ab.py $OUT/early_ab_9b.json --step graph --format q4_k --shape qwen3_5:9b --rounds 5 --tokens 64 --time-cap 90 --env '' --env HF2Q_GDN_PRELOAD=1"
# where a 512-token prefill's GPU time goes (CUPTI by kernel; session 46: 35B-A3B prefills at
# 0.57x llama.cpp CUDA, 9B 0.71x, 26B-A4B 0.83x on the same random-weight GGUFs)
step prefill-profile 300 "for sh in ${PREFILL_SHAPES:-qwen3_5:35b-a3b qwen3_5:9b gemma4:26b-a4b}; do python3 bench/decode_profile.py \$sh q4_k --step prefill --prompt ${PROMPT:-512} --steps 3 --json $OUT/prefill_profile_\${sh/:/_}.json | grep -v cuda_cache | head -24; done"
# the prefill's wide grouped kernels with launch bounds (HF2Q_GROUPED_WIDE_MIN_BLOCKS, session 47,
# unset: 172 registers, 10 SIMD groups an SM at the Q4_K gate/up): their GPU tests with it, then
# 512 / 2,048-token Q4_K prefills of both MoE shapes against the default (read per call: one
# process, interleaved rounds)
step wide-mb-ab 480 "HF2Q_GROUPED_WIDE_MIN_BLOCKS=${WIDE_MB:-8} python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and wide' tests/kernels/test_expert_prefill.py --tb=short; python3 bench/prefill.py $OUT/prefill_wide_mb.json --shapes ${PREFILL_SHAPES:-gemma4:26b-a4b,qwen3_5:35b-a3b} --formats q4_k --no-mlx-lm --rounds 3 --env HF2Q_GROUPED_WIDE_MIN_BLOCKS=${WIDE_MB:-8} --env HF2Q_GROUPED_WIDE_MIN_BLOCKS=6"

# Nsight Compute on one launch of the prefill's wide sorted grouped gate/up (512 tokens, one
# layer's routed experts, NCU_SHAPE) and of the delta-net decode kernel at one row (session 47:
# 0.22 TB/s and 25 TFLOPS; ~14 us a threadgroup wave): issue slots, stalls, memory traffic
step wide-ncu 200 "$NCU_RUN --kernel-name regex:${NCU_KERNEL:-grouped_glu_wide_sorted} --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis --section SchedulerStats python3 bench/moe_prefill.py --shapes ${NCU_SHAPE:-gemma4:26b-a4b} --paths grouped-wide --tokens 512 --rounds 1"
step gdn-ncu 150 "$NCU_RUN --kernel-name regex:gated_delta_decode --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis --section SchedulerStats python3 bench/gdn_decode.py --batch 1 --rounds 1 --chain 2 --no-cupti"

# HF2Q_MMA_XG (session 48): a block's x fragments for XG scale groups loaded before their mmas
# (the loop waited on each group's x loads in turn: 16 a Q4_K block at two n-tiles). Its GPU
# bits (wide / sorted prefill kernels at 16; every mat-vec and dense GLU type's load variants),
# then the 512 / 2,048-token prefills (read per call: one process, interleaved) and the graph
# decode (worker processes, interleaved rounds)
step xg-tests 300 "HF2Q_MMA_XG=16 python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu and (wide or sorted)' tests/kernels/test_expert_prefill.py --tb=short; r=\$?; python3 -m pytest -q -p no:cacheprovider -rf -k gpu_load_variants tests/kernels/test_qmatmul_mma.py tests/kernels/test_dense_glu_mma.py --tb=short || r=1; exit \$r"
step xg-prefill-ab 420 "python3 bench/prefill.py $OUT/prefill_xg.json --shapes ${PREFILL_SHAPES:-gemma4:26b-a4b,qwen3_5:35b-a3b} --formats q4_k --no-mlx-lm --rounds 3 --env HF2Q_MMA_XG=4 --env HF2Q_MMA_XG=16 ${XG_PREFILL_ENVS:-}"
step xg-graph-ab 480 "for sh in ${XG_SHAPES:-gemma4:31b gemma4:26b-a4b}; do python3 bench/mlx_env_ab.py $OUT/xg_graph_\${sh#*:}.json --step graph --format q4_k --shape \$sh --rounds 5 --tokens 64 --time-cap 150 --env '' ${XG_ENVS:---env HF2Q_MMA_XG=4} --env HF2Q_MMA_XG=16 2>&1 | tail -8; done"
# HF2Q_GDN_MIN_BLOCKS=2 (session 48): the delta-net decode kernel at 64 registers, two
# threadgroups an SM; the kernel alone at 1 / 8 / 32 rows (CUPTI, interleaved, bits checked)
step gdn-mb-ab 150 "python3 bench/gdn_decode.py --json $OUT/gdn_mb.json --rounds 5"
step gdn-mb-tests 240 "HF2Q_GDN_MIN_BLOCKS=2 python3 -m pytest -q -p no:cacheprovider -rf -k gpu tests/kernels/test_gated_delta_decode.py --tb=short"
# HF2Q_GDN_SCAN=1 (session 48): the chunked delta-net prefill's walk over chunks in one launch
# (gated_delta_scan; the MLX loop's four fp32 GEMMs a chunk otherwise). Its GPU tests and the
# chunked prefill's (with it on), then the Qwen 3.5 prefills A/B (read per call: one process)
step scan-tests 200 "HF2Q_GDN_SCAN=1 python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu' tests/kernels/test_gated_delta_scan.py tests/kernels/test_gated_delta.py --tb=short"
step scan-ab 360 "python3 bench/prefill.py $OUT/prefill_scan.json --shapes ${PREFILL_SHAPES:-qwen3_5:35b-a3b,qwen3_5:9b} --formats q4_k --no-mlx-lm --rounds 3 --env HF2Q_GDN_SCAN=1"
# HF2Q_TQ_TC=1 (session 49): TurboQuant flash-decode's partial kernel on tf32 mma, all of a KV
# head's query rows (up to 8) a threadgroup, 16 tokens a SIMD group step. Its GPU tests, the
# kernel against the scalar one at 26B-A4B's attention shapes (CUPTI, interleaved, outputs
# checked), then the whole 26B-A4B decode at 4K / 16K with it (TQ8e / TQ4e columns)
step tc-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k 'tensor_cores and gpu' tests/kernels/test_tq_kernels.py --tb=short"
step tc-sweep 200 "python3 bench/tq_sweep.py --tc --bits ${TQ_BITS:-8,4} --rounds 3 --json $OUT/tq_sweep_tc.json"
step tc-ncu 150 "$NCU_RUN --kernel-name regex:partial_tc --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section InstructionStats python3 bench/tq_sweep.py --tc --bits 8 --rounds 1 --chain 2 --only '${TQ_ONLY:-global 16K}'"
step tc-step 420 "$(tq_speed tq_tc_step 4096,16384 '--tq-env HF2Q_TQ_TC=1')"
# session 50: the mat-vec split over K (HF2Q_MMA_SPLIT_K, off): 31B's N = 5,376 grids run 1.27
# waves. GPU parity (KS 2 / 3, rows alone) and the graph step with it; the kernel sweep at the
# few-row shapes of 31B and 26B-A4B (Q4_K; Q5_0 where K is no multiple of 256); the whole graph
# decode against the default
step splitk-tests 300 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_split_k' tests/kernels/test_qmatmul_mma.py --tb=short; r=\$?; HF2Q_MMA_SPLIT_K=3 python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_graph_step_gives or gpu_stream_generate_graph' tests/test_cuda_graph_step.py --tb=short || r=1; exit \$r"
step splitk-sweep 300 "python3 bench/qmatmul.py $OUT/mma_splitk.json --mma --profile --types Q4_K --shapes 5376x21504,5376x8192,5376x16384,2816x4096,8192x2816 --mma-rows 1,8 --mma-configs 2x8k2,2x8k3,2x8k4,1x8k3,2x4k3,2x4 && python3 bench/qmatmul.py $OUT/mma_splitk_q5.json --mma --profile --types Q5_0 --shapes 2816x2112 --mma-rows 1,8 --mma-configs 2x8k2,2x8k3"
step splitk-ab 480 "for sh in ${SPLITK_SHAPES:-gemma4:31b gemma4:26b-a4b}; do python3 bench/mlx_env_ab.py $OUT/splitk_\${sh#*:}.json --step graph --format q4_k --shape \$sh --rounds 5 --tokens 64 --time-cap 200 --env '' --env HF2Q_MMA_SPLIT_K=2 --env HF2Q_MMA_SPLIT_K=3 2>&1 | tail -8; done"
# session 50: one abort on the engine thread in test_gpu_engine_graph_equals_compiled (1 of 4
# complete runs; docs/kernel_notes.md, session 50): the test alone, again and again
step engine-abort 300 "for i in 1 2 3 4 5 6; do echo == run \$i >> $OUT/engine_abort_runs.txt; PYTHONFAULTHANDLER=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -rf -k gpu_engine_graph_equals_compiled tests/test_cuda_graph_step.py --tb=short >> $OUT/engine_abort_runs.txt 2>&1; echo run \$i rc=\$?; done"
# session 51: the split over K is the default on 31B's o / down (K >= 8,192, one to two waves);
# 9B's down (256 tiles) stays unsplit: its graph decode with the split forced, against the default
step splitk-9b 200 "python3 bench/mlx_env_ab.py $OUT/splitk_9b.json --step graph --format q4_k --shape qwen3_5:9b --rounds 5 --tokens 64 --time-cap 150 --env '' --env HF2Q_MMA_SPLIT_K=2"
# session 51: paired rows (HF2Q_MMA_PAIRS, off; config R = 2): 16 rows of each half of the weight a
# threadgroup, the dense GLU's two row sets without the activation (same bits as unpaired). GPU
# bits against the unpaired kernel, the graph step with it; the kernel sweep at the dense
# shapes (31B, 9B, 26B-A4B); the whole graph decode against the default
step pair-tests 240 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_paired' tests/kernels/test_qmatmul_mma.py --tb=short; r=\$?; HF2Q_MMA_PAIRS=1 python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_graph_step_gives or gpu_stream_generate_graph' tests/test_cuda_graph_step.py --tb=short || r=1; exit \$r"
step pair-sweep 300 "python3 bench/qmatmul.py $OUT/mma_pairs.json --mma --profile --types Q4_K --shapes ${PAIR_SHAPES:-16384x5376,5376x21504,5376x8192,4096x12288,12288x4096,2816x4096,8192x2816} --mma-rows 1,8 --mma-configs ${PAIR_CONFIGS:-1x4r,1x8r,2x8r,1x4k2r,1x4k3r,1x4k4r,1x8k2r}"
step pair-ab 480 "for sh in ${PAIR_AB_SHAPES:-gemma4:31b qwen3_5:9b gemma4:26b-a4b}; do python3 bench/mlx_env_ab.py $OUT/pairs_\${sh#*:}.json --step graph --format q4_k --shape \$sh --rounds 5 --tokens 64 --time-cap 140 --env '' --env HF2Q_MMA_PAIRS=1 2>&1 | tail -6; done"
# session 51: the split's sum fused into its last threadgroup (HF2Q_MMA_SPLIT_FUSED, off): GPU bits
# against the two launches call after call (counters back at zero), the graph step with it at
# KS 3; then 31B's graph decode (split by default) with and without it
step fused-tests 240 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_fused_split' tests/kernels/test_qmatmul_mma.py --tb=short; r=\$?; HF2Q_MMA_SPLIT_K=3 HF2Q_MMA_SPLIT_FUSED=1 python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_graph_step_gives or gpu_stream_generate_graph' tests/test_cuda_graph_step.py --tb=short || r=1; exit \$r"
step fused-ab 240 "python3 bench/mlx_env_ab.py $OUT/split_fused_31b.json --step graph --format q4_k --shape gemma4:31b --rounds 7 --tokens 64 --time-cap 180 --env '' --env HF2Q_MMA_SPLIT_FUSED=1 2>&1 | tail -6"

# session 52: the decode attention's load variants (HF2Q_ATTN_LOADS: "v" a lane's elements
# contiguous, 16-byte loads; "p" two slots in flight, same bits) and its mapping at 1 and 32
# rows (session 51: 26B-A4B's 32-row step spent 6.9 of 18.6 ms in attention, 234 us a sliding
# call at ~0.3 TB/s): GPU bits, then the sweep with CUPTI
step attn-loads-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_load_variants or gpu_rows_bit_identical or gpu_kernel_matches' tests/kernels/test_decode_attention.py --tb=short"
step attn-sweep 300 "python3 bench/attention_sweep.py --json $OUT/attention_sweep.json --batch ${ATTN_BATCH:-1 32} --loads '' v p vp --mappings '${ATTN_MAPPINGS:-4,8 8,4 4,4 2,8 8,8 2,16 1,16}' --shapes '${ATTN_SHAPES:-step 544}' --rounds 5 --chain 16 --profile"
# then the whole model with a pick (ATTN_ENVS: mlx_env_ab --env values, e.g.
# "HF2Q_ATTN_LOADS=vp HF2Q_ATTN_LOADS=vp,HF2Q_ATTN_SPLIT=4,8"): 26B-A4B's graph decode at one
# row, and the 32-row compiled step's profile (attention calls and ms a token)
step attn-ab 300 "python3 bench/mlx_env_ab.py $OUT/attn_ab.json --step graph --format q4_k --shape ${SHAPE:-gemma4:26b-a4b} --rounds 5 --tokens 64 --time-cap 240 --env '' \$(for e in ${ATTN_ENVS:-HF2Q_ATTN_LOADS=vp}; do echo --env \$e; done) 2>&1 | tail -6"
step attn-b32 300 "i=0; for e in default ${ATTN_ENVS:-HF2Q_ATTN_LOADS=vp}; do echo == \$e; env \$( [ \$e = default ] || echo \$e | sed 's/,HF2Q/ HF2Q/g' ) python3 bench/decode_profile.py ${SHAPE:-gemma4:26b-a4b} q4_k --step compiled --batch 32 --steps 16 --json $OUT/profile_b32_attn\$i.json | grep -a 'ms/token\\|decode_attention'; i=\$((i+1)); done"
# virtual SIMD groups in the decode attention at many rows (HF2Q_ATTN_VW): GPU bits against
# VW 1 and the reference; ATTN_ENVS="HF2Q_ATTN_VW=1 ..." setup attn-b32 for the 32-row step
step attn-vw-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_virtual or gpu_rows_bit_identical or gpu_kernel_matches or gpu_split_rows' tests/kernels/test_decode_attention.py --tb=short"
# the delta-net decode's state streamed at many rows (HF2Q_GDN_STREAM): GPU bits, then the kernel
# alone at 1 / 8 / 32 rows against the register path (bench/gdn_decode.py variants)
step gdn-stream-tests 150 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_streamed or gpu_kernel_matches or gpu_block_decode' tests/kernels/test_gated_delta_decode.py --tb=short"
step gdn-stream 150 "python3 bench/gdn_decode.py --json $OUT/gdn_stream.json --rounds 5"
# paired rows at 17..32 rows of x only, at the unpaired U / W (HF2Q_MMA_PAIRS=2: the same bits):
# the 32-row step's tensor-core mat-vecs with and without (SHAPES: the models)
step pairs-b32 300 "for sh in ${SHAPES:-qwen3_5:35b-a3b gemma4:26b-a4b}; do for v in 0 2; do echo == \$sh HF2Q_MMA_PAIRS=\$v; HF2Q_MMA_PAIRS=\$v python3 bench/decode_profile.py \$sh q4_k --step compiled --batch 32 --steps 16 --by-launch --json $OUT/profile_b32_pairs\${v}_\${sh#*:}.json | grep -a 'ms/token\\|qmv_mma\\|dense_glu'; done; done"
# the mat-vec's columns split over threadgroups (HF2Q_MMA_COLUMN_TILES, config CS: the same
# bits): its GPU bits, then the 32-row step's kernels by launch with 4 (unset) and 1 n-tile a
# threadgroup (SHAPES: the models; COLUMN_BATCH: the step's rows)
step columns-tests 200 "python3 -m pytest -q -p no:cacheprovider -rf -k 'gpu_column or (gpu_matches_reference and Q4_K)' tests/kernels/test_qmatmul_mma.py tests/kernels/test_dense_glu_mma.py --tb=short"
step columns-b32 300 "for sh in ${SHAPES:-qwen3_5:35b-a3b gemma4:26b-a4b}; do for v in ${COLUMN_VALUES:-4 1}; do echo == \$sh HF2Q_MMA_COLUMN_TILES=\$v; HF2Q_MMA_COLUMN_TILES=\$v python3 bench/decode_profile.py \$sh q4_k --step compiled --batch ${COLUMN_BATCH:-32} --steps 16 --by-launch --json $OUT/profile_b${COLUMN_BATCH:-32}_columns\${v}_\${sh#*:}.json | grep -a 'ms/token\\|qmv_mma\\|dense_glu'; done; done"
if [ "${1:-list}" = list ]; then
  for s in "${ORDER[@]}"; do printf '%-18s %4ss  %s\n' "$s" "${CAP[$s]}" "${CMD[$s]}"; done
  exit 0
fi
rc=0
for s in "$@"; do
  if [ -z "${CMD[$s]+x}" ]; then echo "unknown step: $s (bash bench/h200_steps.sh list)"; exit 2; fi
  echo "== $s (cap ${CAP[$s]} s) $(date -u +%H:%M:%S)" | tee -a "$OUT/steps.log"
  # grep --line-buffered: a step cut by its cap keeps what it printed (session 22 lost a whole
  # gpu-sample log in grep's pipe buffer)
  timeout "${CAP[$s]}" bash -c "${CMD[$s]}" 2>&1 | grep --line-buffered -v -i warning | tee "$OUT/$s.log" | tail -40
  code=${PIPESTATUS[0]}
  echo "== $s rc=$code $(date -u +%H:%M:%S)" | tee -a "$OUT/steps.log"
  [ "$code" = 0 ] || rc=$code
done
exit $rc
