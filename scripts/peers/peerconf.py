"""The peers' configurations: one JSON file per peer in configs/, read, checked and completed here.

A config file holds only what is the peer's own (its engine settings, the launcher it wants, why). What must be the
same for every system is filled in from the command line and megatrain's `AdamWConfig` when a run starts: the
micro-batch, the clipping max norm and the AdamW hyper-parameters. A file that sets any of those itself is refused,
so a peer can never drift from megatrain's numerics by its config.

File format (every key required unless marked):

    peer                     the peer's name (= the file's stem)
    system                   one line: what runs
    exact_adamw              true when the update is torch.optim.AdamW's math on fp32 masters (ZenFlow: false)
    why                      why these settings: the peer's docs' recommendation for speed, and its caveats
    sources                  where the settings come from
    launcher                 {"kind": "python", "threads": "affinity"} or
                             {"kind": "deepspeed", "bind_cores_to_rank": true|false}
    activation_checkpointing whether the HF model recomputes each decoder layer in the backward
    torch | deepspeed        the engine settings (torch peers: weights, autocast or mixed_precision, offload,
                             optimizer.fused; DeepSpeed peers: a DeepSpeed config without batch, clipping, optimizer)
    micro_steps_per_update   (optional, DeepSpeed peers without ZenFlow; default 1) micro-batches whose mean gradient
                             one optimizer step applies (DeepSpeed's gradient_accumulation_steps): a control run
                             with as many full updates as ZenFlow makes (one per update_interval), each exact
    cuda_alloc_conf          (optional) PYTORCH_CUDA_ALLOC_CONF for the training process, e.g.
                             "expandable_segments:True": a peer that runs out of GPU memory with its memory
                             fragmented gets the allocator setting the MegaTrain authors' trainer ships with
"""
from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG_DIR = HERE / "configs"
RUNNER = "scripts/peers/run_peer.py"  # relative to the repository root, where bench.py runs

TOP_KEYS = {"peer", "system", "exact_adamw", "why", "sources", "launcher", "activation_checkpointing"}
OPTIONAL_KEYS = {"micro_steps_per_update", "cuda_alloc_conf"}
ENGINES = {"torch", "deepspeed"}
# Filled in at run time from the command line and AdamWConfig: a config that sets them is refused.
DS_FILLED = {"train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
             "gradient_clipping", "optimizer"}
# The DeepSpeed top-level keys these configs may use (all present in the 0.19.8 wheel's DeepSpeedConfig).
DS_TOP = {"bf16", "zero_optimization", "steps_per_print", "wall_clock_breakdown"}
TORCH_KEYS = {"weights", "autocast", "mixed_precision", "offload", "optimizer"}


class PeerConfigError(ValueError):
    """A config file that is not what this module expects; the message says what to change."""


def peer_names() -> list[str]:
    """Every peer with a config file, in file-name order."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load(peer: str, path: str | Path | None = None) -> dict:
    """The checked config of `peer` (from `path`, default configs/<peer>.json)."""
    p = Path(path) if path else CONFIG_DIR / f"{peer}.json"
    if not p.is_file():
        raise PeerConfigError(f"no config for peer {peer!r} at {p}: peers are {', '.join(peer_names())}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise PeerConfigError(f"{p}: not valid JSON ({e})") from None
    check(cfg, p.name)
    cfg["_file"] = str(p)
    return cfg


def check(cfg: dict, where: str = "config") -> None:
    """Our schema (module docstring); one PeerConfigError naming the first problem."""
    missing = sorted(TOP_KEYS - cfg.keys())
    engines = sorted(ENGINES & cfg.keys())
    if missing:
        raise PeerConfigError(f"{where}: missing key(s) {', '.join(missing)}")
    if len(engines) != 1:
        raise PeerConfigError(f"{where}: needs exactly one of 'torch' or 'deepspeed', has {engines or 'none'}")
    extra = sorted(cfg.keys() - TOP_KEYS - OPTIONAL_KEYS - ENGINES - {"_file"})
    if extra:
        raise PeerConfigError(f"{where}: unknown key(s) {', '.join(extra)}")
    launcher = cfg["launcher"]
    if "micro_steps_per_update" in cfg:
        n = cfg["micro_steps_per_update"]
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1) or "deepspeed" not in cfg or zenflow(cfg):
            raise PeerConfigError(f"{where}: micro_steps_per_update must be an integer >= 1 of a DeepSpeed peer "
                                  f"without ZenFlow (ZenFlow sets its own from update_interval); it is {n!r}")
    if "cuda_alloc_conf" in cfg:
        conf = cfg["cuda_alloc_conf"]
        if not (isinstance(conf, str) and conf and all(len(kv.split(":")) == 2 and all(kv.split(":"))
                                                       for kv in conf.split(","))):
            raise PeerConfigError(f"{where}: cuda_alloc_conf must be PYTORCH_CUDA_ALLOC_CONF's 'key:value[,key:value]' "
                                  f"(e.g. 'expandable_segments:True'); it is {conf!r}")
    if cfg.get("deepspeed") is not None:
        if launcher.get("kind") != "deepspeed" or not isinstance(launcher.get("bind_cores_to_rank"), bool):
            raise PeerConfigError(f"{where}: a DeepSpeed peer needs launcher "
                                  '{"kind": "deepspeed", "bind_cores_to_rank": true|false}')
        ds = cfg["deepspeed"]
        filled = sorted(DS_FILLED & ds.keys())
        if filled:
            raise PeerConfigError(f"{where}: deepspeed.{', '.join(filled)} are set from the command line and "
                                  "megatrain's AdamWConfig; remove them from the file")
        unknown = sorted(ds.keys() - DS_TOP)
        if unknown:
            raise PeerConfigError(f"{where}: deepspeed key(s) {', '.join(unknown)} are not among {sorted(DS_TOP)}")
        zero = ds.get("zero_optimization", {})
        if zero.get("stage") not in (2, 3) or zero.get("offload_optimizer", {}).get("device") != "cpu":
            raise PeerConfigError(f"{where}: deepspeed.zero_optimization needs stage 2 or 3 and "
                                  "offload_optimizer.device 'cpu'")
    else:
        if launcher != {"kind": "python", "threads": "affinity"}:
            raise PeerConfigError(f"{where}: a torch peer needs launcher {{\"kind\": \"python\", "
                                  "\"threads\": \"affinity\"}")
        unknown = sorted(cfg["torch"].keys() - TORCH_KEYS)
        if unknown:
            raise PeerConfigError(f"{where}: torch key(s) {', '.join(unknown)} are not among {sorted(TORCH_KEYS)}")


DEFAULT_LR = 1e-5  # scripts/bench_megatrain.py BENCH_LR (tests/test_peers_dryrun.py ties them)
DEFAULT_CLIP = 1.0  # max global gradient norm of a row that does not set one: DeepSpeed's default since v0.19.3


def adamw_params(lr: float = DEFAULT_LR) -> dict:
    """megatrain's AdamW hyper-parameters as scripts/bench_megatrain.py sets them (AdamWConfig(lr=1e-5)); `lr` for
    the loss-curve runs, which need a learning rate that moves the loss in 200 steps."""
    from megatrain.exec.optim import AdamWConfig  # the one definition of the defaults; needs PYTHONPATH=.

    o = AdamWConfig(lr=lr)
    return {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}


def zenflow(cfg: dict) -> dict | None:
    """The ZenFlow settings of a peer's config (deepspeed.zero_optimization.zenflow), None for every other peer."""
    return cfg.get("deepspeed", {}).get("zero_optimization", {}).get("zenflow")


DEFAULT_WARMUP = 2  # untimed steps of a peer's run: scripts/bench_megatrain.py BENCH_WARMUP (tests tie them)


def micro_steps_per_update(cfg: dict) -> int:
    """Micro-batches a DeepSpeed peer's optimizer step applies (its config's optional key; 1 unless set)."""
    return cfg.get("micro_steps_per_update", 1)


def cuda_alloc_conf(cfg: dict) -> str | None:
    """The PYTORCH_CUDA_ALLOC_CONF a peer's training process runs with (its config's optional key; None unless set)."""
    return cfg.get("cuda_alloc_conf")


def steps_per_update(cfg: dict) -> int:
    """Micro-steps from one full optimizer update to the next: ZenFlow's update_interval, else the config's
    micro_steps_per_update (1). A step's time then depends on its place in the interval (the update lands on its
    last), so a timed run holds whole intervals and its step time is their mean, not the median step."""
    zen = zenflow(cfg)
    if zen and isinstance(zen.get("update_interval"), int):
        return zen["update_interval"]
    return micro_steps_per_update(cfg)


def warmup_steps(cfg: dict) -> int:
    """Untimed steps before a peer's timed ones: DEFAULT_WARMUP, and where updates land every few micro-steps
    (ZenFlow, micro_steps_per_update) two whole intervals. ZenFlow's first interval carries the set-up of its CPU
    optimizer: at llama-1b 8 x 2048 on the H200 the 4th step took 12.7 s and the 8th 0.78 s against 0.35 s steps
    and 1.2-1.4 s interval ends from then on (docs/runs/25-zenflow-curve/zenflow.result); two warm-up steps put that
    set-up into the timed ones (4,878 against 27,949 tokens/s; docs/peers.md, "The seventh and eighth starts")."""
    interval = steps_per_update(cfg)
    return max(DEFAULT_WARMUP, 2 * interval) if interval > 1 else DEFAULT_WARMUP


def deepspeed_config(cfg: dict, batch: int, clip: float, lr: float = DEFAULT_LR) -> dict:
    """The full DeepSpeed config of a run: the file's settings plus batch, clipping and AdamW (at `lr`)."""
    ds = copy.deepcopy(cfg["deepspeed"])
    ds.update(train_micro_batch_size_per_gpu=batch, gradient_accumulation_steps=micro_steps_per_update(cfg),
              gradient_clipping=float(clip),
              optimizer={"type": "AdamW", "params": adamw_params(lr)})
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def validate_with_deepspeed(ds: dict) -> str:
    """Check the zero_optimization and bf16 sections against the installed DeepSpeed's pydantic models (they forbid
    unknown keys); 'deepspeed not installed' when it cannot be imported (CI)."""
    try:
        import deepspeed  # noqa: F401  (optional: only the GPU machine has the wheel)
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError as e:
        return f"deepspeed not installed ({e.name}): checked against our schema only"
    try:
        DeepSpeedZeroConfig(**ds["zero_optimization"])
        DeepSpeedBF16Config(**ds.get("bf16", {}))
    except Exception as e:  # pydantic's ValidationError: say which key, then stop
        raise PeerConfigError(f"DeepSpeed {deepspeed.__version__} refuses the config: {e}") from None
    return f"checked against DeepSpeed {deepspeed.__version__}'s config models"


# ---- memory, before a run allocates -------------------------------------------------------------------------------
# Host bytes a parameter of the peers' measured runs (the RSS of the process and its children over the parameters;
# docs/peers.md, "The fourth and fifth starts"): the estimate a run is checked against before it builds its model.
# A peer without a measurement is checked against its floor (`memory_floor`), which only refuses what cannot fit.
MEASURED_HOST_B_PER_PARAM = {
    "zero3-offload": (25.65, "measured at bench-3b 8 x 2048 on the H200, start 4"),
    "superoffload": (22.64, "measured at bench-3b 8 and 16 x 2048 on the H200, starts 2 and 5"),
    "superoffload-adam50": (22.64, "measured at bench-3b 8 x 2048 on the H200, start 4"),
    # PSS of the training process and ZenFlow's optimizer process (overlap_step): 43.1 GiB at llama-1b. At bench-3b
    # the host ran out: 92.5 GiB of shared memory in the first, 30.5 GiB in the second (dmesg, start 7)
    "zenflow": (48.6, "measured at llama-1b 8 x 2048 on the H200, start 8"),
    # overlap_step false: no optimizer process, and no shared-memory copy of the optimizer state for it
    "zenflow-sync": (24.2, "measured at llama-1b 8 x 2048 on the H200, start 12"),
    "zero2-offload-every4": (24.01, "measured at llama-1b 8 x 2048 on the H200, start 12"),
    # 4 B above its 16 B floor (fp32 weights, gradients, moments; what the rest is was not profiled): at llama3-8b
    # the floor (119.6 GiB) would pass a 125 GiB host that the measured rate (149.4 GiB) cannot hold
    "fsdp2-cpuoffload": (19.97, "measured at bench-3b 8 and 16 x 2048 on the H200, starts 7-10"),
    "twinflow": (9.11, "measured at bench-3b 8 and 16 x 2048 on the H200, starts 7-10"),
}
# the GPU allocator's setting does not touch the host: twinflow's rate (not measured apart)
MEASURED_HOST_B_PER_PARAM["twinflow-expandable"] = MEASURED_HOST_B_PER_PARAM["twinflow"]


# GPU bytes an element of the logits (batch x seq x vocab) that every peer holds at once, whatever it offloads: all
# run the HF model's head on the GPU and take `model(input_ids=x, labels=y, shift_labels=y).loss` (run_peer.py),
# so the head's output is bf16 (2 B: autocast, FSDP2's param_dtype or DeepSpeed's bf16; every config sets one),
# transformers' ForCausalLMLoss (transformers/loss/loss_utils.py, 5.24) upcasts it with `logits = logits.float()`
# (4 B) while the bf16 tensor stays referenced (LlamaForCausalLM.forward returns it beside the loss), and its
# fixed_cross_entropy's log-softmax writes another fp32 tensor of that shape (4 B), kept for the backward. The
# backward's gradient of the same shape, the rest of the activations, buffers and the runtime come on top: a floor.
# llama3-8b at 16 x 2048 (vocab 128256): 39.1 GiB. Both allocations were seen failing on the H200: all-on-gpu at the
# bf16 head (docs/runs/25-peers/h200-table6, llama8b-16x2048-logs-3.tgz: "Tried to allocate 7.83 GiB"), and
# twinflow-expandable at the log-softmax with the upcast already held (h200-table18, llama8b-16x2048-c-logs.tgz:
# "Tried to allocate 15.66 GiB" from fixed_cross_entropy, 129.27 GiB allocated). No row that ran is refused by it.
LOGITS_B_PER_ELEMENT = 10.0


def memory_floor(cfg: dict) -> tuple[float, float, str]:
    """(host, GPU) bytes a parameter that the peer's settings hold at least, and what they are: fp32 weights,
    gradients and AdamW moments (16 B) where its optimizer state lives (a DeepSpeed `ratio` splits them), and bf16
    parameters (2 B) where ZeRO keeps them. Activations, buffers and the runtime come on top."""
    if "torch" in cfg:
        if "offload" in cfg["torch"]:
            return 16.0, 0.0, "fp32 weights, gradients and AdamW moments on the host"
        return 0.0, 16.0, "fp32 weights, gradients and AdamW moments on the GPU"
    zero = cfg["deepspeed"]["zero_optimization"]
    ratio = float(zero["offload_optimizer"].get("ratio", 1.0))
    host, gpu = 16.0 * ratio, 16.0 * (1.0 - ratio)
    params_on_cpu = zero.get("offload_param", {}).get("device") == "cpu"
    host, gpu = (host + 2.0, gpu) if params_on_cpu else (host, gpu + 2.0)
    where = "on the host" if params_on_cpu else "on the GPU"
    return host, gpu, (f"fp32 master, gradients and AdamW moments of {ratio:.0%} of the optimizer on the host, "
                       f"bf16 parameters {where}")


def memory_refusal(cfg: dict, model: str, params: int, host_available: float, gpu_free: float | None, *,
                   tokens: int = 0, vocab: int = 0) -> str | None:
    """One line saying why the peer cannot hold `model` on this machine (host memory MemAvailable, the GPU's free
    bytes; None: no GPU), or None when it may. Host: the peer's measured bytes a parameter where there is one,
    else its floor; GPU: its floor plus the logits of `tokens` (batch x seq) over `vocab`, which every peer holds
    on the GPU (LOGITS_B_PER_ELEMENT; 0, the default, leaves them out)."""
    from megatrain.units import GiB  # needs PYTHONPATH=. (the repository root), as adamw_params

    host_floor, gpu_floor, what = memory_floor(cfg)
    per, basis = MEASURED_HOST_B_PER_PARAM.get(cfg["peer"], (host_floor, f"at least: {what}"))
    head = f"{cfg['peer']} cannot hold {model} ({params / 1e9:.2f} B parameters) on this machine: it needs about"
    tail = "; nothing was allocated (--skip-memory-check runs it anyway)"
    if per * params > host_available:
        return (f"{head} {per * params / GiB:.1f} GiB of host memory ({per:g} B a parameter, {basis}) and "
                f"{host_available / GiB:.1f} GiB are available{tail}")
    logits = LOGITS_B_PER_ELEMENT * tokens * vocab
    if gpu_free is not None and gpu_floor * params + logits > gpu_free:
        per_param = f"{gpu_floor:g} B a parameter: {what}"
        if not logits:
            return (f"{head} {gpu_floor * params / GiB:.1f} GiB of GPU memory before activations ({per_param}) "
                    f"and the GPU has {gpu_free / GiB:.1f} GiB free{tail}")
        return (f"{head} {(gpu_floor * params + logits) / GiB:.1f} GiB of GPU memory before activations other than "
                f"the logits ({gpu_floor * params / GiB:.1f} GiB at {per_param}; {logits / GiB:.1f} GiB of logits, "
                f"{tokens} tokens x {vocab} vocabulary x {LOGITS_B_PER_ELEMENT:g} B: bf16, their fp32 upcast and its "
                f"fp32 log-softmax) and the GPU has {gpu_free / GiB:.1f} GiB free{tail}")
    return None


def settings_summary(cfg: dict, clip: float) -> str:
    """One line stating the settings the issue asks each row to show (core binding, pinned memory, sub-group
    size, the peer's own knobs) and the clipping."""
    parts = []
    if "deepspeed" in cfg:
        zero = cfg["deepspeed"]["zero_optimization"]
        oo, op = zero["offload_optimizer"], zero.get("offload_param", {})
        parts.append(f"ZeRO-{zero['stage']}")
        parts.append(f"optimizer on cpu (pin_memory={oo.get('pin_memory', True)})")
        parts.append(f"params on {op.get('device', 'gpu') if op.get('device', 'none') != 'none' else 'gpu'}"
                     + (f" (pin_memory={op.get('pin_memory', True)})" if op.get("device") == "cpu" else ""))
        for key in ("super_offload", "cpuadam_cores_perc", "ratio"):
            if key in oo:
                parts.append(f"{key}={oo[key]}")
        if "zenflow" in zero:
            parts.append("zenflow " + ", ".join(f"{k}={v}" for k, v in zero["zenflow"].items()))
        parts.append(f"sub_group_size={zero.get('sub_group_size', 1e9):.0e}" if zero["stage"] == 3
                     else "sub_group_size n/a (stage 2)")
        if "overlap_comm" in zero:  # stated when the config sets them
            parts.append(f"overlap_comm={zero['overlap_comm']}")
        if "reduce_bucket_size" in zero:
            parts.append(f"reduce_bucket_size={zero['reduce_bucket_size']:.0e}")
        if micro_steps_per_update(cfg) > 1:
            parts.append(f"one optimizer step per {micro_steps_per_update(cfg)} micro-batches (their mean gradient)")
        parts.append("bind_cores_to_rank" if cfg["launcher"]["bind_cores_to_rank"] else "no core binding")
        parts.append("bf16")
    else:
        t = cfg["torch"]
        parts.append(f"weights {t['weights']}")
        if "autocast" in t:
            parts.append(f"autocast {t['autocast']}")
        if "mixed_precision" in t:
            parts.append("mixed precision " + "/".join(t["mixed_precision"].values()))
        if "offload" in t:
            parts.append(f"CPUOffloadPolicy(pin_memory={t['offload']['pin_memory']})")
        parts.append(f"AdamW fused={t['optimizer']['fused']}")
        parts.append("torch threads = cores of the affinity")
    parts.append("activation checkpointing" if cfg["activation_checkpointing"] else "no activation checkpointing")
    if cuda_alloc_conf(cfg):
        parts.append(f"PYTORCH_CUDA_ALLOC_CONF={cuda_alloc_conf(cfg)}")
    parts.append(f"clip {clip:g}" if clip > 0 else "no clipping")
    return "; ".join(parts)


def launch_argv(cfg: dict, runner_args: list[str], python: str = "python3", bind: bool | None = None) -> list[str]:
    """The command that runs one measurement from the repository root: DeepSpeed peers through DeepSpeed's own
    launcher (`python -m deepspeed.launcher.runner`, as `deepspeed` would, which also works from a --target install
    without its bin/), with --bind_cores_to_rank where the config asks for it and `bind` does not say no (it needs
    numactl on the machine)."""
    if cfg["launcher"]["kind"] == "python":
        return [python, RUNNER, cfg["peer"], *runner_args]
    want = cfg["launcher"]["bind_cores_to_rank"] if bind is None else (bind and cfg["launcher"]["bind_cores_to_rank"])
    return [python, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", *(["--bind_cores_to_rank"] if want else []),
            RUNNER, cfg["peer"], *runner_args]


def command_line(argv: list[str]) -> str:
    return shlex.join(argv)
