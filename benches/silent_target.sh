#!/usr/bin/env bash
# A storage host that stops answering, against all answering, in one run on one cluster.
#
#   benches/silent_target.sh [SIZE_MIB] [ROUNDS] [STOP_AFTER_SECS]   (defaults: 512, 2, 0.3)
#
# A control plane and three targets serving TCP only (as separate hosts would), each its own
# process, default flags (two copies of every chunk). Each round saves a fresh random file of
# SIZE_MIB with all three targets answering, and restores it; then saves another while one
# target is SIGSTOPped STOP_AFTER_SECS into the save (its sockets stay open, its kernel still
# accepts connections: a hung host), and restores the first with that target still stopped,
# comparing the bytes. The stopped target is continued before the next round. Times are from
# the command's start to its exit (committed; restored and verified).
set -euo pipefail
size=${1:-512}
rounds=${2:-2}
stop_after=${3:-0.3}
source "$(dirname "$0")/common.sh"
cleanup() {
    for pid in "${pids[@]}"; do kill -CONT "$pid" 2>/dev/null || true; done
    stop_started
    rm -rf "$work"
}
trap cleanup EXIT

# Processes of one cluster share a cluster key (targets accept only what the control plane signed).
head -c 32 /dev/urandom > "$work/cluster.key"
chmod 600 "$work/cluster.key"
export STARCKPT_CLUSTER_KEY_FILE="$work/cluster.key"
"$bin" server --listen 127.0.0.1:0 --db "$work/meta.db" > "$work/server.out" 2> "$work/server.log" &
pids+=($!)
for _ in $(seq 100); do grep -q "listening on" "$work/server.out" 2>/dev/null && break; sleep 0.1; done
export STARCKPT_SERVER=$(awk '{print $NF; exit}' "$work/server.out")
targets=()
for i in 0 1 2; do
    mkdir -p "$work/t$i"
    "$bin" target --dir "$work/t$i" --listen 127.0.0.1:0 --server "$STARCKPT_SERVER" --no-shm --queue-depth 8 \
        > "$work/t$i.out" 2> "$work/t$i.log" &
    pids+=($!)
    targets+=($!)
done
for _ in $(seq 100); do
    [ "$("$bin" --json status | grep -o '"state":"alive"' | wc -l)" -ge 3 ] && break
    sleep 0.1
done

now() { date +%s.%N; }
secs() { printf '%.2f' "$(echo "$2 - $1" | bc -l)"; }
printf '%-6s %-22s %-22s %-22s %-22s\n' round "save, all answering" "save, one stopped" \
    "restore, all answering" "restore, one stopped"
step=0
for round in $(seq "$rounds"); do
    mkdir -p "$work/a" "$work/b"
    head -c "${size}M" /dev/urandom > "$work/a/state.bin"
    head -c "${size}M" /dev/urandom > "$work/b/state.bin"
    stopped=${targets[$(((round - 1) % 3))]}

    step=$((step + 1)); first=$step
    t0=$(now); "$bin" save --job bench-silent --step "$first" "$work/a" > /dev/null; save_all=$(secs "$t0" "$(now)")
    t0=$(now); "$bin" restore --job bench-silent --step "$first" --to "$work/r1" > /dev/null
    restore_all=$(secs "$t0" "$(now)")
    rm -rf "$work/r1"

    step=$((step + 1))
    (sleep "$stop_after"; kill -STOP "$stopped") &
    t0=$(now); "$bin" save --job bench-silent --step "$step" "$work/b" > /dev/null 2> "$work/save.log"
    save_stopped=$(secs "$t0" "$(now)")
    wait $!
    t0=$(now); "$bin" restore --job bench-silent --step "$first" --to "$work/r2" > /dev/null 2> "$work/restore.log"
    restore_stopped=$(secs "$t0" "$(now)")
    cmp -s "$work/r2/state.bin" "$work/a/state.bin" || { echo "restored bytes differ" >&2; exit 1; }
    rm -rf "$work/r2"
    kill -CONT "$stopped"
    printf '%-6s %-22s %-22s %-22s %-22s\n' "$round" "${save_all} s" "${save_stopped} s" "${restore_all} s" \
        "${restore_stopped} s"
done
