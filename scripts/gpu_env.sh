# Sourced by the GPU scripts (device tool): $OUT, the carried wheels (.whl: test wheels; .whl_serve: the server's,
# only when the image lacks them) installed under /tmp, and PYTHONPATH for this checkout.
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SGLANG_CACHE_DIR=/tmp/sgcache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
if ! python3 -c "import fastapi, uvicorn, aiohttp, jsonschema, prometheus_client, httpx" 2>/dev/null && [ -d .whl_serve ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/serve .whl_serve/*.whl
  export PYTHONPATH=/tmp/serve
fi
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}
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
