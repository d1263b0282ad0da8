#!/usr/bin/env bash
# CPU side by side, interleaved rounds: llama.cpp `llama-bench -t 2` (pp512, tg64 from an empty
# context and at depth 512) and ours at the defaults (`hf2q-mlx bench`: a 16-token prompt for the
# empty-context decode, then 512 tokens) on the same GGUFs.
#
#   bash bench/cpu_vs_llama.sh PEER_DIR ROUNDS GGUF [GGUF ...]
#
# PEER_DIR: where ../shared/peers/llama-cpu-x86_64.tar.xz was unpacked (it holds bin/llama-bench).
set -u
peer=$1 rounds=$2
shift 2
for round in $(seq 1 "$rounds"); do
  for m in "$@"; do
    echo "== $(basename "$m") round $round $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd "$peer" && LD_LIBRARY_PATH=bin bin/llama-bench -m "$m" -t 2 -p 512 -n 64 2>/dev/null |
      grep -E "pp512|tg64" | awk -F'|' '{print "llama.cpp", $7, $8}')
    (cd "$peer" && LD_LIBRARY_PATH=bin bin/llama-bench -m "$m" -t 2 -p 0 -n 64 -d 512 2>/dev/null |
      grep -E "tg64" | awk -F'|' '{print "llama.cpp @512", $7, $8}')
    echo "ours p16:  $(python3 -m hf2q_mlx bench --model "$m" --prompt-tokens 16 --gen-tokens 64 \
      --quiet 2>&1 | grep -E 'decode_tps' | tr '\n' ' ')"
    echo "ours p512: $(python3 -m hf2q_mlx bench --model "$m" --prompt-tokens 512 --gen-tokens 64 \
      --quiet 2>&1 | grep -E 'prompt_tps|decode_tps' | tr '\n' ' ')"
  done
done
