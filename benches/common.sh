# Sourced by the benchmark scripts (benches/*.sh): works from the repository root, with the
# binary `$bin` ($STARCKPT_BIN, else a release build, made if missing), a scratch directory `$work`
# and `pids`, the background processes the script starts, which `stop_started` kills and reaps.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=${STARCKPT_BIN:-target/release/starckpt}
[ -x "$bin" ] || cargo build --release -q -p starckpt
work=$(mktemp -d)
pids=()
stop_started() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
