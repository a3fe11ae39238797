#!/usr/bin/env bash
# The CUDA paths in one command, for the day a machine with NVIDIA GPUs is at hand (>= 2 GPUs, under
# 5 minutes after scripts/setup.sh). From the repository root:
#   bash scripts/gpu_check.sh
# It prints one line per check, PASS / MISS (ran, target missed) / FAIL (with the output's tail):
#   1. engine vs transformers in bf16 on CUDA (random Llama): the engine's prompt logits are no further
#      from transformers' fp32 logits than transformers' own bf16 logits are (within 2x), and its greedy
#      tokens equal transformers' bf16 greedy tokens.
#   2. serving on a local Ray instance, one worker per GPU (half prefill, half decode), NIXL on device
#      memory (VRAM): colocated, disaggregated and auto give the same greedy tokens; the workers run on
#      cuda; KV moved in the disaggregated requests.
#   3. bench/disagg_ttft_bench.py on CUDA with NIXL: disaggregated / colocated TTFT <= 1.15.
# Exit status 1 if any check is not PASS. Nothing is skipped: no CUDA or one GPU is a FAIL.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
status=0

check() {  # check NAME COMMAND...: run with a time limit; its last output line is the verdict's detail
  local name=$1 out rc start=$SECONDS
  shift
  out=$(timeout 240 "$@" 2>&1)
  rc=$?
  local last
  last=$(tail -n 1 <<<"$out")
  if [ "$rc" -eq 0 ] && [[ "$last" != *MISS* ]]; then
    echo "PASS  $name ($((SECONDS - start)) s): $last"
  elif [ "$rc" -eq 0 ]; then
    echo "MISS  $name ($((SECONDS - start)) s): $last"
    status=1
  else
    echo "FAIL  $name ($((SECONDS - start)) s, exit $rc):"
    tail -n 15 <<<"$out" | sed 's/^/        /'
    status=1
  fi
}

check "engine vs transformers, bf16, CUDA" python - <<'EOF'
import tempfile

import torch
import transformers
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

assert torch.cuda.is_available(), "no CUDA device"
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                  tie_word_embeddings=False, eos_token_id=511, bos_token_id=510)
hf = transformers.LlamaForCausalLM(config).eval()
with torch.no_grad():
    for p in hf.parameters():
        if p.dim() == 2:
            p.normal_(0, 0.05)
path = tempfile.mkdtemp()
hf.save_pretrained(path, safe_serialization=True)
prompt = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(1)).tolist()
ids = torch.tensor([prompt], device="cuda")
with torch.no_grad():
    ref32 = hf.to("cuda", torch.float32)(ids).logits[0].float()
    hf16 = hf.to(torch.bfloat16)
    ref16 = hf16(ids).logits[0].float()
    want = hf16.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                         eos_token_id=None, pad_token_id=None)[0, len(prompt):].tolist()
engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="bfloat16", max_num_batched_tokens=128))
rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
rows = []
while engine.get_request(rid) is not None:  # chunked prefill (128 < 300) through the engine's scheduler
    out = engine.scheduler.schedule()
    rows.append(engine.runner.prompt_logits(out))
    engine.scheduler.update_after_step(out)
    if engine.get_request(rid).num_computed_tokens == len(prompt):
        engine.abort(rid)
ours = torch.cat(rows).float().to("cuda")
err_ours, err_hf = (ours - ref32).abs().max().item(), (ref16 - ref32).abs().max().item()
[got] = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
assert err_ours <= 2 * err_hf + 1e-3, f"logits off fp32 by {err_ours:.3g}, transformers bf16 by {err_hf:.3g}"
assert got.token_ids == want, f"greedy tokens differ: {got.token_ids} vs transformers {want}"
print(f"max |logit - fp32|: engine {err_ours:.3g}, transformers bf16 {err_hf:.3g}; 16 greedy tokens equal")
EOF

check "serving modes, NIXL on VRAM, one worker per GPU" python - <<'EOF'
import torch
from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.router.client import Client

gpus = torch.cuda.device_count()
assert gpus >= 2, f"needs >= 2 GPUs (one prefill and one decode worker), found {gpus}"
config = DeploymentConfig(engine=EngineConfig(model="bench", device="cuda", max_num_batched_tokens=256),
                          mode="auto", num_prefill_workers=gpus // 2, num_decode_workers=gpus - gpus // 2,
                          transport="nixl", port=0)
prompts = [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate((40, 300, 700, 1500))]
greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
with Deployment(config) as d, Client(d.address) as client:
    tokens, moved = {}, 0
    for mode in ("colocated", "disaggregated", "auto"):
        tokens[mode] = []
        for p in prompts:
            chunks = list(client.generate(p, greedy, mode=mode))
            tokens[mode].append([t for c in chunks for t in c.token_ids])
            moved += chunks[-1].metadata["kv_transfer_bytes"] if mode == "disaggregated" else 0
    devices = {w["device"] for w in client.stats()}
assert tokens["disaggregated"] == tokens["colocated"] == tokens["auto"], tokens
assert all(dev.startswith("cuda") for dev in devices), devices
assert moved > 0
print(f"{gpus} workers on {gpus} GPUs; 3 modes x {len(prompts)} prompts same tokens; {moved / 2**20:.1f} MiB over NIXL")
EOF

check "disaggregated TTFT bench, CUDA, NIXL" python bench/disagg_ttft_bench.py --device cuda --transport nixl --runs 3

exit "$status"
