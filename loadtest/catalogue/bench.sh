#!/usr/bin/env bash
# Catalogue benchmark: a version of 1,000,000 files by reference, folded by the recorder, then
# `stagehand catalogue show D@V --limit 100` timed over 100 queries (the client's two round
# trips, and the command as a process), plus one file's lookup. Target: p99 < 50 ms.
#
#   loadtest/catalogue/bench.sh                    # 1,000,000 files, 100 queries
#   FILES=14000000 loadtest/catalogue/bench.sh     # an ImageNet-21k-sized version
#
# Needs a nats-server (STAGEHAND_NATS_SERVER, or `deploy/servers.sh install`). The load
# average is printed first: other work on the machine moves every figure.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
FILES=${FILES:-1000000}
QUERIES=${QUERIES:-100}
LIMIT=${LIMIT:-100}

cd "$REPO"
# The recorder (in the benchmark's process) is built optimised. The `stagehand` binary timed as
# a process is the dev build: an optimised CLI would compile aws-sdk-s3 with LTO (the mover),
# and the command's own work is starting, connecting and printing 100 lines.
cargo build --profile bench-release -p stagehand-loadtest --bin catalogue-bench
cargo build -p stagehand --bin stagehand
"$CARGO_TARGET_DIR/bench-release/catalogue-bench" --files "$FILES" --queries "$QUERIES" \
    --limit "$LIMIT" --cli "$CARGO_TARGET_DIR/debug/stagehand"
