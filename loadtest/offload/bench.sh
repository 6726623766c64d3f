#!/usr/bin/env bash
# Checkpoint offload benchmark (issue 17 item 2): a run writes each step to node-local NVMe,
# one part per node, and commits it there; each node's agent offloads its part to the hot tier
# in the background (retention.toml's `[offload]`, the default policies' tier), verified. Three
# figures per step, against a plain copy of the same bytes in the same run:
#
#   - the training-visible commit: the wall time of `stagehand checkpoint commit --tier local`
#     (the slowest of the PARTS nodes' commits, run at once) — what a training loop waits for;
#   - the offload rate: the step's bytes ÷ the time from the first commit to the step listed
#     `committed` (every part copied to hot and verified, the step made the run's latest),
#     beside `cp -r` of the same parts' bytes to the hot tier's filesystem and `sync -f`
#     (a copy made as durable as the offload's, with no hashing);
#   - the node-freed rate: the step's bytes ÷ the time from the first commit to every part gone
#     from its node (with `verify = "hashed-in-flight"`, as shipped, each agent first reads its
#     part's copy back from hot and hashes it: the node's part goes only once its copy is
#     proven on the media).
#
# Runs alternate offload then plain copy, PAIRS times (at least 3), each from the same start
# state: the parts written afresh just before (warm in the page cache), nothing of them on
# hot. The table gives medians and the median of the per-pair rate ratios (offload ÷ cp).
# Every node's agent runs on this machine, its own local root on the one disk the hot tier is
# on too: the offload reads and writes the same disk and hashes on the same cores as the
# plain copy.
#
#   loadtest/offload/bench.sh                          # 4 parts × 1 GiB
#   PART_MIB=64 PROFILE=dev loadtest/offload/bench.sh  # a quick run
#
# Settings (environment): PARTS (4), PART_MIB (1024), PAIRS (3), PROFILE (release | dev),
# VERIFY (the offload's verification, retention.toml's `[offload] verify`: hashed-in-flight as
# shipped, or read-back), BENCH_DIR (where the home goes; default a temp folder; deleted at the
# end), STAGEHAND_NATS_SERVER. Needs python3, bc. The stack is started as `stack.sh` says.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
PARTS=${PARTS:-4}
PART_MIB=${PART_MIB:-1024}
PAIRS=${PAIRS:-3}
PROFILE=${PROFILE:-release}
PROJECT=bench
RUN_NAME=offload

for tool in python3 bc; do
    command -v "$tool" >/dev/null || { echo "bench.sh needs $tool" >&2; exit 1; }
done
[ "$PAIRS" -ge 3 ] || { echo "bench.sh: PAIRS is at least 3" >&2; exit 1; }
unset STAGEHAND_HOME
# shellcheck source=loadtest/stack.sh
. "$REPO/loadtest/stack.sh"
build_bins

WORK=$(mktemp -d "${BENCH_DIR:-${TMPDIR:-/tmp}}/stagehand-offload-bench.XXXXXX")
HOME_DIR=$WORK/home
cleanup() {
    stop_stack
    rm -rf "$WORK"
}
trap cleanup EXIT

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }

echo "load: $(uptime | sed 's/.*load average/load average/')   cores: $(nproc)   profile: $PROFILE" >&2
start_stack 127.0.0.1 "$HOME_DIR"
POLICIES=$HOME_DIR/policies
HOT=$HOME_DIR/tiers/hot
# The agents' policies are copies of these, made as each starts (write_agent_config).
if [ -n "${VERIFY:-}" ]; then
    grep -q '^verify = ' "$POLICIES/retention.toml" || { echo "bench.sh: retention.toml has no [offload] verify line" >&2; exit 1; }
    sed -i "s/^verify = .*/verify = \"$VERIFY\"/" "$POLICIES/retention.toml"
fi
VERIFY=$(sed -n 's/^verify = "\(.*\)"/\1/p' "$POLICIES/retention.toml")
[ -n "$VERIFY" ] || { echo "bench.sh: retention.toml has no [offload] verify line" >&2; exit 1; }
export STAGEHAND_PROJECT=$PROJECT

# The agent of each node, on this host, its own local root and policies.
for i in $(seq 0 $((PARTS - 1))); do
    dir=$WORK/agents/n$i
    metrics=127.0.0.1:$(free_port)
    write_agent_config "n$i" "$dir" "$HOME_DIR" "$metrics"
    env -u STAGEHAND_NATS_URL "$BIN/stagehand-promoter" --config "$dir/promoter.toml" 2>"$dir/stderr.log" &
    AGENT_PIDS+=($!)
    wait_ready "$metrics" "$dir/stderr.log"
done

# The folder of part $2 of step $1 on its node's local tier, as the layout names it.
part_dir() { echo "$HOME_DIR/tiers/local-n$2/$PROJECT/ckpt-$RUN_NAME/step-$1/part-$2"; }
# Writes the parts of step $1 (a torch.distributed.checkpoint shard each, .metadata last).
write_parts() {
    local step=$1 i d
    for i in $(seq 0 $((PARTS - 1))); do
        d=$(part_dir "$step" "$i")
        mkdir -p "$d"
        head -c $((PART_MIB << 20)) /dev/urandom >"$d/__${i}_0.distcp"
        echo "step $step part $i" >"$d/.metadata"
    done
}
# The bytes of a step's parts, as written.
step_bytes() { du -sb --apparent-size "$@" | awk '{n += $1} END {printf "%.0f\n", n}'; }

RESULTS=$WORK/results.jsonl
: >"$RESULTS"
STEP=0

run_offload() {
    STEP=$((STEP + 1))
    local step=$STEP i pids=() t0 t1 slowest=0 bytes
    write_parts "$step"
    sync
    bytes=$(step_bytes "$HOME_DIR"/tiers/local-n*/"$PROJECT/ckpt-$RUN_NAME/step-$step")
    t0=$(now)
    for i in $(seq 0 $((PARTS - 1))); do
        (
            s=$(now)
            "$BIN/stagehand" checkpoint commit --project "$PROJECT" --run "$RUN_NAME" --step "$step" \
                --tier local --node "n$i" --part "$i" --parts "$PARTS" --policies "$WORK/agents/n$i/policies" \
                "$(part_dir "$step" "$i")" >/dev/null 2>>"$WORK/commits.log"
            secs "$s" "$(now)" >"$WORK/commit-$step-$i"
        ) &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    for i in $(seq 0 $((PARTS - 1))); do
        slowest=$(python3 -c "print(max($slowest, $(cat "$WORK/commit-$step-$i")))")
    done
    until "$BIN/stagehand" checkpoint list "$RUN_NAME" --project "$PROJECT" --policies "$POLICIES" --json |
        python3 -c "import json,sys; sys.exit(not any(c['step'] == $step and c['state'] == 'committed' for c in json.load(sys.stdin)))"; do
        sleep 0.05
    done
    t1=$(now)
    # Every part gone from its node (its copy proven first, with hashed-in-flight).
    for i in $(seq 0 $((PARTS - 1))); do
        while [ -e "$(part_dir "$step" "$i")" ]; do sleep 0.05; done
    done
    t2=$(now)
    printf '{"tool":"offload","step":%d,"seconds":%.6f,"freed_seconds":%.6f,"commit_seconds":%.6f,"bytes":%d}\n' \
        "$step" "$(secs "$t0" "$t1")" "$(secs "$t0" "$t2")" "$slowest" "$bytes" | tee -a "$RESULTS" >&2
    rm -rf "$HOT/$PROJECT/ckpt-$RUN_NAME/step-$step"
}

run_cp() {
    local step=copy i t0 t1 bytes
    write_parts "$step"
    sync
    bytes=$(step_bytes "$HOME_DIR"/tiers/local-n*/"$PROJECT/ckpt-$RUN_NAME/step-$step")
    t0=$(now)
    mkdir -p "$HOT/plain-copy"
    for i in $(seq 0 $((PARTS - 1))); do
        cp -r "$(part_dir "$step" "$i")" "$HOT/plain-copy/part-$i"
    done
    sync -f "$HOT/plain-copy"
    t1=$(now)
    printf '{"tool":"cp","seconds":%.6f,"bytes":%d}\n' "$(secs "$t0" "$t1")" "$bytes" |
        tee -a "$RESULTS" >&2
    rm -rf "$HOT/plain-copy"
    for i in $(seq 0 $((PARTS - 1))); do rm -rf "$(dirname "$(part_dir "$step" "$i")")"; done
}

for _ in $(seq "$PAIRS"); do
    run_offload
    run_cp
done
echo "load after: $(uptime | sed 's/.*load average/load average/')" >&2

python3 - "$RESULTS" "$PROFILE" "$PARTS" "$PART_MIB" "$VERIFY" <<'EOF'
import json, os, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
off = [r for r in rows if r["tool"] == "offload"]
cp = [r for r in rows if r["tool"] == "cp"]
rate = lambda r, key="seconds": r["bytes"] / r[key] / 2**20
ratios = [rate(a) / rate(b) for a, b in zip(off, cp)]
freed = [rate(a, "freed_seconds") / rate(b) for a, b in zip(off, cp)]
print(f"\ncheckpoint of {sys.argv[3]} parts × {sys.argv[4]} MiB on node NVMe, offloaded to hot, "
      f"verify = {sys.argv[5]}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} (1 min), "
      f"profile {sys.argv[2]}")
print("| commit (slowest part, median) | offload rate (step latest) | node-freed rate | cp -r + sync rate "
      "| offload ÷ cp (median of pairs) | node-freed ÷ cp |")
print("|---:|---:|---:|---:|---:|---:|")
each = lambda xs: ', '.join(f'{x:.2f}' for x in xs)
print(f"| {st.median(r['commit_seconds'] for r in off):.3f} s (max {max(r['commit_seconds'] for r in off):.3f}) | "
      f"{st.median(rate(r) for r in off):.0f} MiB/s | {st.median(rate(r, 'freed_seconds') for r in off):.0f} MiB/s | "
      f"{st.median(rate(r) for r in cp):.0f} MiB/s | "
      f"{st.median(ratios):.2f} (each {each(ratios)}) | {st.median(freed):.2f} (each {each(freed)}) |")
EOF
