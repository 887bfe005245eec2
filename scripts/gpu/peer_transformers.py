#!/usr/bin/env python3
"""The issue-6 peer measured on the machine that runs our benchmark: Hugging Face transformers'
Qwen3-MoE (the peer model of bench/gpu/bench_model_gpu.cpp: vocab 32000, hidden 2048, 8 layers, 64
experts top-8, moe_intermediate 768, 32 q / 4 kv heads, head_dim 128, untied; random BF16 weights
from transformers' own initializer) run the way a user of transformers runs it:

  decode   model.generate, greedy, 128-token prompts of random ids, 128 new tokens, batch 1 / 16 / 64:
           new tokens / wall seconds of the whole call (prefill included), as our "new tok/s"
  prefill  one forward of 16 x 1024 tokens, logits of the last position only (as generate's prefill)
  train    one step on 8 x 1024 tokens: forward with labels (mean CE), backward, torch.optim.AdamW
           (BF16 parameters and states), best of 3 after a warm-up step

Writes a JSON object to --out; bench_model_gpu --peer FILE puts it beside our numbers (the issue's
figures, 20 / 310 / 905, 184k and 47k tok/s on the same H200, are its fallback).

  python3 scripts/gpu/peer_transformers.py --out peer.json [--quick]
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="16 new tokens a batch, one timed training step")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if not torch.cuda.is_available():
        sys.exit("peer_transformers: no CUDA device")
    torch.manual_seed(a.seed)
    # transformers 5 names (as config.json of the fixture tiny_qwen3moe_a, saved by 5.17)
    cfg = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_local_experts=64, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=4096,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if getattr(cfg, "num_local_experts", getattr(cfg, "num_experts", None)) != 64:
        sys.exit("peer_transformers: this transformers did not take num_local_experts=64")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    nparam = sum(p.numel() for p in model.parameters())
    dev = torch.cuda.get_device_name(0)
    print(f"peer: transformers {transformers.__version__}, torch {torch.__version__}, {dev}, "
          f"{nparam / 1e9:.3f}B parameters", flush=True)
    res = {"transformers": transformers.__version__, "torch": torch.__version__, "device": dev,
           "parameters": nparam, "decode": {}}
    g = torch.Generator(device="cuda").manual_seed(a.seed)

    def ids(b, n):
        return torch.randint(1, cfg.vocab_size, (b, n), device="cuda", generator=g)

    def sync_time(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    new = 16 if a.quick else 128
    model.eval()
    for b in (1, 16, 64):  # bench_model_gpu --peer reads all three
        x = ids(b, 128)
        kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            model.generate(x, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up at this batch
            sec, out = sync_time(lambda: model.generate(x, max_new_tokens=new, min_new_tokens=new, **kw))
        made = (out.shape[1] - x.shape[1]) * b
        res["decode"][str(b)] = made / sec
        print(f"peer: decode batch {b}: {made} new tokens in {sec:.2f} s = {made / sec:.1f} tok/s", flush=True)

    x = ids(16, 1024)
    with torch.inference_mode():
        model(x, logits_to_keep=1)  # warm-up
        best = min(sync_time(lambda: model(x, logits_to_keep=1))[0] for _ in range(3))
    res["prefill"] = x.numel() / best
    print(f"peer: prefill 16 x 1024: {best * 1e3:.1f} ms = {x.numel() / best:.0f} tok/s", flush=True)

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = ids(8, 1024)

    def step():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step()  # warm-up (AdamW's states)
    times = [sync_time(step)[0] for _ in range(1 if a.quick else 3)]
    res["train"] = x.numel() / min(times)
    print(f"peer: training step 8 x 1024: {min(times) * 1e3:.1f} ms = {res['train']:.0f} tok/s "
          f"(peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
