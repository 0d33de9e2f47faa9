# The preamble of every scripts/gpu_*.sh (`source "$(dirname "$0")/gpu_env.sh"`), so that each script is its list of
# steps. Run the scripts from the repository root. Results and the log ($OUT/log.txt) go to $OUT (default
# /tmp/gpu-out). Wheels a GPU machine's image lacks travel beside the checkout and are installed under /tmp: .whl/
# (the tests' and benchmarks'), .whl_serve/ (the server's, only where the image lacks them); PYTHONPATH then points
# at this checkout.
#   step NAME CMD...   run CMD; its whole output goes to $LOG, its last $TAIL lines (default 25) to the terminal. A
#                      failed step is recorded and the next one runs anyway, so one run reports every step. pipefail:
#                      a step's status is its command's, not that of the tee / tail it is piped into. CMD may be a
#                      function of the script. STEP_S=N bounds each step that runs a program (not a function) to N
#                      seconds: a hang fails its step. DROP=REGEX leaves matching lines out.
#   finish             print the failed steps and exit 1, or "all steps passed" and exit 0.
#   serve PORT LOG ARGS...   `python3 -m sglang.launch_server --port PORT ARGS` in the background (pid in SERVER),
#                      stopped when the script exits (or by stop_server), once it answers /health.
# A script may define after_failed_step (run after each failed step, e.g. to kill a hung step's processes).
set -u -o pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
LOG=${LOG:-$OUT/log.txt}
FAILED=()
SERVER=""

say() { echo "$*" | tee -a "$LOG"; }

fail() {
  FAILED+=("$1")
  say "=== FAILED: $1"
  if declare -F after_failed_step > /dev/null; then after_failed_step; fi
}

_drop() { if [ -n "${DROP:-}" ]; then grep -Ev -- "$DROP" || true; else cat; fi; }

step() {
  local name=$1 t0=$SECONDS bound=()
  shift
  say "=== $name"
  [ -n "${STEP_S:-}" ] && ! declare -F "$1" > /dev/null && bound=(timeout -k 5 "$STEP_S")
  ( ${bound[@]+"${bound[@]}"} "$@" ) 2>&1 | _drop | tee -a "$LOG" | tail -"${TAIL:-25}" || fail "$name"
  say "=== $name: $((SECONDS - t0)) s"
}

finish() {
  if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'failed step: %s\n' "${FAILED[@]}" | tee -a "$LOG"
    exit 1
  fi
  say "all steps passed"
  exit 0
}

# wait_healthy PORT PID LOG [SECONDS]: until the server started as PID answers /health; if it dies first, its log's
# tail and status 1.
wait_healthy() {
  for _ in $(seq "${4:-600}"); do
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
    kill -0 "$2" 2>/dev/null || { tail -40 "$3"; return 1; }
    sleep 1
  done
  echo "server on port $1 not healthy after ${4:-600} s"; tail -40 "$3"; return 1
}

serve() {
  local port=$1 log=$2
  shift 2
  python3 -m sglang.launch_server --port "$port" "$@" > "$log" 2>&1 &
  SERVER=$!
  trap stop_server EXIT
  wait_healthy "$port" "$SERVER" "$log" "${HEALTHY_S:-600}"
}

stop_server() {
  [ -n "$SERVER" ] || return 0
  kill "$SERVER" 2>/dev/null
  wait "$SERVER" 2>/dev/null
  SERVER=""
}

export PYTHONUNBUFFERED=1 SGLANG_CACHE_DIR=/tmp/sgcache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || fail "install .whl wheels"
fi
if ! python3 -c "import fastapi, uvicorn, aiohttp, jsonschema, prometheus_client, httpx" 2>/dev/null \
    && [ -d .whl_serve ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/serve .whl_serve/*.whl \
    || fail "install .whl_serve wheels"
  export PYTHONPATH=/tmp/serve${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}
