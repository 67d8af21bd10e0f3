"""MegaTrain authors' own single-GPU trainer as a measured peer, timed like shared/bench/baseline_train.py.

This harness is ours (it began as shared/bench/megatrain_repo/peer.py); their code is not in this repository: it is
imported from PYTHONPATH, a checkout of github.com/DLYuanGod/MegaTrain @ 919520f (docs/peers.md gives the fetch
command; shared/bench/megatrain_repo holds the files it imports, byte for byte). `scripts/bench.py --configs
authors` runs it as they ship it, `authors-fixed` with `--record-head-grad-streams` (below).
The step is the loop body of their examples/sft/train.py (gradient_accumulation_steps 1):
    loss, _, timing = model.forward_and_backward(input_ids, attention_mask, labels)
    torch.nn.utils.clip_grad_norm_(model.get_parameters(), max_grad_norm)
    optimizer.step()                      # DeepSpeedCPUAdam on the host
    model._sync_params_to_gpu()
    model.zero_grad(); optimizer.zero_grad()
with the settings of their examples/sft/configs/llama3_8b.yaml (copied to upstream/): dtype bfloat16,
checkpoint_interval 4, num_grad_slabs 12, optimizer deepspeed_adam (torch AdamW when deepspeed cannot be
imported, as train.py does), lr 2e-5, weight_decay 0.01, betas 0.9/0.999, eps 1e-8, max_grad_norm 1.0.

Ours, and why:
  * model: LlamaForCausalLM built from the same LlamaConfig as baseline_train.py (random init, untied, vocab 32000),
    on the host in bfloat16 -- train.py does from_pretrained(torch_dtype=config.dtype=bf16, device_map="cpu"), so
    their CPU master copy, gradients and pinned weight buffers are all bf16 (their code cannot mix an fp32 master
    with bf16 buffers: the bf16 gradient slab would be assigned as .grad of an fp32 parameter).
  * data: random token ids (batch x seq, labels = input ids, attention mask all ones) instead of their ChatDataset;
    the same tokens as baseline_train.py (seed 0, generated on the GPU), handed over on the host as their
    DataLoader does.
  * attention mask: CPUMasterModel hands the raw 2-D [B, T] padding mask to every decoder layer. Only
    flash_attention_2 (their configs' setting; not installed on the device) reads a 2-D mask; HF's sdpa passes it
    to F.scaled_dot_product_attention, which raises for an int mask (a bool one would at best act as a
    non-causal key mask). PeerCPUMasterModel passes None instead, which is exactly what HF LlamaModel itself
    passes under sdpa when there is no padding: sdpa then runs with is_causal=True, the same attention call as
    baseline_train.py's HF model makes. Nothing else of CPUMasterModel is overridden (cpu_check.py: with it,
    their fp32 loss and every gradient equal HF's; without it, the first layer raises).
  * `--record-head-grad-streams` (off by default; the `authors-fixed` config): a fix of a likely bug of theirs, not
    their behaviour. cpu_master.py copies the GPU lm_head / final-norm / embedding gradients to the host on its
    grad_stream (non_blocking) and drops them (`p_gpu.grad = None`, cpu_master.py:1398-1410, 1520-1526) without
    the `record_stream(grad_stream)` it makes for the layers' gradients (:959), so the caching allocator may hand
    that memory to the backward's recompute on the compute stream before the copy has read it. On an H100
    (2026-11-27) their trainer ran its first step at grad norm 7.75 and every later one at NaN. The flag makes that
    record_stream call from a post-accumulate-grad hook on those GPU parameters; no arithmetic or copy changes.
    Not yet run on a GPU: the warm-up's gradient check below says whether it was the cause.
  * the warm-up steps (untimed) check every parameter group's gradients for NaN/inf before clipping and report the
    groups that hold any (`nonfinite_grads_warmup`): one NaN makes clip_grad_norm_ multiply every gradient by NaN.
  * timing and the RESULT line: as baseline_train.py (2 warm-up steps, median of the timed steps, each step closed
    by torch.cuda.synchronize(), peak GPU memory after the warm-up, host RSS at the end), plus extra keys.

usage: PYTHONPATH=<their checkout> python scripts/peers/authors_peer.py [--layers 28 --hidden 3072 --ffn 8192
           --batch 8 --seq 2048 --warmup 2 --steps 4] [--record-head-grad-streams]
Prints one line: RESULT {json}. Progress goes to stderr.
"""
import argparse
import json
import logging
import os
import sys
import time
import types

# examples/sft/train.py sets this right after importing torch, before any CUDA allocation.
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import psutil  # noqa: E402
import torch  # noqa: E402

# examples/sft/configs/llama3_8b.yaml, written out so that no YAML parser is needed
LLAMA3_8B_YAML = {
    "dtype": torch.bfloat16,
    "learning_rate": 2.0e-5,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "seed": 42,
    "optimizer": "deepspeed_adam",
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1.0e-8,
    "checkpoint_interval": 4,
    "num_grad_slabs": 12,
}


def build_config(a):
    """Verbatim from shared/bench/baseline_train.py: the same model shape."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 128,
        num_key_value_heads=max(1, a.hidden // 128 // 4),
        vocab_size=32000,
        max_position_embeddings=a.seq,
        torch_dtype="float32",
        attn_implementation="sdpa",
    )


def import_infinity():
    """Import CPUMasterModel / CPUMasterConfig from the copied package without its unused optional deps.

    - `datasets`: not needed: infinity/data/datasets.py imports it only inside its loader functions.
    - `yaml`: infinity/config/__init__.py imports yaml_loader, which does `import yaml` at module level, and
      importing CPUMasterModel runs that __init__ (cpu_master.py imports infinity.config.training). pyyaml comes
      with transformers and should be there; if it is not, a stub stands in: nothing here reads a YAML file.
    - flash_attn: cpu_master.py tries it for its cross-entropy and falls back to torch's on ImportError.
    - the C++/CUDA extensions (csrc/memory_ops.cpp, infinity/cuda_pipeline): never imported by cpu_master.py.
    """
    try:
        import yaml  # noqa: F401
    except ImportError:
        stub = types.ModuleType("yaml")

        def _unavailable(*_a, **_k):
            raise RuntimeError("pyyaml is not installed (stub from peer.py); peer.py reads no YAML")

        stub.safe_load = _unavailable
        sys.modules["yaml"] = stub
    from infinity.config.training import CPUMasterConfig
    from infinity.model import cpu_master
    from infinity.model.cpu_master import CPUMasterModel

    return CPUMasterModel, CPUMasterConfig, cpu_master


def peer_class(CPUMasterModel, record_head_grad_streams: bool = False):
    """CPUMasterModel with the decoder layers' attention mask set to None, and with `record_head_grad_streams` the
    head and embedding gradients kept alive for their copy on grad_stream (see module docstring)."""

    class PeerCPUMasterModel(CPUMasterModel):
        def __init__(self, hf_model, config):
            super().__init__(hf_model, config)
            if record_head_grad_streams and not self.use_multiprocessing:
                ctx = self.gpu_contexts[0]
                for mod in (ctx.lm_head_gpu, ctx.norm_gpu, ctx.emb_gpu):
                    for p in (mod.parameters() if mod is not None else ()):
                        # what cpu_master.py:959 does for a layer's gradients before dropping them
                        p.register_post_accumulate_grad_hook(
                            lambda q, stream=ctx.grad_stream: q.grad.record_stream(stream))

        def _build_layer_kwargs(self, mask, cache_position, position_ids, position_embeddings):
            kwargs = super()._build_layer_kwargs(mask, cache_position, position_ids, position_embeddings)
            kwargs["attention_mask"] = None  # no padding: HF sdpa -> is_causal=True, as LlamaModel does
            return kwargs

    return PeerCPUMasterModel


def nonfinite_grads(model) -> list[str]:
    """Names of the host parameter groups whose gradients hold NaN or inf (checked before clipping)."""
    groups = [("embedding", model.embedding), ("lm_head", model.lm_head), ("final_norm", model.norm)]
    groups += [(f"layer{i}", layer) for i, layer in enumerate(model.cpu_layers)]
    return [name for name, mod in groups if mod is not None and any(
        p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in mod.parameters())]


def build_hf_model(cfg, dtype=torch.bfloat16):
    """Random-init LlamaForCausalLM on the host in `dtype`, as from_pretrained(torch_dtype=dtype) would build it."""
    from transformers import LlamaForCausalLM

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != dtype})
    if bad:
        raise RuntimeError(f"parameters not in {dtype}: {bad}")
    model.train()
    return model


def make_master_config(CPUMasterConfig, a, dtype=None):
    y = LLAMA3_8B_YAML
    return CPUMasterConfig(
        model_name="random-init LlamaForCausalLM (baseline_train.py shape)",
        device=0,
        dtype=dtype if dtype is not None else y["dtype"],
        attn_implementation="sdpa",  # flash_attention_2 in their configs; not installed on the device
        trust_remote_code=False,
        dataset_path="(random token ids; never read)",  # __post_init__ insists on a dataset
        max_seq_len=a.seq,
        batch_size=a.batch,
        gradient_accumulation_steps=1,
        num_steps=a.warmup + a.steps,
        learning_rate=y["learning_rate"],
        weight_decay=y["weight_decay"],
        max_grad_norm=a.max_grad_norm,
        seed=y["seed"],
        beta1=y["beta1"],
        beta2=y["beta2"],
        eps=y["eps"],
        checkpoint_interval=a.checkpoint_interval,
        num_grad_slabs=a.num_grad_slabs,
        log_interval=1,
        enable_timing=True,
    )


def make_optimizer(model, mcfg, choice="deepspeed_adam"):
    """As examples/sft/train.py: DeepSpeedCPUAdam(adamw_mode=True) if deepspeed imports, else torch AdamW.

    train.py would crash if DeepSpeedCPUAdam imports but its op fails to build; here that falls back to torch
    AdamW too, and the reason is reported, so one device run still yields a (labelled) number.
    """
    params = model.get_parameters()
    note = ""
    if choice == "deepspeed_adam":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except ImportError as e:
            DeepSpeedCPUAdam = None
            note = f" (deepspeed not importable: {type(e).__name__}: {e})"
        if DeepSpeedCPUAdam is not None:
            try:
                opt = DeepSpeedCPUAdam(
                    params,
                    lr=mcfg.learning_rate,
                    betas=(mcfg.beta1, mcfg.beta2),
                    eps=mcfg.eps,
                    weight_decay=mcfg.weight_decay,
                    adamw_mode=True,
                )
                return opt, "DeepSpeedCPUAdam"
            except Exception as e:  # the cpu_adam op JIT build failed
                cause = e.__cause__ or e
                note = f" (DeepSpeedCPUAdam failed: {type(cause).__name__}: {str(cause)[:300]})"
    opt = torch.optim.AdamW(
        params, lr=mcfg.learning_rate, betas=(mcfg.beta1, mcfg.beta2), eps=mcfg.eps, weight_decay=mcfg.weight_decay
    )
    return opt, "torch.optim.AdamW" + note


def train_step(model, optimizer, ids, mask, max_grad_norm, check_grads=False):
    """One optimizer step, as the loop body of examples/sft/train.py with gradient_accumulation_steps = 1.
    `check_grads` (warm-up steps only: it is not timed apart) names the groups with non-finite gradients."""
    t0 = time.perf_counter()
    loss_val, _n_tokens, timing = model.forward_and_backward(ids, mask, ids)  # labels = input ids
    bad = nonfinite_grads(model) if check_grads else []
    t1 = time.perf_counter()
    grad_norm = None
    if max_grad_norm and max_grad_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.get_parameters(), max_grad_norm))
    t2 = time.perf_counter()
    optimizer.step()
    t3 = time.perf_counter()
    model._sync_params_to_gpu()
    model.zero_grad()
    optimizer.zero_grad()
    t4 = time.perf_counter()
    return {
        "loss": float(loss_val),
        "grad_norm": grad_norm,
        "fwd_gpu_s": float(timing.get("forward", 0.0)),  # their CUDA-event timings
        "bwd_gpu_s": float(timing.get("backward", 0.0)),
        "fwd_bwd_s": t1 - t0,  # wall: forward_and_backward incl. its final synchronize and grad-queue join
        "clip_s": t2 - t1,
        "optimizer_s": t3 - t2,
        "sync_zero_s": t4 - t3,  # _sync_params_to_gpu + zero_grad x2
        "nonfinite_grads": bad,
    }


def run(a):
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s [%(levelname)s] %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    CPUMasterModel, CPUMasterConfig, cpu_master = import_infinity()
    Peer = peer_class(CPUMasterModel, a.record_head_grad_streams)

    torch.manual_seed(0)
    cfg = build_config(a)
    dev = torch.device("cuda")
    tokens = a.batch * a.seq
    data = [torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=dev) for _ in range(4)]  # as baseline
    data = [d.cpu() for d in data]  # their DataLoader hands host tensors to forward_and_backward
    import transformers

    print(f"[peer] torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name()}, {os.cpu_count()} cpus", file=sys.stderr, flush=True)
    mask = torch.ones_like(data[0])

    t_init = time.perf_counter()
    hf_model = build_hf_model(cfg, LLAMA3_8B_YAML["dtype"])
    print(f"[peer] built model in {time.perf_counter() - t_init:.1f}s", file=sys.stderr, flush=True)
    mcfg = make_master_config(CPUMasterConfig, a)
    model = Peer(hf_model, mcfg)
    del hf_model
    nparam = sum(p.numel() for p in model.get_parameters())
    t_opt = time.perf_counter()
    optimizer, opt_name = make_optimizer(model, mcfg, a.optimizer)
    init_s = time.perf_counter() - t_init
    print(
        f"[peer] {nparam / 1e9:.3f}B params, optimizer {opt_name} ({time.perf_counter() - t_opt:.1f}s), "
        f"init {init_s:.1f}s",
        file=sys.stderr,
        flush=True,
    )

    def log(i, kind, r):
        gn = "-" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
        print(
            f"[peer] step {i} {kind}: loss {r['loss']:.4f} | step {r['step_s']:.3f}s = fwd+bwd {r['fwd_bwd_s']:.3f}"
            f" (gpu fwd {r['fwd_gpu_s']:.3f}, bwd {r['bwd_gpu_s']:.3f}) + clip {r['clip_s']:.3f}"
            f" + opt {r['optimizer_s']:.3f} + sync {r['sync_zero_s']:.3f} | grad_norm {gn}",
            file=sys.stderr,
            flush=True,
        )

    losses, nonfinite = [], {}
    for i in range(a.warmup):
        ts = time.perf_counter()
        r = train_step(model, optimizer, data[i % 4], mask, a.max_grad_norm, check_grads=True)
        torch.cuda.synchronize()
        r["step_s"] = time.perf_counter() - ts
        losses.append(r["loss"])
        log(i, "warmup", r)
        if r["nonfinite_grads"]:
            nonfinite[str(i)] = r["nonfinite_grads"]
            print(f"[peer] warm-up step {i}: non-finite gradients in {', '.join(r['nonfinite_grads'])}",
                  file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step_times, rows = [], []
    for i in range(a.steps):
        ts = time.perf_counter()
        r = train_step(model, optimizer, data[i % 4], mask, a.max_grad_norm)
        torch.cuda.synchronize()
        r["step_s"] = time.perf_counter() - ts
        step_times.append(r["step_s"])
        rows.append(r)
        losses.append(r["loss"])
        log(i, "timed", r)
    dt = time.perf_counter() - t0
    step_times.sort()
    med = step_times[len(step_times) // 2]
    flops = 6 * nparam * tokens  # model flops, recompute not counted

    def median(key):
        v = sorted(x[key] for x in rows if x[key] is not None)
        return round(v[len(v) // 2], 3) if v else None

    clip = a.max_grad_norm if a.max_grad_norm and a.max_grad_norm > 0 else None
    out = {
        "mode": a.mode,
        "params_B": round(nparam / 1e9, 3),
        "batch": a.batch,
        "seq": a.seq,
        "median_step_s": round(med, 3),
        "tokens_per_s": round(tokens / med, 1),
        "model_TFLOPs": round(flops / med / 1e12, 1),
        "mean_step_s": round(dt / a.steps, 3),
        "loss": round(float(losses[-1]), 4),
        "peak_gpu_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "host_rss_GiB": round(psutil.Process().memory_info().rss / 2**30, 2),
        # extras (not in baseline_train.py)
        "loss_first": round(float(losses[0]), 4),
        "optimizer": opt_name,
        "master_dtype": str(mcfg.dtype).replace("torch.", ""),
        "grad_clip": clip,
        "clipped_steps": (
            f"{sum(1 for x in rows if x['grad_norm'] is not None and x['grad_norm'] > clip)}/{len(rows)}"
            if clip
            else "off"
        ),
        "grad_norm_median": median("grad_norm"),
        "phase_median_s": {
            k: median(k) for k in ("fwd_bwd_s", "fwd_gpu_s", "bwd_gpu_s", "clip_s", "optimizer_s", "sync_zero_s")
        },
        "checkpoint_interval": mcfg.checkpoint_interval,
        "num_grad_slabs": mcfg.num_grad_slabs,
        "attn": "sdpa, layer mask None (is_causal)",
        "flash_ce": bool(cpu_master.FLASH_CE_AVAILABLE),
        "init_s": round(init_s, 1),
        "upstream": "DLYuanGod/MegaTrain@919520f",
        "head_grad_record_stream": bool(a.record_head_grad_streams),  # our fix of theirs (module docstring)
        "nonfinite_grads_warmup": nonfinite,  # {warm-up step: groups with NaN/inf gradients before clipping}
    }
    print("RESULT " + json.dumps(out), flush=True)
    model.cleanup()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="megatrain-repo", help="label for the RESULT line only")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=LLAMA3_8B_YAML["max_grad_norm"],
        help="their default 1.0 (clip_grad_norm_ every step); 0 skips clipping (not their behaviour)",
    )
    p.add_argument("--optimizer", choices=("deepspeed_adam", "adamw"), default=LLAMA3_8B_YAML["optimizer"])
    p.add_argument("--checkpoint-interval", type=int, default=LLAMA3_8B_YAML["checkpoint_interval"])
    p.add_argument("--num-grad-slabs", type=int, default=LLAMA3_8B_YAML["num_grad_slabs"])
    p.add_argument("--record-head-grad-streams", action="store_true",
                   help="our fix of their head/embedding gradient copies (module docstring); off: as they ship it")
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
