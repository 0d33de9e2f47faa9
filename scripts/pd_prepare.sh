#!/usr/bin/env bash
# Packs into .pd/ (ignored; carried beside .whl in the call that runs scripts/gpu_pd.sh) what prefill/decode
# disaggregation needs on a GPU machine whose image lacks it: sglang-router 0.3.2 and the two modules it imports that
# the image lacks (orjson, setproctitle); the Mooncake transfer engine's CUDA build cut to what
# `from mooncake.engine import TransferEngine` loads; the CUDA 12 runtime that build links (the image has CUDA 13's);
# and the system libraries it links that a CUDA image may lack (libibverbs with libmlx5 and libnl, libnuma, libcurl
# with its own dependencies). scripts/gpu_pd.sh puts each carried library on LD_LIBRARY_PATH only where the machine's
# ldconfig cache lacks it.
# Run on a CPU machine with PyPI and Debian's archive in reach, from the repository root:
#   bash scripts/pd_prepare.sh            (about 2 minutes, most of it xz; work files under $WORK, /tmp/pd-prepare)
# Why not the wheels as they are: mooncake-transfer-engine's cp312 wheel is 98 MB and sglang-router's 31 MB, against
# 64 MiB for everything one GPU call carries, the checkout and .whl included. Only engine.so's own closure is kept,
# debug info and symbol tables are stripped (not from engine.so, which ships stripped) and the lot is packed with xz.
# Ends by printing the sizes of .whl, .pd and the tracked tree against that limit (status 1 past it).
set -euo pipefail
WORK=${WORK:-/tmp/pd-prepare}
PY=${PYTHON:-python3}
MOONCAKE=mooncake-transfer-engine==0.3.13.post1
ROUTER=sglang-router==0.3.2
# the router's imports the GPU image lacks (it has aiohttp, uvicorn and fastapi comes in .whl); the CUDA 12 runtime
# of 12.8 or later: engine.so calls cudaMemcpyBatchAsync
EXTRA=(orjson==3.13.0 setproctitle==1.3.8 nvidia-cuda-runtime-cu12==12.9.79)
# Debian packages of the libraries engine.so links, and libcurl's own (an image without curl lacks them all)
DEBS=(libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 libbrotli1 libgssapi-krb5-2
      libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libldap-2.5-0 libsasl2-2 libnghttp2-14 libpsl5
      librtmp1 libssh2-1 libidn2-0 libunistring2)
LIMIT_MIB=64

for tool in readelf strip xz dpkg-deb apt-get; do
  command -v "$tool" > /dev/null || { echo "pd_prepare.sh needs $tool (binutils, xz-utils, dpkg, apt)"; exit 1; }
done
[ -f scripts/gpu_env.sh ] || { echo "run from the repository root"; exit 1; }
mkdir -p "$WORK/wheels" "$WORK/debs"
rm -rf "$WORK/stage" "$WORK/unpacked"
STAGE=$WORK/stage
mkdir -p "$STAGE/site" "$STAGE/lib" "$WORK/unpacked"

echo "== wheels (CPython 3.12, manylinux x86_64)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$WORK/wheels" "$MOONCAKE" "$ROUTER" "${EXTRA[@]}"
wheel() { ls "$WORK"/wheels/"$1"-*.whl | head -1; }
for name in sglang_router orjson setproctitle; do
  "$PY" -m zipfile -e "$(wheel "$name")" "$STAGE/site"
done
"$PY" -m zipfile -e "$(wheel mooncake_transfer_engine)" "$WORK/unpacked/mooncake"
"$PY" -m zipfile -e "$(wheel nvidia_cuda_runtime_cu12)" "$WORK/unpacked/cudart"
cp "$WORK/unpacked/cudart/nvidia/cuda_runtime/lib/libcudart.so.12" "$STAGE/lib/"

echo "== mooncake: engine.so and the libraries of the wheel it loads"
# engine.so finds them through its RPATH ($ORIGIN and $ORIGIN/../mooncake_transfer_engine.libs): the layout stays
MC=$WORK/unpacked/mooncake
mkdir -p "$STAGE/site/mooncake" "$STAGE/site/mooncake_transfer_engine.libs"
# __init__.py imports buffer_pool, which falls back to None without store.so (left out: the store, not the engine)
cp "$MC/mooncake/__init__.py" "$MC/mooncake/buffer_pool.py" "$STAGE/site/mooncake/"
queue=("$MC/mooncake/engine.so")
while [ ${#queue[@]} -gt 0 ]; do
  lib=${queue[0]}
  queue=("${queue[@]:1}")
  rel=${lib#"$MC"/}
  [ -e "$STAGE/site/$rel" ] && continue
  cp "$lib" "$STAGE/site/$rel"
  for needed in $(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    for dir in mooncake mooncake_transfer_engine.libs; do
      [ -e "$MC/$dir/$needed" ] && queue+=("$MC/$dir/$needed")
    done
  done
done
ls -la "$STAGE/site/mooncake" "$STAGE/site/mooncake_transfer_engine.libs"

echo "== Debian packages (amd64) of the system libraries"
apt_opts=()
if [ "$(dpkg --print-architecture)" != amd64 ]; then  # another host: amd64's package lists of their own
  apt_opts=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists="$WORK/amd64-lists")
  mkdir -p "$WORK/amd64-lists/partial"
fi
apt-get "${apt_opts[@]}" update -qq
(cd "$WORK/debs" && apt-get "${apt_opts[@]}" download "${DEBS[@]}" 2>&1 | grep -v "unsandboxed" || true)
for deb in "${DEBS[@]}"; do
  ls "$WORK"/debs/"${deb}"_*_amd64.deb > /dev/null || { echo "apt-get download $deb failed"; exit 1; }
done
for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$WORK/unpacked/deb"; done
# each library once, named by its soname (the name the loader looks for); the packages' symlinks resolved
for lib in $(find "$WORK/unpacked/deb" -maxdepth 4 -path '*x86_64-linux-gnu/lib*.so.*' -type f); do
  soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
  [ -n "$soname" ] && cp "$lib" "$STAGE/lib/$soname"
done
# ibverbs-providers: libmlx5 (engine.so links it), not the other vendors' providers
find "$STAGE/lib" -name 'lib*.so.*' \( -name 'libefa.*' -o -name 'libmana.*' -o -name 'libmlx4.*' \) -delete

echo "== strip"
for lib in $(find "$STAGE" -name '*.so*' -type f); do
  if readelf -S "$lib" | grep -q '\.go\.buildinfo'; then
    strip --strip-debug "$lib"  # Go's runtime reads its own tables, not the ELF symbol table; keep it anyway
  elif readelf -S "$lib" | grep -q '\.symtab'; then
    strip --strip-unneeded "$lib"
  fi
done

echo "== check: every library engine.so needs resolves inside .pd (libcuda.so.1 comes with the GPU driver)"
missing=$(LD_LIBRARY_PATH=$STAGE/lib ldd "$STAGE/site/mooncake/engine.so" | grep "not found" | grep -v libcuda.so.1 \
  || true)
[ -z "$missing" ] || { echo "engine.so: $missing"; exit 1; }
LD_LIBRARY_PATH=$STAGE/lib ldd "$STAGE/site/mooncake/engine.so" | grep -E "=> $STAGE" | sed "s|$STAGE/||"
# the stripped libraries still load (the Go runtime of libetcd_wrapper starts as it is loaded)
for lib in "$STAGE/site/mooncake"/lib*.so "$STAGE"/site/mooncake_transfer_engine.libs/*; do
  LD_LIBRARY_PATH=$STAGE/lib "$PY" -c "import ctypes, sys; ctypes.CDLL(sys.argv[1])" "$lib" \
    || { echo "$lib does not load after strip"; exit 1; }
done

# the router's extension after strip (abi3: any CPython 3 here imports it)
PYTHONPATH=$STAGE/site "$PY" -c "import sglang_router.sglang_router_rs" \
  || { echo "the router does not import after strip"; exit 1; }

echo "== pack"
rm -rf .pd
mkdir -p .pd
(cd "$STAGE" && find site lib -type f -printf '%s\t%p\n' | sort -k2) > .pd/MANIFEST.txt
{
  echo "# from: $MOONCAKE $ROUTER ${EXTRA[*]}; Debian: ${DEBS[*]}"
  echo "# made $(date -u +%Y-%m-%dT%H:%MZ) by scripts/pd_prepare.sh; unpacked by scripts/gpu_pd.sh"
} >> .pd/MANIFEST.txt
tar -C "$STAGE" -cf - site lib | xz -9 -T0 > .pd/pd.tar.xz
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.pd/' "$exclude" 2>/dev/null || echo '/.pd/' >> "$exclude"
git check-ignore -q .pd || { echo ".pd is not ignored: add /.pd/ to $exclude"; exit 1; }

echo "== sizes (one GPU call carries at most $LIMIT_MIB MiB: the checkout's files, .whl and .pd)"
du -sh --apparent-size "$STAGE" | sed 's|\t.*|\tunpacked|'
carried=(.pd)
if [ -d .whl ]; then carried+=(.whl); else echo "no .whl here (scripts/gpu_env.sh's wheels): counted as 0"; fi
du -sh "${carried[@]}"
tree_b=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
carry_b=$(du -sb "${carried[@]}" | awk '{s += $1} END {print s}')
total_mib=$(( (tree_b + carry_b) >> 20 ))
echo "tracked files $((tree_b >> 20)) MiB + .whl and .pd $((carry_b >> 20)) MiB = $total_mib MiB of $LIMIT_MIB"
if [ "$total_mib" -ge "$LIMIT_MIB" ]; then
  echo "over the limit: carry a leaner .whl for this call (gpu_pd.sh needs the server's and bench_serving's"
  echo "wheels: not pytest, pluggy, iniconfig)"
  exit 1
fi
