# Sourced by the GPU scripts (device tool): $OUT, the carried wheels (.whl: test wheels; .whl_serve: the server's,
# only when the image lacks them) installed under /tmp, and PYTHONPATH for this checkout.
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SGLANG_CACHE_DIR=/tmp/sgcache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
if ! python3 -c "import fastapi, uvicorn, aiohttp, prometheus_client, httpx" 2>/dev/null && [ -d .whl_serve ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/serve .whl_serve/*.whl
  export PYTHONPATH=/tmp/serve
fi
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}
