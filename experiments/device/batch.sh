#!/usr/bin/env bash
# A batch of experiment runs on a lent GPU machine that outlives one call (each call is at most 10 minutes; the
# machine stays warm 30 s after a call, so the next call must follow at once).
#
#   experiments/device/batch.sh start DIR MINUTES PLAN [PLAN...] [batch.py run args...]
#       start experiments/batch.py in its own session (setsid: it survives the call), writing to DIR; several
#       plans run as one batch (their runs share the card's slots)
#   experiments/device/batch.sh watch DIR SECONDS
#       print the batch's progress every 30 s for up to SECONDS (less if it ends), then pack its results without
#       checkpoints into $OUT/results.tgz with its log: every call leaves what the batch has so far
#
# Both expect prepare.sh's PYTHONPATH ($PWD:/tmp/site) exported.
set -uo pipefail
what=${1:?start or watch}
dir=${2:?the batch directory}
case "$what" in
  start)
    minutes=${3:?minutes}; : "${4:?plan}"; shift 3
    plans=()
    while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do plans+=("$1"); shift; done
    mkdir -p "$dir"
    setsid nohup python3 experiments/batch.py run "${plans[@]}" --out "$dir" --minutes "$minutes" "$@" \
      > "$dir/batch.log" 2>&1 < /dev/null &
    echo "started batch of ${plans[*]} in $dir (pid $!)"
    ;;
  watch)
    seconds=${3:?seconds}; end=$((SECONDS + seconds))
    while [ "$SECONDS" -lt "$end" ]; do
      python3 experiments/batch.py progress "$dir" | head -1
      grep -q '^finished:' "$dir/batch.log" 2>/dev/null && break
      sleep 30
    done
    python3 experiments/batch.py progress "$dir"
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader || true
    uptime
    tail -3 "$dir/batch.log"
    python3 experiments/batch.py pack "$dir" "$OUT/results.tgz" && cp "$dir/batch.log" "$OUT/"
    ls -la "$OUT"
    ;;
  *) echo "usage: $0 start DIR MINUTES PLAN [args] | watch DIR SECONDS" >&2; exit 2 ;;
esac
