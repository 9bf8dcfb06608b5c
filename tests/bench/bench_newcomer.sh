#!/usr/bin/env bash
# Time from a clean clone to the first completion of `make run` (a script that
# prints a figure, not a test):
#
#   bash tests/bench/bench_newcomer.sh [REPO]   # REPO: what to clone (default: this checkout)
#
# The clone goes to a fresh temporary directory and HOME is a fresh one too, so
# nothing is reused: no venv, no pip cache, no engine cache. LLMGW_LLAMA_CPP
# passes through (=portable: the path of an AVX2 CPU without AVX-512). Ports
# are moved off the defaults so a running `llmgw up` does not collide. Once the
# first completion is printed, `make run` is stopped with Ctrl-C (SIGINT).
set -u
repo=${1:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}
dir=$(mktemp -d /tmp/newcomer.XXXXXX)
chmod 755 "$dir"  # as a clone in /tmp would be: the engine user must reach the work dir
log=$dir/make-run.log
start=$(date +%s)
git clone -q "$repo" "$dir/clone"
cd "$dir/clone" || exit 1
mkdir "$dir/home"
export HOME=$dir/home
export LLMGW_TEMPORAL_PORT=${LLMGW_TEMPORAL_PORT:-17433} LLMGW_UI_PORT=${LLMGW_UI_PORT:-17434}
export LLMGW_ROUTER_PORT=${LLMGW_ROUTER_PORT:-17435}
export LLMGW_PORT_RANGE_START=${LLMGW_PORT_RANGE_START:-17500}
setsid make run > "$log" 2>&1 &
pid=$!
status=0
while ! grep -q "first completion" "$log"; do
  if ! kill -0 $pid 2>/dev/null; then
    echo "make run ended before a completion:"; tail -20 "$log"; status=1; break
  fi
  sleep 0.5
done
end=$(date +%s)
grep -E "prebuilt|built in|first completion" "$log"
[ $status = 0 ] && echo "clean clone to first completion: $((end - start)) s" \
  "(LLMGW_LLAMA_CPP=${LLMGW_LLAMA_CPP:-auto})"
kill -INT -- -$pid 2>/dev/null
for _ in $(seq 90); do kill -0 $pid 2>/dev/null || break; sleep 1; done
if kill -0 $pid 2>/dev/null; then kill -TERM -- -$pid; fi
echo "log: $log"
exit $status
