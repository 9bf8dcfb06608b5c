#!/usr/bin/env bash
# The README's two commands as root in a clone under a private (0700) directory,
# as on a fresh GPU VM where root clones into its home, with an agent SIGKILLed
# under traffic in between (a check that prints figures, not a test):
#
#   sudo bash tests/bench/check_private_clone.sh [--test] [PARENT]
#
# PARENT (default /root) must be 0700. LLMGW_LLAMA_CPP passes through
# (=portable: the path of an AVX2 CPU without AVX-512). Prints how long `make
# run` took to its first completion, who runs the engine and the pass-through,
# how many of 40 requests (0.5 s apart, the agent killed at the 5th) failed and
# whether the engine kept its pid; then stops `make run` with SIGINT, lists what
# is left, and with --test runs `make test` there. Uses the default ports: stop
# any other `llmgw up` first.
set -u
run_tests=0
if [ "${1:-}" = --test ]; then run_tests=1; shift; fi
parent=${1:-/root}
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
[ "$(stat -c %a "$parent")" = 700 ] || { echo "$parent is not 0700"; exit 2; }
clone=$(mktemp -d "$parent/llmgw-private.XXXXXX")
git clone -q "$repo" "$clone/llmgw" && cd "$clone/llmgw" || exit 1
log=$clone/make-run.log
start=$(date +%s)
setsid make run > "$log" 2>&1 &
up=$!
until grep -q "first completion" "$log"; do
  kill -0 $up 2>/dev/null || { echo "make run ended:"; tail -20 "$log"; exit 1; }
  sleep 1
done
echo "first completion after $(( $(date +%s) - start )) s (LLMGW_LLAMA_CPP=${LLMGW_LLAMA_CPP:-auto})"
ps -eo user,args | grep -E "^\S+ +(llama-server|worker_agent.passthrough) \[llmgw" | cut -c1-110
engine=$(pgrep -f "^llama-server \[llmgw" | head -1)
agent=$(pgrep -f "llmgw(_cli)? agent" | head -1)
key=$(cat .llmgw/dev-api-key)
failed=0
for i in $(seq 40); do
  [ "$i" = 5 ] && kill -9 "$agent"
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 20 \
    http://127.0.0.1:8000/v1/chat/completions -H "Authorization: Bearer $key" \
    -H 'Content-Type: application/json' \
    -d '{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}')
  [ "$code" = 200 ] || { failed=$((failed + 1)); echo "request $i: $code"; }
  sleep 0.5
done
echo "agent SIGKILLed at request 5: $failed of 40 failed;" \
  "engine pid $engine -> $(pgrep -f "^llama-server \[llmgw" | head -1)"
kill -INT -- -$up 2>/dev/null
for _ in $(seq 30); do kill -0 $up 2>/dev/null || break; sleep 1; done
echo "left after make run: $(.ci/leftovers | tr '\n' ' ')"
if [ $run_tests = 1 ]; then
  start=$(date +%s)
  make test > "$clone/make-test.log" 2>&1
  echo "make test: exit $? in $(( $(date +%s) - start )) s: $(grep -E '[0-9]+ passed' "$clone/make-test.log" | tail -1)"
  echo "left after make test: $(.ci/leftovers | tr '\n' ' ')"
fi
make clean > /dev/null 2>&1
cd / && rm -rf "$clone"
