#!/usr/bin/env bash
# A restore whose chunks every target lost, brought back through the control plane from a
# directory tier, against a restore of the same checkpoint with its copies on the targets.
#
#   benches/restore_from_tier.sh [SIZE_MIB] [ROUNDS]      (defaults: 256 MiB, 3 rounds)
#
# A control plane (tier file://, background passes off) and 2 targets, as separate processes.
# One checkpoint of SIZE_MIB random bytes is saved (2 copies per chunk) and tiered. Each round:
# a restore with the copies on the targets (the baseline), then every target is killed, its chunk
# files deleted, and restarted, and a restore is timed while the control plane recovers each
# chunk from the tier onto the targets as the reader asks (`RecoverChunks`: client/src/recovery.rs,
# server/src/control/repair.rs). Prints one line per round and one JSON line with the medians.
set -euo pipefail
size=${1:-256}
rounds=${2:-3}
source "$(dirname "$0")/common.sh"
cleanup() {
    stop_started
    rm -rf "$work"
}
trap cleanup EXIT
head -c 32 /dev/urandom > "$work/cluster.key"
export STARCKPT_CLUSTER_KEY_FILE="$work/cluster.key"

# Starts `starckpt ARGS` in the background; echoes its address once it prints it.
start() {
    local log=$1; shift
    "$bin" "$@" > "$log.out" 2> "$log.log" &
    pids+=($!)
    for _ in $(seq 200); do grep -q "listening on" "$log.out" 2>/dev/null && break; sleep 0.05; done
    sed -n 's/.*listening on //p' "$log.out"
}
export STARCKPT_SERVER
STARCKPT_SERVER=$(start "$work/server" server --listen 127.0.0.1:0 --db "$work/meta.db" --tier "file://$work/tier" \
    --tier-interval-secs 0 --repair-interval-secs 0)
target_pids=()
start_targets() {
    target_pids=()
    for i in 0 1; do
        start "$work/target-$i" target --dir "$work/target-$i" --listen 127.0.0.1:0 --queue-depth 8 > /dev/null
        target_pids+=("${pids[-1]}")
    done
    for _ in $(seq 200); do
        [ "$("$bin" status --json | grep -o '"alive"' | wc -l)" -ge 2 ] && return
        sleep 0.1
    done
    echo "targets did not come alive" >&2
    exit 1
}
start_targets
head -c "${size}M" /dev/urandom > "$work/state.bin"
"$bin" save --job bench --step 1 "$work/state.bin" > /dev/null
"$bin" tier > /dev/null

now() { date +%s.%N; }
timed_restore() {
    rm -rf "$work/restored"
    local t0; t0=$(now)
    "$bin" restore --job bench --latest --to "$work/restored" > /dev/null 2>&1
    echo "$(now) - $t0" | bc -l
}
declare -a present lost
for round in $(seq "$rounds"); do
    present+=("$(timed_restore)")
    cmp -s "$work/state.bin" "$work/restored/state.bin" || { echo "restore differs" >&2; exit 1; }
    for pid in "${target_pids[@]}"; do kill -9 "$pid"; done
    wait "${target_pids[@]}" 2>/dev/null || true
    find "$work"/target-*/chunks -type f -delete
    start_targets
    lost+=("$(timed_restore)")
    cmp -s "$work/state.bin" "$work/restored/state.bin" || { echo "restore differs" >&2; exit 1; }
    printf 'round %d: restore %6.2fs with copies on the targets, %6.2fs with every copy lost (from the tier): %.2fx\n' \
        "$round" "${present[-1]}" "${lost[-1]}" "$(echo "${lost[-1]} / ${present[-1]}" | bc -l)"
done
median() { printf '%s\n' "$@" | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
p=$(median "${present[@]}"); l=$(median "${lost[@]}")
printf '{"size_mib": %d, "rounds": %d, "restore_s": %.3f, "restore_from_tier_s": %.3f, "from_tier_mib_per_s": %.1f, "ratio": %.2f}\n' \
    "$size" "$rounds" "$p" "$l" "$(echo "$size / $l" | bc -l)" "$(echo "$l / $p" | bc -l)"
