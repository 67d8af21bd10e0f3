"""Run config: TOML loading, --set overrides, errors that name the key, resolved config round trips."""
from __future__ import annotations

import json
import tomllib
from dataclasses import fields

import pytest

from megatrain.compile.knobs import NAMED_SCHEDULES, ScheduleKnobs, knobs_for
from megatrain.train.config import ConfigError, RunConfig, load_config


def write(tmp_path, text: str):
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


def test_toml_values_reach_the_dataclass(tmp_path):
    cfg = load_config(write(tmp_path, """
        [model]
        name = "debug"
        [data]
        seq_len = 64
        batch_size = 4
        [optimizer]
        lr = 3e-4
        weight_decay = 0   # an integer is accepted for a float
        [run]
        steps = 7
        tensorboard = true
    """))
    assert cfg.data.seq_len == 64 and cfg.data.batch_size == 4
    assert cfg.optimizer.lr == 3e-4
    assert cfg.optimizer.weight_decay == 0.0 and isinstance(cfg.optimizer.weight_decay, float)
    assert cfg.run.steps == 7 and cfg.run.tensorboard is True
    assert cfg.run.eval_every == RunConfig().run.eval_every  # keys left out keep their defaults


def test_overrides_are_parsed_to_the_field_type(tmp_path):
    cfg = load_config(write(tmp_path, "[run]\nsteps = 7\n"),
                      ["optimizer.lr=2.5e-4", "run.steps=11", "run.progress=false", "run.name=exp_1",
                       "data.path='megatrain/corpus/python_reference.txt'"])
    assert cfg.optimizer.lr == 2.5e-4
    assert cfg.run.steps == 11  # the override wins over the file
    assert cfg.run.progress is False
    assert cfg.run.name == "exp_1"
    assert cfg.data.path == "megatrain/corpus/python_reference.txt"  # quotes stripped


@pytest.mark.parametrize("text, key", [
    ("[optimizer]\nlrr = 1e-3\n", "optimizer.lrr"),
    ("[run]\nsteps = 5\nstep = 5\n", "run.step"),
    ("[schedule]\nbufers = 2\n", "schedule.bufers"),
])
def test_unknown_key_is_an_error_naming_it(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(write(tmp_path, text))
    assert "run.toml" in str(e.value)


def test_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section.*'training'"):
        load_config(write(tmp_path, "[training]\nsteps = 5\n"))


@pytest.mark.parametrize("text, key", [
    ('[optimizer]\nlr = "fast"\n', "optimizer.lr"),
    ("[run]\nsteps = true\n", "run.steps"),  # bool is not an int here, though Python says it is
    ("[run]\nsteps = 2.5\n", "run.steps"),
    ("[data]\nshuffle = 1\n", "data.shuffle"),
    ("[model]\nname = 3\n", "model.name"),
    ("[run]\nsteps = [1, 2]\n", "run.steps"),
])
def test_wrong_type_is_an_error_naming_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + " must be"):
        load_config(write(tmp_path, text))


def test_bad_toml_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.toml is not valid TOML"):
        load_config(write(tmp_path, "[run\nsteps = 5\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize("override, match", [
    ("optimizer.lr", "expected section.key=value"),
    ("lr=1e-3", "is not section.key"),
    ("optimizer.learning_rate=1e-3", r"unknown key optimizer\.learning_rate"),
    ("run.steps=ten", r"run\.steps must be an integer"),
    ("run.progress=maybe", r"run\.progress must be true or false"),
    ("optimizer.lr=-1", r"optimizer\.lr=-1.0 must be positive"),
])
def test_bad_override_is_an_error(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_values_out_of_range_name_the_key():
    with pytest.raises(ConfigError, match=r"data\.eval_fraction"):
        load_config(None, ["data.eval_fraction=1.5"])
    with pytest.raises(ConfigError, match=r"optimizer='later' is invalid"):
        load_config(None, ["schedule.optimizer=later"])
    with pytest.raises(ConfigError, match=r"model\.name='no-such-model'"):
        load_config(None, ["model.name=no-such-model"])
    with pytest.raises(ConfigError, match=r"data\.path=.*does not exist"):
        load_config(None, ["data.path=/nonexistent/tokens.bin"])
    with pytest.raises(ConfigError, match=r"micro_batches"):
        load_config(None, ["data.batch_size=6", "schedule.micro_batches=4"])


def test_schedule_section_maps_onto_schedule_knobs(tmp_path):
    # Keys left out come from the named schedule; keys given override it.
    cfg = load_config(write(tmp_path, '[schedule]\nname = "serial"\nbuffers = 2\n'))
    assert cfg.schedule.knobs() == knobs_for("serial", buffers=2)
    assert cfg.schedule.optimizer == NAMED_SCHEDULES["serial"].optimizer
    # Every knob is a key of [schedule], typed as the knob is (a wrong type names the key).
    for f in fields(ScheduleKnobs):
        assert getattr(cfg.schedule, f.name) == getattr(knobs_for("serial", buffers=2), f.name)
    # The [schedule] table of a run config is a schedule file: `megatrain simulate --schedule` reads the same file.
    from megatrain.compile.knobs import resolve_knobs
    assert resolve_knobs(str(tmp_path / "run.toml"))[1] == load_config(tmp_path / "run.toml").schedule.knobs()
    with pytest.raises(ConfigError, match=r"schedule\.buffers must be an integer"):
        load_config(write(tmp_path, '[schedule]\nbuffers = "two"\n'))
    assert load_config().schedule.knobs() == ScheduleKnobs(**{
        f.name: getattr(NAMED_SCHEDULES["overlap"], f.name) for f in fields(ScheduleKnobs)})


def test_schedule_name_override_brings_its_own_knobs():
    base = load_config(None, ["schedule.name=overlap"])
    assert base.schedule.buffers == NAMED_SCHEDULES["overlap"].buffers
    swapped = base.with_overrides(["schedule.name=serial"])
    assert swapped.schedule.knobs() == NAMED_SCHEDULES["serial"]
    tuned = base.with_overrides(["schedule.buffers=1", "schedule.name=double-buffer"])
    assert tuned.schedule.knobs() == knobs_for("double-buffer", buffers=1)


def test_clipping_is_one_setting_of_the_schedule():
    # The arrival schedule computes no global norm: it does not clip, with nothing else to set.
    cfg = load_config(None, ["schedule.name=arrival"])
    assert cfg.schedule.knobs() == NAMED_SCHEDULES["arrival"] and cfg.schedule.clip == 0
    assert load_config(None, ["schedule.clip=0.5"]).schedule.knobs().clip == 0.5
    # The resolver's rules surface as ConfigErrors naming the knobs.
    assert load_config(None, ["schedule.optimizer=arrival", "schedule.clip=1.0"]).schedule.knobs().clip == 1.0
    with pytest.raises(ConfigError, match=r"retain_grads=1 keeps them on the GPU.*retain_grads=0"):
        load_config(None, ["schedule.name=arrival-split", "schedule.clip=1.0", "schedule.retain_grads=1"])
    # The old second setting says where clipping went.
    with pytest.raises(ConfigError, match=r"optimizer\.grad_clip is schedule\.clip now"):
        load_config(None, ["optimizer.grad_clip=0"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["schedule.name=serial", "optimizer.lr=2e-4", "run.name=rt", "data.seq_len=32",
                             "run.out_dir=" + str(tmp_path)])
    json_path = cfg.save(tmp_path / "rundir")
    assert RunConfig.from_dict(json.loads(json_path.read_text())) == cfg
    assert load_config(tmp_path / "rundir" / "config.toml") == cfg
    assert tomllib.loads(cfg.to_toml())["schedule"] == {"name": "serial"}  # the knobs come from the name
    line = cfg.summary()
    assert line.startswith("config {") and "\n" not in line and '"lr": 0.0002' in line


def test_model_section_gives_the_spec():
    spec = load_config(None, ["model.num_layers=2"]).model.spec()
    assert spec.num_layers == 2 and spec.vocab_size == 256
    assert load_config().model.pretrained is False  # a preset has no weights
    with pytest.raises(ConfigError, match="needs a Hugging Face directory"):
        load_config(None, ["model.init=pretrained"])


def test_override_may_complete_a_file_and_file_mistakes_name_the_file(tmp_path):
    path = write(tmp_path, '[schedule]\nname = "arrival-split"\nclip = 1.0\nretain_grads = 1\n')
    with pytest.raises(ConfigError, match="retain_grads"):
        load_config(path)
    assert load_config(path, ["schedule.clip=0"]).schedule.clip == 0
    with pytest.raises(ConfigError, match=r"run\.toml: unknown key run\.stepz"):
        load_config(write(tmp_path, "[run]\nstepz = 3\n"), ["run.steps=4"])
