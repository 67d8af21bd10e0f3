"""One measured run of a peer of megatrain, on the same model, data, batch, AdamW and clipping as
scripts/bench_megatrain.py, printing the same `RESULT {json}` line.

    PYTHONPATH=. python3 scripts/peers/run_peer.py PEER --model bench-3b --batch 8 --seq 2048 --steps 4 --clip 1.0
    PYTHONPATH=. python3 scripts/peers/run_peer.py PEER --dry-run      # CPU, no GPU, no DeepSpeed needed
    # a loss curve on real text (peercurve.py), and the megatrain config of the same run (the exact reference)
    PYTHONPATH=. python3 scripts/peers/run_peer.py PEER --corpus --init megatrain --lr 3e-4 --losses L.json ...
    PYTHONPATH=. python3 scripts/peers/run_peer.py PEER --corpus ... --megatrain-toml ref.toml   # writes, exits

Peers (each with its settings in configs/PEER.json, read by peerconf.py; docs/peers.md says why each):
    all-on-gpu        the HF model, fp32 weights and AdamW state all on the GPU, bf16 autocast, fused AdamW
    fsdp2-cpuoffload  torch FSDP2 fully_shard with CPUOffloadPolicy, AdamW on the CPU
    zero3-offload     DeepSpeed ZeRO-3, parameters and optimizer offloaded to the CPU
    superoffload      DeepSpeed ZeRO-3 + SuperOffload, its single-GPU example's config (for a 72-core socket)
    superoffload-adam50, superoffload-adam75   the same with the cores split for a host of few cores
    twinflow          DeepSpeed ZeRO-3 + Twin-Flow (offload_optimizer.ratio)
    twinflow-expandable   the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (config cuda_alloc_conf)
    zenflow           DeepSpeed ZeRO-2 + ZenFlow (approximate update)
    zero2-offload     DeepSpeed ZeRO-2, optimizer offloaded to the CPU: zenflow's config, exact AdamW
    zenflow-sync      ZenFlow with overlap_step false (a control for its curve, and its fastest row here)
    zero2-offload-every4   one exact AdamW step per 4 micro-batches: a control for ZenFlow's curve, not a speed row
DeepSpeed peers run under DeepSpeed's launcher (the command is printed by --dry-run and built by scripts/bench.py);
run directly, they bind nothing and start their one-process group themselves.

What is the same as megatrain's benchmark (scripts/bench_megatrain.py):
  * model: the HF model (AutoModelForCausalLM, LlamaForCausalLM for llama presets) of megatrain's ModelSpec
    (`spec.to_hf_config()`: a preset name or an HF config directory), random init from `--seed`, sdpa attention;
  * data: 4 batches of random ids from torch.Generator().manual_seed(0), (batch, seq + 1) each; step i trains on
    batch i % 4 with inputs [:, :-1] and targets [:, 1:], the loss the mean cross-entropy over all batch x seq
    targets (HF's loss with shift_labels: no second shift). `--corpus` (or `--data FILE`): megatrain's own data
    pipeline instead, one batch per step in megatrain's order (peercurve.py);
  * init: HF's random init from `--seed`, or `--init megatrain`: megatrain's init of the same seed (peercurve.py);
  * AdamW: megatrain's AdamWConfig defaults with lr 1e-5 (`--lr`; peerconf.adamw_params), no schedule; weight
    decay on the matrices only, as megatrain's update (peercurve.decay_groups);
  * clipping: global-norm clipping at `--clip` (0 = none) the peer's own way: DeepSpeed's gradient_clipping,
    torch.nn.utils.clip_grad_norm_ for the torch peers;
  * timing: `--warmup` untimed steps (2; ZenFlow two update intervals), then `--steps` timed steps, each closed
    by torch.cuda.synchronize(); the median step (the upper one of an even count, as bench_megatrain.py takes it;
    ZenFlow and micro_steps_per_update > 1: the mean over whole update intervals, a step's time depending on its
    place in one; peerconf.steps_per_update);
    model TFLOP/s = 6·N·tokens / step (recompute not counted); peak GPU memory allocated after the warm-up.
Host memory: the RSS at the end of this process and of its children (SuperOffload runs its CPU Adam in a child
process), and their PSS (shared pages counted once), from which bytes per parameter are computed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import psutil

import peercurve  # the sibling modules: python puts this script's folder first on sys.path
import peerconf
from megatrain.units import GiB

DRY_MODEL, DRY_BATCH, DRY_SEQ, DRY_STEPS = "debug", 2, 16, 2


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peer", help="one of: " + ", ".join(peerconf.peer_names()))
    ap.add_argument("--model", default="bench-3b", help="a megatrain preset or an HF config directory")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first (default: 2; two update intervals where updates land every few steps, "
                         "peerconf.warmup_steps)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clip", type=float, default=peerconf.DEFAULT_CLIP,
                    help="max global gradient norm; 0 = no clipping")
    ap.add_argument("--seed", type=int, default=0, help="the model's random init")
    ap.add_argument("--lr", type=float, default=peerconf.DEFAULT_LR, help="AdamW's learning rate (constant)")
    ap.add_argument("--corpus", action="store_true",
                    help="train on megatrain's bundled corpus through megatrain's data pipeline (same batches, same "
                         "order as `megatrain train`) instead of 4 batches of random ids")
    ap.add_argument("--data", default="", metavar="FILE",
                    help="with --corpus: this text/.bin/.jsonl file instead of the bundled corpus (megatrain's "
                         "data.path)")
    ap.add_argument("--init", choices=("hf", "megatrain"), default="hf",
                    help="the model's first weights: HF's random init from --seed, or megatrain's (the weights "
                         "`megatrain train` starts from with model.seed = --seed)")
    ap.add_argument("--losses", metavar="FILE", help="write every step's loss (warm-up included) here, as JSON")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: run a torch peer on the CPU at the given shape (a check, not a measurement)")
    ap.add_argument("--megatrain-toml", metavar="FILE",
                    help="write the `megatrain train` config of this same run (the exact-AdamW reference: its "
                         "metrics.jsonl has every step's loss) and exit")
    ap.add_argument("--megatrain-schedule", default="", metavar="NAME",
                    help="with --megatrain-toml: megatrain's schedule (default: megatrain's default schedule)")
    ap.add_argument("--config", help="a config file instead of configs/PEER.json")
    ap.add_argument("--python", default="python3", help="the interpreter named in the printed command")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the config, print the command of the full run, then run the debug model "
                         f"({DRY_BATCH}x{DRY_SEQ}, {DRY_STEPS} steps) on the CPU where the peer can")
    ap.add_argument("--skip-memory-check", action="store_true",
                    help="run even when the peer's host or GPU memory estimate exceeds what this machine has "
                         "(peerconf.memory_refusal)")
    ap.add_argument("--zenflow-layout-fix", action="store_true",
                    help="ZenFlow only: repair DeepSpeed 0.19.8's view of ZenFlow's transposed flat weights "
                         "(scripts/peers/zenflow_layout.py); without it ZenFlow runs as DeepSpeed ships it")
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # DeepSpeed's launcher passes it
    a = ap.parse_args(argv)
    if a.peer not in peerconf.peer_names() and not a.config:
        ap.error(f"unknown peer {a.peer!r}: peers are {', '.join(peerconf.peer_names())}")
    if a.batch < 1 or a.seq < 1 or a.steps < 1 or (a.warmup or 0) < 0 or a.clip < 0 or a.lr <= 0:
        ap.error("--batch, --seq and --steps must be at least 1, --warmup and --clip at least 0, --lr above 0")
    if a.data and not a.corpus:
        ap.error("--data FILE is the text of --corpus: add --corpus")
    if a.megatrain_toml and not a.corpus:
        ap.error("--megatrain-toml writes the reference of a curve run: add --corpus (random ids are not megatrain "
                 "train's data)")
    return a


# ---- model and data ----------------------------------------------------------------------------------------------
def hf_config(spec, seq: int):
    """The transformers config of megatrain's ModelSpec (sdpa attention, positions for `seq`)."""
    from transformers import AutoConfig

    d = spec.to_hf_config()
    d.pop("architectures", None)
    d.pop("torch_dtype", None)
    d["max_position_embeddings"] = max(d.get("max_position_embeddings", 0), seq)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(spec, seq: int, seed: int, checkpointing: bool, device: str = "cpu"):
    """The HF causal LM of `spec`, fp32, on `device`, random init from `seed`. A peer that trains on the GPU builds
    it there: HF's init draws every matrix with one CPU thread, ~38 s of bench-3b's 42 s start-up on the H200
    host (docs/runs/25-peers/probe-h200), a second or two on the GPU (other values from the same seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(spec, seq), dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def batches(vocab: int, batch: int, seq: int) -> list:
    """scripts/bench_megatrain.py `bench_batches`: 4 batches of (batch, seq + 1) random ids, generator seed 0 (restated:
    DeepSpeed's launcher runs this file alone; tests/test_peers_dryrun.py ties the two)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(4)]


def split(ids, device):
    """(inputs [B, S], targets [B, S]) on `device`; contiguous, as HF's loss views the targets flat."""
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


# ---- the peers ---------------------------------------------------------------------------------------------------
def setup_torch(cfg: dict, model, device: str, clip: float, lr: float = peerconf.DEFAULT_LR):
    """all-on-gpu and fsdp2-cpuoffload: (step(x, y) -> loss, number of parameters, note)."""
    import torch

    t = cfg["torch"]
    params = sum(p.numel() for p in model.parameters())
    hp = peerconf.adamw_params(lr)
    adamw = dict(lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"], fused=t["optimizer"]["fused"])
    wd = hp["weight_decay"]  # on the matrices only (peercurve.decay_groups), as megatrain's update
    note = ""
    if "offload" in t:  # FSDP2 with CPUOffloadPolicy
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _env_one_process()
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
        mesh = init_device_mesh(device, (1,))
        mp = MixedPrecisionPolicy(**{k: getattr(torch, v) for k, v in t["mixed_precision"].items()})
        pin = t["offload"]["pin_memory"] and device == "cuda"  # pinning needs CUDA; on the CPU it means nothing
        if t["offload"]["pin_memory"] and not pin:
            note = "CPU dry run: pin_memory off (no CUDA)"
        off = CPUOffloadPolicy(pin_memory=pin)
        for layer in model.model.layers:  # one unit per decoder layer: its copies overlap the previous layer
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=off)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off)
        opt = torch.optim.AdamW(peercurve.decay_groups(model, wd), **adamw)  # on the host, with the parameters
        step = _torch_step(model, opt, clip)
    else:  # all on the GPU
        model.to(device)
        opt = torch.optim.AdamW(peercurve.decay_groups(model, wd), **adamw)
        step = _torch_step(model, opt, clip, torch.autocast(device, dtype=getattr(torch, t["autocast"])))
    return step, params, note


def _torch_step(model, opt, clip: float, autocast=None):
    """One training step of a plain torch peer: forward (under `autocast` when given), backward, clipping the way
    torch does it (`clip_grad_norm_`, when clip > 0), AdamW, gradients freed."""
    import contextlib

    import torch  # imported where used, as in the rest of this script: the dry run's config check needs no torch

    def step(x, y):
        with autocast if autocast is not None else contextlib.nullcontext():
            loss = model(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def setup_deepspeed(cfg: dict, ds_cfg: dict, spec, a):
    """The DeepSpeed peers: the engine of `ds_cfg` around the HF model; (step, number of parameters, note)."""
    import deepspeed  # only on the GPU machine (bench wheels)
    import torch

    _env_one_process()
    deepspeed.init_distributed()
    note = ""
    if ds_cfg["zero_optimization"]["stage"] == 3:  # built partitioned, as ZeRO-3 wants, never whole on one device
        with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
            model = build_model(spec, a.seq, a.seed, cfg["activation_checkpointing"])
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    else:
        model = build_model(spec, a.seq, a.seed, cfg["activation_checkpointing"])
        params = sum(p.numel() for p in model.parameters())
        if a.init == "megatrain":  # refused for ZeRO-3 in main(): its parameters are partitioned here
            note = peercurve.megatrain_init(model, spec, a.seed)
    groups = peercurve.decay_groups(model, ds_cfg["optimizer"]["params"]["weight_decay"])
    if a.zenflow_layout_fix:  # before initialize: ZeRO points the weights at its flat buffer there
        from zenflow_layout import install_layout_fix

        note = "; ".join(x for x in (note, install_layout_fix()) if x)
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_cfg, model_parameters=groups)
    # SuperOffload pins this process to the first (1 - cpuadam_cores_perc) of its cores and its CPU Adam process to
    # the rest (deepspeed/runtime/superoffload/superoffload_utils.py, _set_cpu_affinity): keep as many torch threads
    # as that leaves, not the launcher's count on fewer cores
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores))
    note = "; ".join(x for x in (note, f"training process on {cores} core(s) after DeepSpeed's setup") if x)

    def step(x, y):
        loss = engine(input_ids=x, labels=y, shift_labels=y).loss
        engine.backward(loss)
        engine.step()
        return loss
    return step, params, note


def _env_one_process():
    """A one-process group when no launcher set one up."""
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)


# ---- measuring ---------------------------------------------------------------------------------------------------
def host_memory() -> tuple[float, float | None]:
    """(RSS, PSS) in bytes of this process and its children, recursively; PSS None where it cannot be read."""
    procs = [psutil.Process()]
    procs += procs[0].children(recursive=True)
    rss, pss = 0, 0
    for p in procs:
        try:
            rss += p.memory_info().rss
            pss = None if pss is None else pss + p.memory_full_info().pss
        except (psutil.Error, AttributeError):  # a child that ended, or no PSS on this OS
            pss = None
    return float(rss), (None if pss is None else float(pss))


def measure(step, next_batch, device: str, warmup: int, steps: int, digests: list | None = None):
    """Run warm-up and timed steps, step i on `next_batch(i)` -> (inputs, targets) on the host; (step times in s,
    losses of every step). `digests`: appended the SHA-1 of every step's inputs (the data-order check)."""
    import torch

    cuda = device == "cuda"
    times, losses = [], []
    for i in range(warmup + steps):
        if i == warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        x, y = next_batch(i)
        if digests is not None:
            digests.append(peercurve.batch_sha1(x))
        x, y = x.to(device), y.to(device)
        t0 = time.perf_counter()
        loss = step(x, y)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return times, losses


def result(a, cfg, spec, params: int, times, losses, device: str, **extra) -> dict:
    """The RESULT line: scripts/bench_megatrain.py's keys, plus the config and how host memory was counted."""
    import torch

    tokens = a.batch * a.seq
    whole_intervals = peerconf.steps_per_update(cfg) > 1
    # the upper median (the middle of the sorted times, the later one of an even count), as bench_megatrain.py takes
    # it: megatrain's recorded rows use that rule, so a table of both means one thing by "median"
    median = sorted(times)[len(times) // 2] if times else None
    if times:
        step_s = statistics.mean(times) if whole_intervals else median
    rss, pss = host_memory()
    out = {
        "mode": cfg["peer"], "model": spec.name, "params_B": round(params / 1e9, 3), "batch": a.batch, "seq": a.seq,
        "clip": a.clip, "median_step_s": round(median, 4) if times else None,
        "step_s_used": "mean over whole update intervals" if whole_intervals else "median",
        "tokens_per_s": round(tokens / step_s, 1) if times else None,
        "model_TFLOPs": round(spec.model_flops_per_token() * tokens / step_s / 1e12, 1) if times else None,
        "loss_first": round(losses[0], 4) if losses else None, "loss_last": round(losses[-1], 4) if losses else None,
        "peak_gpu_GiB": round(torch.cuda.max_memory_allocated() / GiB, 2) if device == "cuda" else 0.0,
        "host_rss_GiB": round(rss / GiB, 2), "host_pss_GiB": None if pss is None else round(pss / GiB, 2),
        "host_B_per_param": round((pss if pss is not None else rss) / params, 2),
        "exact_adamw": cfg["exact_adamw"], "config": os.path.relpath(cfg["_file"]),
        "settings": peerconf.settings_summary(cfg, a.clip), "step_times_s": [round(t, 4) for t in times],
    }
    if params != spec.num_params:  # the HF model should have exactly the spec's parameters: say so if not
        out["params_note"] = f"HF model {params} params, megatrain's spec {spec.num_params} (TFLOP/s from the spec)"
    out.update(extra)
    return out


def batch_source(a, spec):
    """(next_batch(i) -> (inputs, targets) on the host, a description): random ids or megatrain's corpus loader."""
    if not a.corpus:
        data = batches(spec.vocab_size, a.batch, a.seq)
        return (lambda i: split(data[i % 4], "cpu")), "4 batches of random ids (generator seed 0)"
    loaded = peercurve.open_corpus(spec, a.batch, a.seq, a.data)

    def next_batch(i):  # one batch per step, in megatrain's order: the loader's cursor advances
        b = loaded.train.next_batch()
        return b.inputs, b.targets
    return next_batch, loaded.describe().replace("\n", "; ")


def run_steps(a, cfg, ds_cfg, spec, device: str, **extra) -> dict:
    """Build the peer on `device`, run --warmup + --steps steps, write --losses; the RESULT dict."""
    next_batch, data_note = batch_source(a, spec)  # before the model: a data error costs no model build
    t0 = time.perf_counter()
    if ds_cfg:
        step, params, note = setup_deepspeed(cfg, ds_cfg, spec, a)
    else:
        # built on the GPU (build_model: HF's init on the host is most of a process's start-up); FSDP2 with CPU
        # offload then takes the whole model to the host before sharding it, so both torch peers start from the
        # same values and the offloaded one never holds it on the GPU while it trains
        model = build_model(spec, a.seq, a.seed, cfg["activation_checkpointing"], device)
        init_note = peercurve.megatrain_init(model, spec, a.seed) if a.init == "megatrain" else ""
        if "offload" in cfg["torch"] and device != "cpu":
            import torch

            model.to("cpu")
            torch.cuda.empty_cache()
        step, params, note = setup_torch(cfg, model, device, a.clip, a.lr)
        note = "; ".join(n for n in (init_note, note) if n)
    init_s = time.perf_counter() - t0
    print(f"{cfg['peer']}: {params / 1e9:.3f} B params, init {init_s:.0f} s; data {data_note}", file=sys.stderr,
          flush=True)
    digests: list[str] = []
    times, losses = measure(step, next_batch, device, a.warmup, a.steps, digests)
    if a.losses:
        peercurve.write_losses(a.losses, losses, a.warmup, digests)
    return result(a, cfg, spec, params, times, losses, device, init_s=round(init_s, 1), lr=a.lr, init=a.init,
                  data=data_note, **({"note": note} if note else {}), **extra)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        cfg = peerconf.load(a.peer, a.config)
    except peerconf.PeerConfigError as e:
        print(f"run_peer: {e}", file=sys.stderr)
        return 2
    conf = peerconf.cuda_alloc_conf(cfg)
    if conf:  # read by PyTorch's CUDA allocator when it first allocates, which is after this in this process
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    if a.warmup is None:
        a.warmup = peerconf.warmup_steps(cfg)
    zen = peerconf.zenflow(cfg)
    if a.zenflow_layout_fix and not zen:
        print(f"run_peer: --zenflow-layout-fix repairs ZenFlow's weight layout; {a.peer} has no zenflow section",
              file=sys.stderr)
        return 2
    interval = peerconf.steps_per_update(cfg)
    if not a.dry_run and a.steps % interval:
        print(f"run_peer: {a.peer} updates every {interval} steps: --steps must be a multiple of it "
              f"(got {a.steps}) so the timed steps hold whole intervals", file=sys.stderr)
        return 2
    ds_cfg = peerconf.deepspeed_config(cfg, a.batch, a.clip, a.lr) if "deepspeed" in cfg else None
    if ds_cfg and a.init == "megatrain" and ds_cfg["zero_optimization"]["stage"] == 3:
        print("run_peer: --init megatrain loads whole tensors, which ZeRO-3 partitions as it builds the model: use it "
              "with the torch peers or ZeRO-2 (zenflow)", file=sys.stderr)
        return 2
    if ds_cfg and a.device == "cpu" and not a.dry_run and not a.megatrain_toml:
        print(f"run_peer: {a.peer} runs on DeepSpeed, which needs CUDA: --device cpu is for the torch peers",
              file=sys.stderr)
        return 2
    try:
        checked = peerconf.validate_with_deepspeed(ds_cfg) if ds_cfg else "torch peer: our schema"
    except peerconf.PeerConfigError as e:
        print(f"run_peer: {os.path.relpath(cfg['_file'])}: {e}", file=sys.stderr)
        return 2
    full = ["--model", a.model, "--batch", str(a.batch), "--seq", str(a.seq), "--warmup", str(a.warmup),
            "--steps", str(a.steps), "--clip", f"{a.clip:g}"]
    if a.corpus:  # the curve run's own settings, so that the printed command repeats it
        full += ["--corpus", *(["--data", a.data] if a.data else []), "--init", a.init, "--lr", f"{a.lr:g}"]
    elif a.lr != peerconf.DEFAULT_LR or a.init != "hf":
        full += ["--lr", f"{a.lr:g}", "--init", a.init]
    if a.zenflow_layout_fix:
        full.append("--zenflow-layout-fix")
    command = peerconf.command_line(peerconf.launch_argv(cfg, full, a.python))
    from megatrain.data.errors import DataError  # needs PYTHONPATH=. (the repository root), as bench_megatrain
    from megatrain.model.presets import get_model

    if a.megatrain_toml:  # the exact-AdamW reference of this run: a file, no training here
        try:
            ref = peercurve.megatrain_config(a, peerconf.adamw_params(a.lr), a.megatrain_schedule)
        except (DataError, ValueError) as e:  # megatrain's ConfigError is a ValueError: one line, what to change
            print(f"run_peer: {e}", file=sys.stderr)
            return 2
        os.makedirs(os.path.dirname(os.path.abspath(a.megatrain_toml)), exist_ok=True)
        with open(a.megatrain_toml, "w") as f:
            f.write(f"# the exact-AdamW reference of: {command}\n# megatrain train --config {a.megatrain_toml}\n")
            f.write(ref.to_toml())
        print(f"wrote {a.megatrain_toml}: megatrain train --config {a.megatrain_toml} writes every step's loss "
              f"to {ref.run.run_dir / 'metrics.jsonl'}")
        return 0
    import torch

    try:
        if a.dry_run:
            print(f"config {os.path.relpath(cfg['_file'])}: {checked}")
            print(f"settings: {peerconf.settings_summary(cfg, a.clip)}")
            if ds_cfg:
                print("deepspeed config: " + json.dumps(ds_cfg, sort_keys=True))
            print(f"command: {command}")
            a.model, a.batch, a.seq, a.steps, a.warmup = DRY_MODEL, DRY_BATCH, DRY_SEQ, DRY_STEPS, 0
            spec = get_model(a.model)
            if ds_cfg:  # DeepSpeed needs CUDA (SuperOffload asserts it): the config and the model are checked
                batch_source(a, spec)
                model = build_model(spec, a.seq, a.seed, cfg["activation_checkpointing"])
                if a.init == "megatrain":
                    peercurve.megatrain_init(model, spec, a.seed)
                params = sum(p.numel() for p in model.parameters())
                out = result(a, cfg, spec, params, [], [], "cpu", dry_run=True, steps_run=0, checked=checked,
                             command=command, note="DeepSpeed peer: config and model built, no steps on the CPU")
            else:
                out = run_steps(a, cfg, None, spec, "cpu", dry_run=True, steps_run=a.steps, checked=checked,
                                command=command)
        elif a.device == "cpu":
            out = run_steps(a, cfg, None, get_model(a.model), "cpu", steps_run=a.steps, checked=checked,
                            command=command, note_device="CPU check run: no speed claim")
        elif not torch.cuda.is_available():
            print("run_peer: no CUDA device: a measured run needs the GPU machine (use --dry-run on the CPU)",
                  file=sys.stderr)
            return 2
        else:
            torch.cuda.set_device(0)
            spec = get_model(a.model)
            refusal = None if a.skip_memory_check else peerconf.memory_refusal(
                cfg, spec.name, spec.num_params, psutil.virtual_memory().available, torch.cuda.mem_get_info()[0],
                tokens=a.batch * a.seq, vocab=spec.vocab_size)
            if refusal:  # before the model is built: a host that runs out kills the process, or its neighbours
                print(f"run_peer: {refusal}", file=sys.stderr)
                return 3
            torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core the launcher's binding leaves us
            out = run_steps(a, cfg, ds_cfg, spec, "cuda", checked=checked, command=command)
    except DataError as e:
        print(f"run_peer: {e}", file=sys.stderr)
        return 2
    print("RESULT " + json.dumps(out), flush=True)
    _close_group()
    return 0


def _close_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
