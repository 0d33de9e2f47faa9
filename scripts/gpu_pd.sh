#!/usr/bin/env bash
# Prefill/decode disaggregation on one GPU in one call: a prefill and a decode server on the same GPU
# (--mem-fraction-static 0.4 and 0.85, docs/disaggregation.md) behind sglang-router in its PD mode, against one
# co-located server, each under the same prefill-heavy load (bench_serving: random 8,192-token prompts, 256 output
# tokens, concurrency 32). Reports each setup's median / p99 TTFT and TPOT and output tok/s; the decode TPOT with no
# prompts arriving (bench_one_batch: the median decode step of a batch of 32 at the same prompt length, the engine
# alone on the GPU) and each setup's median TPOT over it; the KV transfer (the prefill server's sglang:kv_transfer_*
# counters over the PD load: bytes, writes, seconds of writes) against the same call's device copy bandwidth and a
# bulk Mooncake write between two processes. One table on stdout; $OUT/pd.json, the raw files in $OUT/pd_raw.tar.gz.
#   bash scripts/pd_prepare.sh      on a CPU machine first: .pd/ (the router, the Mooncake engine's CUDA build)
#   bash scripts/gpu_pd.sh          the call carries .whl and .pd; 7-8 minutes on an H100 (estimated)
# MODEL (default: the quantized Flash slice, written to /tmp/w/q when absent), INPUT_LEN, OUTPUT_LEN, NUM_PROMPTS,
# CONCURRENCY, MEM_PREFILL / MEM_DECODE (GPU fractions), SKIP_WARMUP=1 (--skip-server-warmup), BUDGET_S (a phase that
# would end past it fails unrun: the call's limit is 600 s).
# The servers warm up (no --skip-server-warmup): a Triton compile inside a measured prefill would count in TTFT and,
# co-located, stall decode. The co-located server, first, compiles into Triton's on-disk cache, so the prefill
# server's warm-up only runs its forwards; a decode server has none.
# A dry run on CPU: DEVICE=cpu MODEL=tiny-deepseek-v4 INPUT_LEN=64 OUTPUT_LEN=8 NUM_PROMPTS=8 CONCURRENCY=4 bash ...
source "$(dirname "$0")/gpu_env.sh"
DEVICE=${DEVICE:-cuda}
CONFIG=benchmark/configs/flash-slice-4l32e.config.json
W=${W:-/tmp/w/q}
INPUT_LEN=${INPUT_LEN:-8192}
OUTPUT_LEN=${OUTPUT_LEN:-256}
NUM_PROMPTS=${NUM_PROMPTS:-64}
CONCURRENCY=${CONCURRENCY:-32}
BUDGET_S=${BUDGET_S:-570}
STEP_MAX=${STEP_S:-240}
HEALTHY_S=${HEALTHY_S:-300}
PD=/tmp/pd          # .pd unpacked
RUN=/tmp/pd-run     # raw outputs, packed into $OUT at the end (at most 8 files come back from $OUT)
P_COLOCATED=30800 P_PREFILL=30801 P_DECODE=30802 P_ROUTER=30803 P_BOOTSTRAP=30898 P_ROUTER_METRICS=30899
rm -rf "$RUN"
mkdir -p "$RUN"

# ---- processes: every server and the router is stopped at exit, children included -----------------------------
PIDS=()
LAST=""
start() {  # start LOG CMD...: CMD in the background (its pid in LAST and PIDS)
  local log=$1
  shift
  "$@" > "$log" 2>&1 &
  LAST=$!
  PIDS+=("$LAST")
}
descendants() { local p; for p in $(pgrep -P "$1"); do echo "$p"; descendants "$p"; done; }
alive() {  # alive PID...: whether any has not exited (an exited child stays a zombie until waited for)
  local p
  for p in "$@"; do [[ "$(ps -o stat= -p "$p" 2>/dev/null)" =~ ^[^Z] ]] && return 0; done
  return 1
}
stop_all() {  # SIGTERM (a server then stops its scheduler), SIGKILL to what is left after 30 s
  [ ${#PIDS[@]} -gt 0 ] || return 0
  local all=() pid
  for pid in "${PIDS[@]}"; do all+=("$pid" $(descendants "$pid")); done
  kill -TERM "${PIDS[@]}" 2>/dev/null
  for _ in $(seq 60); do alive "${all[@]}" || break; sleep 0.5; done
  kill -KILL "${all[@]}" 2>/dev/null
  wait "${PIDS[@]}" 2>/dev/null
  PIDS=()
}
trap stop_all EXIT
trap 'exit 143' TERM INT

left() {  # left MAX: the seconds to BUDGET_S, at most MAX, at least 10 (each step and wait is bounded by it)
  local s=$((BUDGET_S - SECONDS))
  [ "$s" -gt "$1" ] && s=$1
  [ "$s" -lt 10 ] && s=10
  echo "$s"
}
bstep() { STEP_S=$(left "$STEP_MAX") step "$@"; }  # a step bounded by STEP_S and by what is left of BUDGET_S

healthy() {  # healthy NAME PORT: wait for the server just started; its start-up seconds in $RUN/starts.txt
  local t0=$SECONDS
  if wait_healthy "$2" "$LAST" "$RUN/$1.txt" "$(left "$HEALTHY_S")"; then
    echo "$1 $((SECONDS - t0))" >> "$RUN/starts.txt"
    say "$1 server healthy after $((SECONDS - t0)) s"
    grep -E "warm-up|full tokens" "$RUN/$1.txt" | head -3 | tee -a "$LOG"
    return 0
  fi
  fail "$1 server"
  return 1
}

router_ready() {  # router_ready PID: a one-token /generate through the router answers (the decode server has
  # reached the prefill server's bootstrap server by then), within 120 s
  local end=$((SECONDS + $(left 120)))
  while [ $SECONDS -lt $end ]; do
    curl -sf -m 30 "http://127.0.0.1:$P_ROUTER/generate" -H 'Content-Type: application/json' \
      -d '{"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}' > /dev/null && return 0
    kill -0 "$1" 2>/dev/null || { tail -30 "$RUN/router.txt"; return 1; }
    sleep 1
  done
  echo "the router did not answer"; tail -30 "$RUN/router.txt"; return 1
}

gpu_memory() {  # what the servers hold: memory used of the whole GPU
  [ "$DEVICE" = cuda ] || return 0
  say "GPU memory used / total, $1: $(nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader)"
}

fits() {  # fits NAME SECONDS: whether phase NAME, about SECONDS long, ends within BUDGET_S; if not it fails unrun
  [ $((SECONDS + $2)) -le "$BUDGET_S" ] && return 0
  fail "$1 (not run: at $SECONDS s, ${2} s more would pass BUDGET_S=$BUDGET_S)"
  return 1
}

# ---- .pd: the router and the Mooncake engine; the system libraries the image lacks --------------------------------
unpack() {
  rm -rf "$PD"
  mkdir -p "$PD/ld"
  if [ ! -f .pd/pd.tar.xz ]; then echo "no .pd/pd.tar.xz: the image's own packages serve"; return 0; fi
  tar -xJf .pd/pd.tar.xz -C "$PD" || return 1
  echo "image: $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-unknown}"), $(ldd --version | head -1)"
  local cache lib name verbs=0
  cache=$(ldconfig -p)
  has() { grep -q "^[[:space:]]*$1 " <<< "$cache"; }
  # libmlx5 needs the private symbols of its own libibverbs release: the two come from one place
  has libibverbs.so.1 && has libmlx5.so.1 || verbs=1
  for lib in "$PD"/lib/*; do
    name=${lib##*/}
    case $name in
      libibverbs.so.1|libmlx5.so.1) [ $verbs = 1 ] ;;
      *) ! has "$name" ;;
    esac && ln -s "$lib" "$PD/ld/$name"
  done
  echo "carried libraries in use (the image lacks them): $(ls "$PD/ld" | tr '\n' ' ')"
}

imports() {  # what the PD servers and the router load, before any GPU time goes to them
  if python3 -c "
from mooncake.engine import TransferEngine
import mooncake, sglang_router.launch_router as r
print('mooncake', mooncake.__path__[0]); print('sglang_router', r.__file__)"; then
    return 0
  fi
  echo "from mooncake.engine import TransferEngine or sglang_router.launch_router failed (above); unresolved:"
  local so
  so=$(python3 -c "import importlib.util as u; print(u.find_spec('mooncake').submodule_search_locations[0])")
  ldd "$so/engine.so" | grep "not found"
  return 1
}

# ---- measurements ------------------------------------------------------------------------------------------------
# a bulk Mooncake write between two processes' registered memory over loopback TCP, as the servers write (a file, so
# that its step runs a program, which STEP_S bounds)
cat > "$RUN/probe.py" <<'PY'
import json, subprocess, sys, time
import torch
from sglang.srt.disaggregation.transfer import MooncakeTransfer, RegisteredBuffer

device, mib, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
n = mib << 20
PEER = """
import sys, torch
from sglang.srt.disaggregation.transfer import MooncakeTransfer, RegisteredBuffer
device, n = sys.argv[1], int(sys.argv[2])
buf = torch.zeros(n, dtype=torch.uint8, device=device)
engine = MooncakeTransfer("127.0.0.1")
engine.register([RegisteredBuffer("dst", buf.data_ptr(), n, device)])
print("PEER", engine.session_id, buf.data_ptr(), flush=True)
for line in sys.stdin:
    print("SUM", int(buf.sum(dtype=torch.int64)), flush=True)
"""


def answer(peer, tag):
    for line in peer.stdout:  # the engine may log to stdout too
        if line.startswith(tag + " "):
            return line.split()[1:]
    raise SystemExit(f"the peer process ended without its {tag} line")


peer = subprocess.Popen([sys.executable, "-c", PEER, device, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        text=True)
try:
    session, dst = answer(peer, "PEER")
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    engine = MooncakeTransfer("127.0.0.1")
    engine.register([RegisteredBuffer("src", src.data_ptr(), n, device)])
    engine.write(session, [src.data_ptr()], [int(dst)], [n])  # the first write connects
    times = []
    for _ in range(3):
        t = time.perf_counter()
        engine.write(session, [src.data_ptr()], [int(dst)], [n])
        times.append(time.perf_counter() - t)
    peer.stdin.write("sum\n")
    peer.stdin.flush()
    same = int(answer(peer, "SUM")[0]) == int(src.sum(dtype=torch.int64))
finally:
    peer.stdin.close()
    try:
        peer.wait(30)
    except subprocess.TimeoutExpired:
        peer.kill()
gbps = n / min(times) / 1e9
print(f"Mooncake TCP write, {mib} MiB {device} -> {device}, two processes: best of 3 {min(times) * 1e3:.1f} ms, "
      f"{gbps:.2f} GB/s; bytes landed intact: {same}")
json.dump({"bytes": n, "seconds": times, "GBps": gbps, "intact": same}, open(out, "w"))
if not same:
    raise SystemExit("the written bytes differ from the source")
PY

kv_counters() {  # kv_counters TAG: the KV transfer counters of both servers (/metrics, /server_info)
  python3 - "$P_PREFILL" "$P_DECODE" "$RUN/kv_$1.json" <<'PY'
import json, re, sys
import httpx

names = ("kv_transfer_bytes_total", "kv_transfers_total", "kv_transfer_failures_total",
         "kv_transfer_latency_seconds_sum", "kv_transfer_latency_seconds_count")
snap = {}
for role, port in (("prefill", sys.argv[1]), ("decode", sys.argv[2])):
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    row = {n: sum(float(v) for v in re.findall(rf"^sglang:{n}(?:{{[^}}]*}})? (\S+)$", text, re.M)) for n in names}
    row["server_info_transfer"] = (httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()
                                   .get("scheduler_stats") or {}).get("transfer")
    snap[role] = row
    print(role, {k: v for k, v in row.items() if k != "server_info_transfer"})
json.dump(snap, open(sys.argv[3], "w"))
PY
}

BENCH=(-m sglang.bench_serving --backend sglang --host 127.0.0.1 --dataset-name random --num-prompts "$NUM_PROMPTS"
       --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --random-range-ratio 1.0
       --max-concurrency "$CONCURRENCY" --disable-tqdm)
SERVE=(-m sglang.launch_server --host 127.0.0.1 --device "$DEVICE" --max-running-requests "$CONCURRENCY"
       --enable-metrics)
[ "$DEVICE" = cpu ] && SERVE+=(--context-length 1024)  # as the CPU test's servers
[ "${SKIP_WARMUP:-0}" = 1 ] && SERVE+=(--skip-server-warmup)
MEM_PREFILL=(--mem-fraction-static "${MEM_PREFILL:-0.4}")
MEM_DECODE=(--mem-fraction-static "${MEM_DECODE:-0.85}")
if [ "$DEVICE" = cpu ]; then MEM_PREFILL=(); MEM_DECODE=(); fi  # on CPU a fraction of free memory: the default
GRAPH_BS=()
for ((b = 1; b < CONCURRENCY; b *= 2)); do GRAPH_BS+=("$b"); done
GRAPH_BS+=("$CONCURRENCY")

# ---- the call -----------------------------------------------------------------------------------------------------
TAIL=4 step "unpack .pd" unpack
export LD_LIBRARY_PATH=$PD/ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -d "$PD/site" ] && [ "$DEVICE" = cpu ]; then
  # the CPU dry run: .pd's Mooncake, orjson and setproctitle are CPython 3.12 builds for CUDA machines, so the
  # environment's serve; the router's extension (abi3) is the carried one
  mkdir -p "$PD/cpu_site"
  ln -sfn "$PD/site/sglang_router" "$PD/cpu_site/sglang_router"
  export PYTHONPATH=$PD/cpu_site:$PYTHONPATH
elif [ -d "$PD/site" ]; then
  export PYTHONPATH=$PD/site:$PYTHONPATH
fi
step "imports: mooncake.engine, sglang_router" imports
[ ${#FAILED[@]} -gt 0 ] && finish  # nothing below runs without them
TAIL=3 bstep "Mooncake write between two processes" python3 "$RUN/probe.py" "$DEVICE" "${PROBE_MIB:-256}" \
  "$RUN/probe.json"
[ ${#FAILED[@]} -gt 0 ] && finish  # the servers would fail their writes the same way
if [ "$DEVICE" = cuda ]; then  # copy bandwidth, bytes read + written
  TAIL=4 bstep "limits: copy bandwidth" python3 benchmark/kernels/run_all.py --only none --out "$RUN/limits.json"
else
  TAIL=4 bstep "limits: copy bandwidth (a CPU memcpy)" python3 -c "
import json, sys, torch
from sglang.srt.utils.bytes_floor import copy_bandwidth_gbps
gbps = copy_bandwidth_gbps(torch.device('cpu'), 256 << 20)
print(f'CPU memcpy {gbps:.1f} GB/s (read + write)')
json.dump({'copy_GBps': gbps}, open(sys.argv[1], 'w'))" "$RUN/limits.json"
fi
if [ -z "${MODEL:-}" ]; then
  TAIL=3 bstep "checkpoint: Flash slice, quantized" python3 scripts/make_slice_checkpoint.py "$CONFIG" "$W" --quantize \
    --device "$DEVICE"
  MODEL=$W
fi

if fits "co-located server and load" 120; then
  start "$RUN/colocated.txt" python3 "${SERVE[@]}" --port "$P_COLOCATED" --model-path "$MODEL"
  if healthy colocated "$P_COLOCATED"; then
    gpu_memory "co-located server"
    TAIL=22 bstep "bench_serving: co-located" python3 "${BENCH[@]}" --port "$P_COLOCATED" \
      --output-file "$RUN/serving_colocated.jsonl"
  fi
  stop_all
fi

if fits "prefill + decode servers, router and load" 150; then
  start "$RUN/prefill.txt" python3 "${SERVE[@]}" --port "$P_PREFILL" --model-path "$MODEL" "${MEM_PREFILL[@]}" \
    --disaggregation-mode prefill --disaggregation-bootstrap-port "$P_BOOTSTRAP"
  # one GPU: the decode server's fraction counts what the prefill server holds, so it starts once that one is up
  if healthy prefill "$P_PREFILL"; then
    start "$RUN/decode.txt" python3 "${SERVE[@]}" --port "$P_DECODE" --model-path "$MODEL" "${MEM_DECODE[@]}" \
      --disaggregation-mode decode
    if healthy decode "$P_DECODE"; then
      gpu_memory "prefill and decode servers"
      start "$RUN/router.txt" python3 -m sglang_router.launch_router --pd-disaggregation \
        --prefill "http://127.0.0.1:$P_PREFILL" "$P_BOOTSTRAP" --decode "http://127.0.0.1:$P_DECODE" \
        --host 127.0.0.1 --port "$P_ROUTER" --prometheus-port "$P_ROUTER_METRICS" --log-level warn
      if router_ready "$LAST"; then
        say "router ready"
        TAIL=4 step "KV transfer counters before the load" kv_counters before
        TAIL=22 bstep "bench_serving: prefill + decode servers behind the router" python3 "${BENCH[@]}" \
          --port "$P_ROUTER" --output-file "$RUN/serving_pd.jsonl"
        TAIL=4 step "KV transfer counters after the load" kv_counters after
      else
        fail "router"
      fi
    fi
  fi
  stop_all
fi

if fits "decode with no prompts arriving" 60; then
  TAIL=6 bstep "decode with no prompts arriving: bench_one_batch" python3 -m sglang.bench_one_batch \
    --model-path "$MODEL" --device "$DEVICE" --batch-size "$CONCURRENCY" --input-len "$INPUT_LEN" \
    --output-len "$OUTPUT_LEN" --prefill-repeats 1 --profile-steps 0 --cuda-graph-bs "${GRAPH_BS[@]}" \
    --result-filename "$RUN/one_batch.jsonl"
fi

summary() {
  python3 - "$RUN" "$OUT/pd.json" <<'PY'
import json, os, sys

run, out = sys.argv[1], sys.argv[2]
env = os.environ.get


def load(name, last_line=False):
    path = os.path.join(run, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1]) if last_line else json.load(f)


def num(x, fmt=".1f"):
    return "n/a" if x is None else format(x, fmt)


one = load("one_batch.jsonl", True)
step_ms = one["median_decode_latency_s"] * 1e3 if one else None
limits, probe = load("limits.json"), load("probe.json")
copy = limits.get("copy_GBps") if limits else None
setups = {}
for name in ("colocated", "pd"):
    r = load(f"serving_{name}.jsonl", True)
    if r is None:
        setups[name] = None
        continue
    keys = ("completed", "failed", "duration", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "mean_tpot_ms")
    row = {k: r.get(k) for k in keys}
    row["tpot_over_no_prompt_step"] = r["median_tpot_ms"] / step_ms if step_ms else None
    setups[name] = row
before, after = load("kv_before.json"), load("kv_after.json")
kv = None
if before and after:
    p0, p1 = before["prefill"], after["prefill"]
    d = {k: p1[k] - p0[k] for k in p1 if k != "server_info_transfer"}
    nbytes, writes, secs = d["kv_transfer_bytes_total"], d["kv_transfers_total"], d["kv_transfer_latency_seconds_sum"]
    kv = {"bytes": nbytes, "writes": writes, "failures": d["kv_transfer_failures_total"], "write_seconds": secs,
          "bytes_per_write": nbytes / writes if writes else None,
          "mean_write_ms": secs / writes * 1e3 if writes else None,
          "GBps_per_write": nbytes / secs / 1e9 if secs else None,
          "decode_side_bytes": after["decode"]["kv_transfer_bytes_total"] - before["decode"]["kv_transfer_bytes_total"]}
    # the copy bandwidth counts bytes read + written; a transfer's bytes are counted once
    kv["fraction_of_copied_bytes_rate"] = kv["GBps_per_write"] / (copy / 2) if kv["GBps_per_write"] and copy else None
starts = {}
if os.path.exists(os.path.join(run, "starts.txt")):
    starts = {k: int(v) for k, v in (line.split() for line in open(os.path.join(run, "starts.txt")))}
result = {"device": env("DEVICE"), "model": env("MODEL"), "input_len": int(env("INPUT_LEN")),
          "output_len": int(env("OUTPUT_LEN")), "num_prompts": int(env("NUM_PROMPTS")),
          "concurrency": int(env("CONCURRENCY")), "mem_fraction_prefill_decode": env("MEM_FRACTIONS"),
          "server_start_s": starts, "setups": setups,
          "no_prompt_decode_step_ms": step_ms, "no_prompt_decode": one and {
              k: one[k] for k in ("batch_size", "input_len", "output_len", "median_decode_latency_s",
                                  "prefill_latency_s")},
          "kv_transfer": kv, "copy_GBps_read_plus_write": copy, "gpu": limits and limits.get("gpu"),
          "mooncake_bulk_write": probe}
json.dump(result, open(out, "w"), indent=1)

print(f"| setup | completed | output tok/s | TTFT median / p99 ms | TPOT median / p99 ms | median TPOT / "
      f"no-prompt step |")
print("|---|---|---|---|---|---|")
for name, label in (("colocated", "one co-located server"), ("pd", "prefill + decode servers, one GPU")):
    r = setups[name]
    if r is None:
        print(f"| {label} | not run | | | | |")
        continue
    print(f"| {label} | {r['completed']}/{r['completed'] + r['failed']} | {num(r['output_throughput'])} | "
          f"{num(r['median_ttft_ms'])} / {num(r['p99_ttft_ms'])} | {num(r['median_tpot_ms'], '.2f')} / "
          f"{num(r['p99_tpot_ms'], '.2f')} | {num(r['tpot_over_no_prompt_step'], '.2f')} |")
print(f"decode with no prompts arriving (bench_one_batch, batch {env('CONCURRENCY')}, {env('INPUT_LEN')}-token "
      f"prompts, the engine alone): median step {num(step_ms, '.2f')} ms")
if kv:
    print(f"KV transfer over the PD load (prefill server): {kv['writes']:.0f} writes, {kv['bytes'] / 2**20:.1f} MiB "
          f"({num(kv['bytes_per_write'] and kv['bytes_per_write'] / 2**20, '.2f')} MiB a request; decode side "
          f"{kv['decode_side_bytes'] / 2**20:.1f} MiB), {kv['write_seconds']:.3f} s of writes: "
          f"{num(kv['mean_write_ms'], '.2f')} ms a write, {num(kv['GBps_per_write'], '.2f')} GB/s per write")
else:
    print("KV transfer: not measured")
print(f"Mooncake bulk write between two processes: {num(probe and probe['GBps'], '.2f')} GB/s; copy bandwidth "
      f"{num(copy, '.0f')} GB/s read + write ({num(copy and copy / 2, '.0f')} GB/s of bytes copied); KV per-write "
      f"rate / bytes-copied rate: {num(kv and kv['fraction_of_copied_bytes_rate'], '.4f')}")
PY
}

MEM_FRACTIONS="${MEM_PREFILL[*]:-default} / ${MEM_DECODE[*]:-default}"
export DEVICE MODEL INPUT_LEN OUTPUT_LEN NUM_PROMPTS CONCURRENCY MEM_FRACTIONS
TAIL=12 step "summary" summary
tar -czf "$OUT/pd_raw.tar.gz" -C "$RUN" . 2>/dev/null || say "could not pack $RUN"
finish
