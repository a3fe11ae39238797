#!/usr/bin/env bash
# aiperf (NVIDIA) and guidellm (vLLM) against `pdserve serve`, offline, beside `pdserve bench` on the same
# traffic: fixed-length synthetic prompts, a fixed output length (EOS ignored), a fixed concurrency.
#
#   benchmarks/external_tools.sh                  # smollm2, 128-token prompts, 32 output tokens, 4 streams, 16 requests
#   MODEL=tiny REQUESTS=32 benchmarks/external_tools.sh
#
# The tools live in their own virtual environment (TOOLS_VENV, default .venv-tools): `pip install aiperf
# guidellm` there once, with network access; this script then needs none. Their tokenizer is the one
# `pdserve tokenizer export` writes, so nothing is downloaded from Hugging Face. Not part of CI: it runs a
# deployment and three benchmarks (a few minutes on 2 cores).
set -euo pipefail

MODEL=${MODEL:-smollm2}
ISL=${ISL:-128}            # prompt tokens
OSL=${OSL:-32}             # output tokens
CONCURRENCY=${CONCURRENCY:-4}
REQUESTS=${REQUESTS:-16}
HTTP_PORT=${HTTP_PORT:-8011}
GRPC_PORT=${GRPC_PORT:-50071}
OUT=${OUT:-results/external_tools}
TOOLS_VENV=${TOOLS_VENV:-.venv-tools}
PDSERVE=${PDSERVE:-pdserve}
PYTHON=${PYTHON:-python}

for tool in aiperf guidellm; do
    if [[ ! -x "$TOOLS_VENV/bin/$tool" ]]; then
        echo "error: $TOOLS_VENV/bin/$tool not found; install the tools once:" >&2
        echo "  python -m venv $TOOLS_VENV && $TOOLS_VENV/bin/pip install aiperf guidellm" >&2
        exit 2
    fi
done

rm -rf "$OUT"
mkdir -p "$OUT"
URL="http://127.0.0.1:$HTTP_PORT"
# The tools run without network: every connection but to 127.0.0.1 goes to a proxy that is not there, so a
# tool that tried to download anything would fail. (Not HF_HUB_OFFLINE=1: with it, aiperf looks a local
# tokenizer folder up in the hub's cache and fails.)
DEAD=http://127.0.0.1:9
OFFLINE=(env HTTP_PROXY=$DEAD HTTPS_PROXY=$DEAD ALL_PROXY=$DEAD http_proxy=$DEAD https_proxy=$DEAD all_proxy=$DEAD
         NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1)

"$PDSERVE" tokenizer export "$OUT/tokenizer" --model "$MODEL"

"$PDSERVE" serve --model "$MODEL" --mode colocated --transport grpc --port "$GRPC_PORT" \
    --http-port "$HTTP_PORT" > "$OUT/serve.log" 2>&1 &
SERVE_PID=$!
# serve stops on SIGTERM (a background job of a script ignores SIGINT)
trap 'kill -TERM $SERVE_PID 2>/dev/null; wait $SERVE_PID 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
    if curl -sf "$URL/health" > /dev/null 2>&1; then break; fi
    if ! kill -0 $SERVE_PID 2>/dev/null; then echo "error: pdserve serve exited (see $OUT/serve.log)" >&2; exit 1; fi
    sleep 1
done
curl -sf "$URL/health" > /dev/null || { echo "error: pdserve serve did not become healthy" >&2; exit 1; }

echo "== pdserve bench"
"$PDSERVE" bench --target "$URL" --architectures colocated --num-requests "$REQUESTS" --max-concurrency "$CONCURRENCY" \
    --prompt-len-mean "$ISL" --prompt-len-sigma 0 --prompt-len-min "$ISL" --prompt-len-max "$ISL" \
    --output-len-mean "$OSL" --output-len-sigma 0 --output-len-min "$OSL" --output-len-max "$OSL" \
    --warmup 2 --no-progress --out "$OUT/pdserve_bench" > "$OUT/pdserve_bench.log" 2>&1

echo "== aiperf"
"${OFFLINE[@]}" "$TOOLS_VENV/bin/aiperf" profile --model "$MODEL" --url "$URL" --endpoint-type completions --streaming \
    --tokenizer "$OUT/tokenizer" \
    --prompt-input-tokens-mean "$ISL" --prompt-input-tokens-stddev 0 \
    --prompt-output-tokens-mean "$OSL" --prompt-output-tokens-stddev 0 --extra-inputs ignore_eos:true \
    --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --warmup-request-count 2 \
    --output-artifact-dir "$OUT/aiperf" --no-gpu-telemetry --no-server-metrics --no-auto-plot \
    > "$OUT/aiperf.log" 2>&1

echo "== guidellm"
"${OFFLINE[@]}" "$TOOLS_VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$URL,model=$MODEL,request_format=/v1/completions" \
    --profile "kind=concurrent,streams=$CONCURRENCY" \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --data "kind=synthetic_text,prompt_tokens=$ISL,output_tokens=$OSL" \
    --tokenizer "kind=huggingface_auto,model=$OUT/tokenizer" \
    --output "kind=json,path=$OUT/guidellm.json" --disable-console-interactive \
    > "$OUT/guidellm.log" 2>&1

"$PYTHON" -m external_tools_summary "$OUT"
