#!/usr/bin/env bash
# `starckpt save DIR` against `dd oflag=direct` of the same bytes to the same disk.
#
#   benches/save_vs_dd.sh [SIZE_MIB] [ROUNDS]      (defaults: 1024 MiB, 3 rounds)
#
# One target (`starckpt dev --targets 1`: one copy of every chunk, over shared memory), its data
# on the disk `$TMPDIR` is on. Each round writes SIZE_MIB of fresh random bytes as 8 files (in the
# page cache, as a trainer's output just written is), then times, in this order: `dd` writing
# the same number of bytes with O_DIRECT to the same disk; `starckpt save --job j --step N DIR`
# (start to committed); and the same directory saved again at step N+1 (every chunk already
# stored). Prints a table, then one JSON line with the medians: save's throughput over dd's, and
# the re-save's time over the first save's.
set -euo pipefail
size=${1:-1024}
rounds=${2:-3}
source "$(dirname "$0")/common.sh"
cleanup() {
    stop_started
    rm -rf "$work"
}
trap cleanup EXIT

"$bin" dev --data "$work/data" --listen 127.0.0.1:0 --targets 1 > "$work/dev.out" 2> "$work/dev.log" &
pids+=($!)
for _ in $(seq 100); do grep -q "export STARCKPT_SERVER" "$work/dev.out" 2>/dev/null && break; sleep 0.1; done
export STARCKPT_SERVER=$(sed -n 's/.*export STARCKPT_SERVER=//p' "$work/dev.out")

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
declare -a dd_s save_s again_s ratio resave
step=0
per_file=$((size / 8))
printf '%-6s %10s %10s %10s %14s %12s\n' round dd_s save_s resave_s save/dd_rate resave/save
for round in $(seq "$rounds"); do
    rm -rf "$work/src" && mkdir "$work/src"
    for i in $(seq 8); do head -c "${per_file}M" /dev/urandom > "$work/src/f$i.bin"; done
    t0=$(now)
    dd if=/dev/zero of="$work/data/dd.bin" bs=16M count=$((size / 16)) oflag=direct status=none
    dd_s+=("$(secs "$t0" "$(now)")")
    rm -f "$work/data/dd.bin"
    step=$((step + 1))
    t0=$(now)
    "$bin" save --job j --step "$step" "$work/src" > /dev/null
    save_s+=("$(secs "$t0" "$(now)")")
    step=$((step + 1))
    t0=$(now)
    "$bin" save --job j --step "$step" "$work/src" > /dev/null
    again_s+=("$(secs "$t0" "$(now)")")
    i=$((round - 1))
    ratio+=("$(echo "${dd_s[$i]} / ${save_s[$i]}" | bc -l)")
    resave+=("$(echo "${again_s[$i]} / ${save_s[$i]}" | bc -l)")
    printf '%-6s %10.3f %10.3f %10.3f %14.2f %12.2f\n' "$round" "${dd_s[$i]}" "${save_s[$i]}" "${again_s[$i]}" \
        "${ratio[$i]}" "${resave[$i]}"
done
printf '{"size_mib": %s, "rounds": %s, "save_over_dd_throughput": %.3f, "resave_over_save_time": %.3f}\n' \
    "$size" "$rounds" "$(median "${ratio[@]}")" "$(median "${resave[@]}")"
