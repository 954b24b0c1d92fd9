#!/usr/bin/env bash
# FUSE mount against the SDK, side by side, on the same cluster, disk and data size.
#
#   benches/fuse_vs_sdk.sh [SIZE_MIB] [ROUNDS]      (defaults: 1024 MiB, 2 rounds; needs root)
#
# Write: the SDK (`starckpt save FILE`) and the mount (`dd FILE -> /ckpt/job/x.tmp/`, then `mv`
# to commit) each store a distinct random file of SIZE_MIB (distinct, so neither deduplicates),
# timed from start to committed. Read: the SDK (`starckpt cat`, verified, to /dev/null) and the
# mount (`dd` of the committed file to /dev/null, first read, no page cache) each read a file of
# that size. Source files sit in the page cache, so both sides read them at memory speed.
# Rounds alternate which side goes first. Prints a table, then one JSON line with the medians.
#
# The mount's request size is capped by /proc/sys/fs/fuse/max_pages_limit (256 pages = 1 MiB by
# default); the script raises it to 4096 (16 MiB requests) for the run and restores it after.
set -euo pipefail
size=${1:-1024}
rounds=${2:-2}
source "$(dirname "$0")/common.sh"
limit_file=/proc/sys/fs/fuse/max_pages_limit
old_limit=$(cat "$limit_file" 2>/dev/null || echo "")
cleanup() {
    umount -l "$work/ckpt" 2>/dev/null || true
    stop_started
    [ -n "$old_limit" ] && echo "$old_limit" > "$limit_file" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
[ -w "$limit_file" ] && echo 4096 > "$limit_file"

# The cluster, on a free port, and the mount.
"$bin" dev --data "$work/data" --listen 127.0.0.1:0 --targets 3 > "$work/dev.out" 2> "$work/dev.log" &
pids+=($!)
for _ in $(seq 100); do grep -q "export STARCKPT_SERVER" "$work/dev.out" 2>/dev/null && break; sleep 0.1; done
export STARCKPT_SERVER=$(sed -n 's/.*export STARCKPT_SERVER=//p' "$work/dev.out")
mkdir -p "$work/ckpt"
"$bin" mount "$work/ckpt" > "$work/mount.out" 2> "$work/mount.log" &
pids+=($!)
for _ in $(seq 100); do grep -q "mounted at" "$work/mount.out" 2>/dev/null && break; sleep 0.1; done
# One job per side: each writer takes its job's lease, and a CLI save is a new run each time.
mkdir "$work/ckpt/bench-fuse"

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }
rate() { echo "$size / 1024 / $1" | bc -l; }
declare -a sdk_w fuse_w sdk_r fuse_r
step=0
for round in $(seq "$rounds"); do
    head -c "${size}M" /dev/urandom > "$work/a.bin"
    head -c "${size}M" /dev/urandom > "$work/b.bin"
    sdk_write() {
        step=$((step + 1)); sdk_step=$step
        local t0; t0=$(now)
        "$bin" save --job bench-sdk --step "$sdk_step" "$work/a.bin" > /dev/null
        sdk_w+=("$(secs "$t0" "$(now)")")
    }
    fuse_write() {
        step=$((step + 1)); fuse_step=$step
        local t0; t0=$(now)
        mkdir "$work/ckpt/bench-fuse/w.tmp"
        dd if="$work/b.bin" of="$work/ckpt/bench-fuse/w.tmp/b.bin" bs=16M status=none
        mv "$work/ckpt/bench-fuse/w.tmp" "$work/ckpt/bench-fuse/step_$fuse_step"
        fuse_w+=("$(secs "$t0" "$(now)")")
    }
    # Each side reads the file the other side wrote: neither was just written by its reader.
    sdk_read() {
        local t0; t0=$(now)
        "$bin" cat bench-fuse "$fuse_step" b.bin > /dev/null
        sdk_r+=("$(secs "$t0" "$(now)")")
    }
    fuse_read() {
        local t0; t0=$(now)
        dd if="$work/ckpt/bench-sdk/$sdk_step/a.bin" of=/dev/null bs=16M status=none
        fuse_r+=("$(secs "$t0" "$(now)")")
    }
    # `sync` before each timed phase: the page cache's writeback of the source files must not
    # land on the disk in the middle of one side's run.
    if [ $((round % 2)) -eq 1 ]; then sync; sdk_write; sync; fuse_write; sync; sdk_read; sync; fuse_read
    else sync; fuse_write; sync; sdk_write; sync; fuse_read; sync; sdk_read; fi
    rm -f "$work/a.bin" "$work/b.bin"
done

median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
sw=$(median "${sdk_w[@]}"); fw=$(median "${fuse_w[@]}"); sr=$(median "${sdk_r[@]}"); fr=$(median "${fuse_r[@]}")
printf '%-7s %12s %12s %10s %8s\n' "" "SDK" "FUSE" "FUSE/SDK" "target"
printf '%-7s %9.2f GiB/s %9.2f GiB/s %10.2f %8s\n' write "$(rate "$sw")" "$(rate "$fw")" "$(echo "$sw / $fw" | bc -l)" ">= 0.7"
printf '%-7s %9.2f GiB/s %9.2f GiB/s %10.2f %8s\n' read "$(rate "$sr")" "$(rate "$fr")" "$(echo "$sr / $fr" | bc -l)" ">= 0.8"
echo "max_pages_limit $(cat "$limit_file" 2>/dev/null || echo '?'); $rounds rounds of $size MiB; times in seconds: sdk_write ${sdk_w[*]} fuse_write ${fuse_w[*]} sdk_read ${sdk_r[*]} fuse_read ${fuse_r[*]}"
printf '{"size_mib":%s,"rounds":%s,"sdk_write_s":%s,"fuse_write_s":%s,"sdk_read_s":%s,"fuse_read_s":%s,"write_ratio":%.3f,"read_ratio":%.3f}\n' \
    "$size" "$rounds" "$sw" "$fw" "$sr" "$fr" "$(echo "$sw / $fw" | bc -l)" "$(echo "$sr / $fr" | bc -l)"
