#!/usr/bin/env bash
# Entry point of both images: `python3 -m sglang.launch_server` on 0.0.0.0:30000 (the port EXPOSE and the
# HEALTHCHECK name), with the model and flags chosen from the arguments after the image name:
#   (none)                          the built-in tiny model (random weights): a smoke test on one GPU
#   MODEL [FLAG...]                 MODEL (a local directory or a hub id) with the image's recipe flags
#                                   ($SERVE_DEFAULT_ARGS: the README's launch command for the image's GPUs), then
#                                   FLAG... (a flag given again overrides the recipe's value, e.g. --tp 1)
#   FLAG...  with -e MODEL_PATH=MODEL   the same, the model named by the environment
#   --model-path MODEL [FLAG...]    exactly these flags: no recipe defaults (to leave out, e.g., speculative decoding)
set -euo pipefail

server=(python3 -m sglang.launch_server --host 0.0.0.0 --port 30000)

# A full command line of launch_server's own: run it as given, so the recipe never adds a flag the user cannot remove.
for arg in "$@"; do
    case "${arg}" in
        --model-path | --model-path=*) exec "${server[@]}" "$@" ;;
        *) ;;
    esac
done

model="${MODEL_PATH:-}"
if [[ "$#" -gt 0 && "${1#-}" == "$1" ]]; then
    model="$1"
    shift
fi

# The tiny model fits one GPU of any size; the recipe flags (--tp 8 ...) are for the real checkpoints.
if [[ -z "${model}" ]]; then
    exec "${server[@]}" --model-path tiny-deepseek-v4 "$@"
fi

read -r -a recipe <<< "${SERVE_DEFAULT_ARGS:-}"
exec "${server[@]}" --model-path "${model}" "${recipe[@]}" "$@"
