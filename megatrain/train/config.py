"""Run configuration: one dataclass, five sections, loaded from TOML and overridden on the command line.

    [model]      which model (a preset or a local Hugging Face directory) and how its weights start
    [data]       where the tokens come from, sequence length, batch size, held-out split
    [schedule]   a named schedule and any knob of megatrain.compile.knobs.ScheduleKnobs overriding it
    [optimizer]  AdamW and the learning-rate schedule (clipping is the schedule's `clip`: it shapes the step)
    [run]        steps, evaluation, checkpoints, logging, device

`load_config("run.toml", ["optimizer.lr=3e-4"])` reads the file with stdlib `tomllib`, applies `--set`
overrides (each value parsed to the type of its field), and checks everything before any memory is allocated:
an unknown section or key, a value of the wrong type or out of range is a `ConfigError` naming the key. Keys
left out take the defaults below; in [schedule], keys left out take the values of the named schedule, so
`name = "serial"` plus `buffers = 2` means "serial, but double-buffered". The resolved config (every key
explicit) is what `to_json()` / `to_toml()` write next to a run's outputs, and loading it back gives the same run.

Paths are taken relative to the working directory, as on the command line.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from megatrain.ir.dag import ScheduleError
from megatrain.compile.knobs import DEFAULT_SCHEDULE, ScheduleKnobs, knobs_from_table
from megatrain.model.presets import PRESETS
from megatrain.settings import field_types, toml_value
from megatrain.tomlfile import read_toml
from megatrain.train.config_values import ConfigError, at_least, check_type, one_of, parse_override, positive
from megatrain.compile.resolve import resolve
from megatrain.model.presets import get_model

DATA_FORMATS = ("auto", "text", "bin", "jsonl")
TOKEN_DTYPES = ("uint16", "uint32")
LR_DECAYS = ("cosine", "linear", "constant")
DEVICES = ("auto", "cpu", "cuda")
MODEL_INITS = ("auto", "pretrained", "random")
# A run name names a directory: at most 255 bytes on every common filesystem, less room for a suffix that makes
# a second run's directory its own.
MAX_NAME_BYTES = 200


def default_run_name(config_path: str | Path | None, model_name: str) -> str:
    """The run name when run.name is not set: the config file's name without its suffix, else the model's (a preset,
    or a Hugging Face directory's last component). A second run of the same name gets name-1 (rundir.py)."""
    name = Path(config_path).stem if config_path is not None else Path(str(model_name).rstrip("/\\")).name
    name = name.encode("utf-8", "surrogatepass")[:MAX_NAME_BYTES].decode("utf-8", "ignore")
    return name if name not in ("", ".", "..") else "run"


@dataclass
class ModelConfig:
    """Which model to train and how its weights start."""

    name: str = "debug"  # a preset (megatrain.PRESETS) or a local Hugging Face directory (config.json + safetensors)
    init: str = "auto"  # auto: the directory's weights, or random for a preset | pretrained | random
    init_std: float = 0.02  # std of the normal init of matrices (HF's initializer_range); norms start at 1
    seed: int = 0  # seed of the random init
    num_layers: int = 0  # 0: as the model has; n: keep only the first n layers (quick experiments)

    def validate(self) -> None:
        one_of("model.init", self.init, MODEL_INITS)
        if self.name not in PRESETS and not Path(self.name).exists():
            raise ConfigError(
                f"model.name={self.name!r} is neither a preset ({', '.join(PRESETS)}) nor an existing path; "
                "give a preset name or a local Hugging Face model directory"
            )
        if self.init == "pretrained" and self.name in PRESETS:
            raise ConfigError(f"model.init='pretrained' needs a Hugging Face directory, but model.name={self.name!r} "
                              "is a preset (it has no weights); use init='random' or point model.name at a directory")
        at_least("model.num_layers", self.num_layers, 0)
        positive("model.init_std", self.init_std)

    @property
    def pretrained(self) -> bool:
        """Whether the weights come from the Hugging Face directory (else seeded random init)."""
        return self.init == "pretrained" or (self.init == "auto" and self.name not in PRESETS)

    def spec(self):
        """The ModelSpec this section describes (with `num_layers` applied)."""

        spec = get_model(self.name)
        if self.num_layers:
            if self.num_layers > spec.num_layers:
                raise ConfigError(f"model.num_layers={self.num_layers} is more than the {spec.num_layers} layers "
                                  f"of {spec.name}")
            spec = spec.with_layers(self.num_layers)
        return spec


@dataclass
class DataConfig:
    """Where tokens come from and how they are cut into (batch_size, seq_len) batches."""

    path: str = ""  # "" = the bundled corpus; a .bin token file, a nanoGPT dir (train.bin/val.bin), .jsonl or .txt
    format: str = "auto"  # auto (from the suffix) | text (byte-level tokens) | bin | jsonl
    dtype: str = "uint16"  # element type of .bin token files (nanoGPT writes uint16)
    tokenizer: str = ""  # "" = the HF model directory's own (bytes for a preset) | a tokenizer.json or a directory
    #                      holding one | "bytes" (training/tokenization.py; nothing is downloaded)
    text_key: str = "text"  # the field of each JSONL record holding its text
    eos_token: str = ""  # token appended after every JSONL document ("" = none)
    eval_path: str = ""  # held-out file; "" = the last eval_fraction of the data (val.bin in a nanoGPT dir)
    eval_fraction: float = 0.05
    seq_len: int = 128
    batch_size: int = 8  # sequences per step
    shuffle: bool = True
    seed: int = 0  # seed of the shuffling

    def validate(self) -> None:
        one_of("data.format", self.format, DATA_FORMATS)
        one_of("data.dtype", self.dtype, TOKEN_DTYPES)
        for key in ("path", "tokenizer", "eval_path"):
            value = getattr(self, key)
            if value and not Path(value).exists() and not (key == "tokenizer" and value == "bytes"):
                raise ConfigError(f"data.{key}={value!r} does not exist"
                                  + ("; give a tokenizer.json, a directory holding one, or 'bytes'"
                                     if key == "tokenizer" else ""))
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1)")
        positive("data.seq_len", self.seq_len)
        positive("data.batch_size", self.batch_size)


_KNOB_TYPES = field_types(ScheduleKnobs)


@dataclass
class ScheduleConfig:
    """[schedule]: a named schedule (`name`, megatrain.NAMED_SCHEDULES) and the knobs set on top of it, the same
    table a schedule file holds (`megatrain.compile.knobs.knobs_from_table`). Knob values read as attributes
    (`cfg.schedule.buffers`); `knobs()` is the ScheduleKnobs."""

    name: str = DEFAULT_SCHEDULE
    overrides: dict[str, Any] = field(default_factory=dict)  # knob -> value, only the knobs set explicitly

    def knobs(self) -> ScheduleKnobs:
        try:
            return knobs_from_table(self.table(), "[schedule]")[1]
        except ScheduleError as e:
            raise ConfigError(str(e)) from None

    def table(self) -> dict[str, Any]:
        """The TOML table: `name` and the knobs set (an unset optional knob is left out)."""
        return {"name": self.name, **{k: v for k, v in self.overrides.items() if v is not None}}

    def __getattr__(self, key: str) -> Any:
        if key in _KNOB_TYPES:
            return getattr(self.knobs(), key)
        raise AttributeError(f"ScheduleConfig has no attribute {key!r}")

    def validate(self) -> None:
        self.knobs()


@dataclass
class OptimizerConfig:
    """AdamW on the fp32 master weights, with linear warmup and a decay to min_lr."""

    lr: float = 1e-3
    min_lr: float = 1e-4  # the learning rate at the end of the decay
    warmup_steps: int = 20
    decay: str = "cosine"  # cosine | linear | constant (after warmup)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # on matrices only (the decay prefix of every tile)
    threads: int = 0  # host threads for the CPU optimizer; 0 = the trainer's default (CUDA: all cores but 3)

    def validate(self) -> None:
        one_of("optimizer.decay", self.decay, LR_DECAYS)
        positive("optimizer.lr", self.lr)
        at_least("optimizer.min_lr", self.min_lr, 0.0)
        if self.min_lr > self.lr:
            raise ConfigError(f"optimizer.min_lr={self.min_lr} is above optimizer.lr={self.lr}")
        at_least("optimizer.warmup_steps", self.warmup_steps, 0)
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"optimizer.{key}={getattr(self, key)} must be in [0, 1)")
        positive("optimizer.eps", self.eps)
        at_least("optimizer.weight_decay", self.weight_decay, 0.0)
        at_least("optimizer.threads", self.threads, 0)


@dataclass
class RunSettings:
    """Length of the run, evaluation, checkpoints, logging and device."""

    name: str = ""  # the run directory is <out_dir>/<name>; "" = the config file's or the model's (default_run_name)
    out_dir: str = "runs"
    steps: int = 120  # the embedded default: about a minute of the debug model on 2 CPU cores
    grad_accum: int = 1  # batches whose gradients are summed before one optimizer update
    eval_every: int = 40  # steps between evaluations of the held-out loss (and at the end); 0 = never
    eval_batches: int = 4
    log_every: int = 10  # steps between step lines (and every eval, and the last step)
    checkpoint_every: int = 60  # steps between checkpoints; 0 = none (except at the end if checkpoint_at_end)
    checkpoint_at_end: bool = True
    keep_last: int = 3  # checkpoints kept; 0 = all
    resume: str = ""  # "" = fresh run | "latest" = newest checkpoint of this run | a checkpoint directory
    seed: int = 0  # seed of everything else (dropout-free models use it for nothing today but it is saved)
    device: str = "auto"  # auto (cuda when there is one) | cpu | cuda
    simulate: bool = True  # print the simulator's prediction of the schedule beside the measured numbers
    profile: str = ""  # hardware profile JSON for the simulator; "" = the built-in one for the device
    tensorboard: bool = False
    progress: bool = True  # tqdm progress bar (drawn only when stderr is a terminal)
    export_hf: str = ""  # directory to export the final weights to as a Hugging Face model; "" = none
    wait_timeout_s: float = 300.0  # bound of every wait of the executor (a hung task ends the step with an error)
    max_skipped_steps: int = 5  # consecutive skipped updates (non-finite gradients) that stop the run; 0 = never

    def validate(self) -> None:
        if not self.name or any(c in self.name for c in "/\\\0") or self.name in (".", ".."):
            # The run directory must be a child of out_dir: "..", "." or a path would write elsewhere.
            raise ConfigError(f"run.name={self.name!r} must be a plain directory name (not '.' or '..', no '/' or "
                              "'\\'); the run directory is <run.out_dir>/<run.name>")
        if len(self.name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            # A filesystem names an entry in at most 255 bytes; the run directory's claim may add a suffix.
            raise ConfigError(f"run.name is {len(self.name.encode('utf-8', 'surrogatepass'))} bytes long; give a "
                              f"name of at most {MAX_NAME_BYTES} bytes (it names the run directory)")
        if not (math.isfinite(self.wait_timeout_s) and self.wait_timeout_s > 0):
            raise ConfigError(f"run.wait_timeout_s={self.wait_timeout_s} must be a positive number of seconds (every "
                              "executor wait is bounded so that a hung task ends the run with an error)")
        at_least("run.max_skipped_steps", self.max_skipped_steps, 0)
        positive("run.steps", self.steps)
        positive("run.grad_accum", self.grad_accum)
        positive("run.log_every", self.log_every)
        positive("run.eval_batches", self.eval_batches)
        for key in ("eval_every", "checkpoint_every", "keep_last"):
            at_least(f"run.{key}", getattr(self, key), 0)
        one_of("run.device", self.device, DEVICES)
        if self.profile and not Path(self.profile).is_file():
            raise ConfigError(f"run.profile={self.profile!r} is not a file")

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name


# Keys that moved: key -> (old section, new place, what to do).
MOVED = {"grad_clip": ("optimizer", "schedule.clip", "clipping is one setting of the schedule: set schedule.clip to "
                       "the max "
                       "global gradient norm (0 = no clipping)")}

SECTIONS = {"model": ModelConfig, "data": DataConfig, "schedule": ScheduleConfig, "optimizer": OptimizerConfig,
            "run": RunSettings}


@dataclass
class RunConfig:
    """The whole configuration of a training run (see the module docstring)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    run: RunSettings = field(default_factory=RunSettings)

    def __post_init__(self) -> None:
        if not self.run.name:  # not named (load_config names it after its file): after the model
            self.run = replace(self.run, name=default_run_name(None, self.model.name))

    def validate(self) -> RunConfig:
        """Check every section and the rules that span sections; returns self."""
        for name in SECTIONS:
            getattr(self, name).validate()
        if self.data.batch_size % self.schedule.micro_batches:
            raise ConfigError(f"data.batch_size={self.data.batch_size} does not split into "
                              f"schedule.micro_batches={self.schedule.micro_batches}; pick a divisor")
        self.placement()  # every rule between the knobs, for this model and batch, before anything is allocated
        return self

    def step_knobs(self) -> ScheduleKnobs:
        """The schedule of one optimizer step: gradient accumulation (`run.grad_accum = k`) is k times the
        micro-batches in one streamed step, so each layer's weights cross PCIe once per update."""
        knobs = self.schedule.knobs()
        return replace(knobs, micro_batches=knobs.micro_batches * self.run.grad_accum)

    def step_shape(self) -> tuple[int, int]:
        """(batch, seq) of one streamed step: the accumulated batches together."""
        return self.data.batch_size * self.run.grad_accum, self.data.seq_len

    def placement(self):
        """The resolved placement of the run's schedule (megatrain.ir.placement.resolve): ConfigError if the
        knobs conflict for this model and batch."""

        try:
            return resolve(self.model.spec(), *self.step_shape(), self.step_knobs())
        except ScheduleError as e:
            raise ConfigError(f"[schedule] {self.schedule.name!r}: {e}") from None

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> RunConfig:
        """Build and validate from a nested dict ({section: {key: value}}); unknown keys are errors."""
        return cls(**_sections(raw, source)).validate()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schedule"] = self.schedule.table()
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_toml(self) -> str:
        """The resolved config as TOML; `load_config` of it gives an equal RunConfig."""
        lines = []
        for name, values in self.to_dict().items():
            lines.append(f"[{name}]")
            lines += [f"{key} = {toml_value(v)}" for key, v in values.items()]
            lines.append("")
        return "\n".join(lines)

    def summary(self) -> str:
        """The resolved config on one line (the first log line of a run)."""
        return "config " + self.to_json(indent=None)

    def save(self, directory: str | Path) -> Path:
        """Write the resolved config as config.json (and config.toml) into `directory`; returns the JSON path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.toml").write_text(self.to_toml())
        path = directory / "config.json"
        path.write_text(self.to_json() + "\n")
        return path

    def with_overrides(self, overrides: Iterable[str]) -> RunConfig:
        """A new config with `section.key=value` overrides applied (and validated)."""
        raw = self.to_dict()
        if any(o.split("=", 1)[0].strip() == "schedule.name" for o in overrides):
            # A new schedule name brings its own knobs, except those set explicitly in these overrides.
            raw["schedule"] = {}
        return RunConfig.from_dict(_apply_overrides(raw, overrides), source="--set")


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Load a TOML config (or the defaults when `path` is None) and apply `section.key=value` overrides."""
    raw: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        raw = read_toml(path, ConfigError, "config file")
    overrides = list(overrides)
    if overrides:
        # Check the file's keys and types alone first, so a mistake in it is reported against the file (the
        # rules that span keys are checked after the overrides, which may be what satisfies them).
        _sections(raw, source)
        raw = _apply_overrides(raw, overrides)
        source = f"{source} with --set"
    run = raw.get("run", {})
    if path is not None and isinstance(run, dict) and not run.get("name"):  # not named: after its file
        raw = {**raw, "run": {**run, "name": default_run_name(path, "")}}
    return RunConfig.from_dict(raw, source=source)


def _sections(raw: dict, source: str) -> dict:
    """{section name: section dataclass} from a nested dict; unknown sections/keys and wrong types are errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a table of sections, got {type(raw).__name__}")
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {sorted(unknown)}; sections are {list(SECTIONS)}")
    sections = {}
    for name, section_cls in SECTIONS.items():
        values = raw.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{name}] must be a table of keys, got {type(values).__name__}")
        if name == "schedule":
            values = dict(values)
            sched_name = values.pop("name", DEFAULT_SCHEDULE)
            sections[name] = ScheduleConfig(check_type("schedule.name", sched_name, str), {})
            for key, value in values.items():
                if key not in _KNOB_TYPES:
                    raise ConfigError(f"{source}: unknown key schedule.{key}; [schedule] has name, "
                                      f"{', '.join(_KNOB_TYPES)}")
                sections[name].overrides[key] = check_type(f"schedule.{key}", value, _KNOB_TYPES[key])
            continue
        kwargs = {}
        hints = _field_types(section_cls)
        for key, value in values.items():
            if key in MOVED and name == MOVED[key][0]:
                raise ConfigError(f"{source}: {name}.{key} is {MOVED[key][1]} now; {MOVED[key][2]}")
            if key not in hints:
                raise ConfigError(f"{source}: unknown key {name}.{key}; [{name}] has {', '.join(hints)}")
            kwargs[key] = check_type(f"{name}.{key}", value, hints[key])
        sections[name] = section_cls(**kwargs)
    return sections


# ---- helpers ---------------------------------------------------------------------------------------------------
def _field_types(cls) -> dict[str, Any]:
    return field_types(cls)


def _apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value (e.g. optimizer.lr=3e-4)")
        key, text = item.split("=", 1)
        key = key.strip()
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            raise ConfigError(f"--set {item!r}: {key!r} is not section.key; sections are {list(SECTIONS)}")
        hints = _KNOB_TYPES | {"name": str} if section == "schedule" else _field_types(SECTIONS[section])
        if section in SECTIONS and name in MOVED and MOVED[name][0] == section:
            raise ConfigError(f"--set {item!r}: {key} is {MOVED[name][1]} now; {MOVED[name][2]}")
        if name not in hints:
            raise ConfigError(f"--set {item!r}: unknown key {key}; [{section}] has {', '.join(hints)}")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raw[section] = {}
        raw[section][name] = parse_override(key, text, hints[name])
    return raw
