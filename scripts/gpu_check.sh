#!/usr/bin/env bash
# The GPU serving path in one run (scheduler/gpu_check.py): on a machine with one NVIDIA GPU it
# installs the vllm extra, serves the policy's v0 with `vllm serve` (worker extension, hermes
# tool-call parser, routed experts), runs agent sessions through the gateway, applies a delta over
# collective_rpc and checks the hash, and measures the train/serve logprob gap with and without
# routing replay and with batch invariance off and on. Prints one JSON object.
#
#   scripts/gpu_check.sh [--dry-run] [--wheels DIR] [--out FILE] [undertow gpu-check options]
#
# --dry-run   every step on CPU, the CPU engine serving in place of vLLM (nothing installed)
# --wheels    install the vllm extra from wheels in DIR (a machine without a package index)
# --out       also write the JSON to FILE
# Environment: PYTHON (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
wheels=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --wheels) wheels="$2"; shift ;;
        *) args+=("$1") ;;
    esac
    shift
done

py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi

if [ "$dry_run" = 1 ]; then
    echo "gpu_check: dry run on CPU (the CPU engine serves where vllm would)" >&2
    exec "$py" -m scheduler.cli gpu-check --dry-run "${args[@]+"${args[@]}"}"
fi

if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none); run with --dry-run on CPU" >&2
    exit 2
fi
nvidia-smi -L >&2
if [ -n "$wheels" ]; then
    "$py" -m pip install --quiet --no-index --find-links "$wheels" -e '.[vllm]'
else
    "$py" -m pip install --quiet -e '.[vllm]'
fi
exec "$py" -m scheduler.cli gpu-check "${args[@]+"${args[@]}"}"
