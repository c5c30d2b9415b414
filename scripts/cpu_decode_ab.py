"""CPU decode of the default model (float16): this session's CPU path (projections merged, float16 attention
computed in float32) against the previous one (separate projections, torch's float16 SDPA), two engines in one
process, runs interleaved (the 2-core machine is shared and noisy). python scripts/cpu_decode_ab.py"""
import time, torch, statistics
import torch.nn.functional as F
from verispec.bench.build import load_target
from verispec.config import EngineConfig
from verispec.engine.engine import Engine
from verispec.sampling.params import SamplingParams
from verispec.models.layers import attention as att
new_sdpa = att.sdpa
def old_sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
engines = {}
for new in (True, False):
    t = load_target("smollm2", torch.device("cpu"), torch.float16)
    engines[new] = Engine(t.model, t.tokenizer, EngineConfig(model="smollm2", max_num_seqs=4, max_model_len=1024,
                                                             kv_cache_gb=0.5, fuse_small_ops=new))
_, ids = t.tokenizer.chat_prompt_ids([{"role": "user", "content": "Tell me a long story about a robot."}])
p = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
res = {True: [], False: []}
for e in engines.values(): e.generate_all(ids, p)
for r in range(10):
    for new, e in engines.items():
        att.sdpa = new_sdpa if new else old_sdpa
        t0 = time.perf_counter(); e.generate_all(ids, p); res[new].append(100 / (time.perf_counter() - t0))
for k, v in res.items(): print("new" if k else "old", "median tok/s", round(statistics.median(v), 1), [round(x, 1) for x in v])
