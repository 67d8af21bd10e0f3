"""Training with the streaming executor (CPU backend) against a plain PyTorch loop nobody here wrote:
transformers' LlamaForCausalLM / Qwen2ForCausalLM + torch.optim.AdamW (decay on matrices only) + clip_grad_norm_.

20 steps on the debug model, fp32 compute: the per-step losses and the final parameters must agree, for every named
schedule and for knob variants (buffers, recompute blocks, micro-batches, optimizer placement, wire dtypes, tied
embeddings, Qwen2 biases). The schedule changes speed, never results.

How parameters are compared: Adam divides each gradient by its own running RMS, so an element whose gradient is
nearly cancelled (|g| ~ 1e-7 while fp32 rounding of the sum is ~1e-8) can move by up to lr per step in a different
direction in two correct implementations. So we bound the error relative to how far training moved the
model, ||p - p_ref|| / ||p_ref - p_0|| over all parameters, and bound every element by a few learning rates (Qwen2's
k_proj biases, whose gradients nearly cancel under softmax, are such elements). Run with `-s` to see the errors.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
# The reference nobody here wrote: a test dependency (pyproject's [test] extra). Imported, not importorskip'ed, so
# that a machine without it fails the suite instead of silently skipping every equality below.
import transformers

from megatrain.exec import compute as compute_module
from megatrain.io.hf_io import state_dict_from_tiles
from megatrain.model.layout import unit_layout
from megatrain.exec.optim import AdamWConfig
from megatrain.compile.knobs import NAMED_SCHEDULES, ScheduleKnobs, knobs_for
from megatrain.model.presets import PRESETS
from megatrain.model.spec import EMBED, HEAD, ModelSpec
from megatrain.engine.trainer import StreamedTrainer
from megatrain.exec.updates import Updates

STEPS, BATCH, SEQ = 20, 4, 16
LR, WD, MAX_NORM = 2e-3, 0.1, 1.0
LOSS_TOL = 1e-5  # relative, per step
MOVE_TOL = 1e-3  # ||p - p_ref|| / ||p_ref - p_0||, whole model
BF16_LOSS_TOL = 1e-4  # bf16 weights: a master 1 ulp (fp32) away can round to a neighbouring bf16 value
ELEM_TOL = 3 * LR  # max |p - p_ref|, any element
NORM_TOL = 1e-4  # relative, per step: the global gradient norm before clipping (clip_grad_norm_'s total_norm)
BF16_NORM_TOL = 1e-3  # bf16 weights: a neighbouring bf16 weight moves the gradients more than the loss (3e-4 seen)

DEBUG = PRESETS["debug"]
SPECS = {
    "llama": DEBUG,
    "llama-tied": ModelSpec(**{**DEBUG.to_dict(), "name": "debug-tied", "tie_word_embeddings": True,
                               "rope_scaling": DEBUG.rope_scaling}),
    "qwen2": ModelSpec(**{**DEBUG.to_dict(), "name": "debug-qwen2", "model_type": "qwen2", "qkv_bias": True,
                          "rope_theta": 1e6, "rope_scaling": DEBUG.rope_scaling}),
}


def batches(spec: ModelSpec, steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable synthetic text: arithmetic progressions mod V with random start and stride, some targets -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, spec.vocab_size, (BATCH, 1), generator=g)
        stride = torch.randint(1, 5, (BATCH, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % spec.vocab_size  # (B, T+1)
        targets = seq[:, 1:].clone()
        targets[0, :3] = -100  # ignored positions count in neither the loss nor its normalization
        out.append((seq[:, :-1].contiguous(), targets))
    return out


def initial_tiles(spec: ModelSpec) -> dict[int, torch.Tensor]:
    """The test's own seeded weights (one generator over the units in order: independent of megatrain.model.init, so the
    trajectories these bounds were set on do not move when the library's initialization changes)."""
    gen = torch.Generator().manual_seed(0)
    tiles = {}
    for unit in spec.units():
        layout = unit_layout(spec, unit)
        tile = tiles[unit] = torch.empty(layout.numel, dtype=torch.float32)
        for name, view in layout.views(tile).items():
            if view.dim() == 2:
                view.normal_(0.0, 0.05, generator=gen)
            else:
                view.fill_(1.0 if name.endswith("norm.weight") else 0.0)
    if spec.tie_word_embeddings:  # one matrix: the head's lm_head is the embedding
        n = spec.vocab_size * spec.hidden_size
        tiles[HEAD][:n] = tiles[EMBED]
    g = torch.Generator().manual_seed(7)
    for unit, tile in tiles.items():  # randomize norms and biases too, so no gradient is trivially matched
        for view in unit_layout(spec, unit).views(tile).values():
            if view.dim() == 1:
                view.add_(0.05 * torch.randn(view.shape, generator=g))
    return tiles


class Reference(NamedTuple):
    losses: list[float]  # per step
    state: dict[str, torch.Tensor]  # HF names -> fp32 parameters after the last step
    grad_norms: list[float]  # per step, the global gradient norm before clipping (a wrong loss normaliser moves it)


@functools.lru_cache(maxsize=None)
def reference(spec_key: str, clip: bool = True, weight_wire: str = "fp32", grad_wire: str = "fp32",
              skip_step: int | None = None) -> Reference:
    """The plain loop: HF model, fp32 AdamW on fp32 master parameters, decay on matrices only, clipping.

    weight_wire="bf16": the model computes (in fp32) with the master rounded to bf16 each step, gradients go to
    the fp32 master (what streaming a bf16 copy means). grad_wire="bf16": gradients are rounded to bf16 before
    clipping and the update. skip_step: that step's update is not applied (non-finite gradients).
    """
    spec = SPECS[spec_key]
    cfg = transformers.AutoConfig.for_model(**spec.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    sd = state_dict_from_tiles(spec, initial_tiles(spec))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    params = dict(model.named_parameters())  # tied: lm_head.weight is not listed separately
    master = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    groups = [{"params": [p for p in master.values() if p.dim() >= 2], "weight_decay": WD},
              {"params": [p for p in master.values() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR)
    losses, norms = [], []
    for i, (ids, targets) in enumerate(batches(spec)):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(master[n].to(torch.bfloat16) if weight_wire == "bf16" else master[n])
        logits = model(ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        for n, p in params.items():
            g = p.grad
            master[n].grad = g.to(torch.bfloat16).float() if grad_wire == "bf16" else g.clone()
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double())
                                                           for p in master.values()])).item())
        if i == skip_step:
            continue
        if clip:
            torch.nn.utils.clip_grad_norm_(list(master.values()), MAX_NORM)
        opt.step()
    return Reference(losses, {n: p.detach() for n, p in master.items()}, norms)


def train(spec_key: str, knobs: ScheduleKnobs, steps: int = STEPS) -> tuple[list, dict[str, torch.Tensor]]:
    spec = SPECS[spec_key]
    optim = AdamWConfig(lr=LR, weight_decay=WD)
    assert knobs.clip in (0, MAX_NORM)  # the schedule clips at the reference's norm, or not at all
    trainer = StreamedTrainer(spec, knobs, initial_tiles(spec), optim=optim, backend="cpu", timeout_s=30)
    results = [trainer.step(ids, targets) for ids, targets in batches(spec, steps)]
    return results, trainer.state_dict()


def assert_same_training(results, state, ref, spec_key: str, label: str, loss_tol: float = LOSS_TOL,
                         norm_tol: float = NORM_TOL) -> None:
    """Losses step by step (relative), the global gradient norms where the schedule computes one (they carry the
    loss normaliser, which Adam's scale invariance hides from the parameters), and parameters: the error of the
    whole model relative to how far training moved it, and every element within a few learning rates (see the
    module docstring)."""
    ref_losses, ref_state, ref_norms = ref
    losses = [r.loss for r in results]
    norm_errs = [abs(r.grad_norm - n) / n for r, n in zip(results, ref_norms)
                 if r.grad_norm is not None and math.isfinite(r.grad_norm)]
    errs = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    assert set(state) == set(ref_state), set(state) ^ set(ref_state)
    init = state_dict_from_tiles(SPECS[spec_key], initial_tiles(SPECS[spec_key]))
    diff2 = moved2 = worst_elem = 0.0
    for name, ref_p in ref_state.items():
        diff = state[name].double() - ref_p.double()
        diff2 += diff.square().sum().item()
        moved2 += (ref_p.double() - init[name].double()).square().sum().item()
        worst_elem = max(worst_elem, diff.abs().max().item())
    move_err = (diff2 / moved2) ** 0.5
    print(f"\n{spec_key}/{label}: loss rel err step 0 {errs[0]:.1e}, max {max(errs):.1e}; "
          f"grad norm rel err max {max(norm_errs, default=0.0):.1e}; "
          f"param err / movement {move_err:.1e}, max elem err {worst_elem:.1e}; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert errs[0] <= LOSS_TOL, f"{label}: the first step's loss differs from the plain loop by {errs[0]:.2e}"
    assert max(errs) <= loss_tol, f"{label}: losses differ from the plain loop by up to {max(errs):.2e} (relative)"
    assert max(norm_errs, default=0.0) <= norm_tol, \
        f"{label}: gradient norms differ from the plain loop's by up to {max(norm_errs):.2e} (relative)"
    assert move_err <= MOVE_TOL, f"{label}: parameters differ from the plain loop by {move_err:.2e} of their movement"
    assert worst_elem <= ELEM_TOL, f"{label}: a parameter element differs by {worst_elem:.2e}"


FP32 = dict(compute_dtype="fp32", weight_wire="fp32")


@pytest.mark.parametrize("name", sorted(NAMED_SCHEDULES))
def test_every_named_schedule_trains_like_a_plain_adamw_loop(name):
    # The compiled layer agrees with the eager one to rounding, which Adam amplifies past this test's 1e-3 of the
    # parameters' movement; test_compiled_layers_train_as_the_eager_layers_do covers it.
    knobs = knobs_for(name, compile_layers=False, **FP32)
    results, state = train("llama", knobs)
    assert results[-1].loss < results[0].loss - 0.3, "the model did not learn the synthetic sequences"
    assert_same_training(results, state, reference("llama", clip=knobs.clip > 0), "llama", name)


VARIANTS = {
    "serial-mb2": ("llama", knobs_for("serial", micro_batches=2, **FP32)),
    "double-buffer-recompute2": ("llama", knobs_for("double-buffer", recompute_block=2, **FP32)),
    "overlap-buffers1": ("llama", knobs_for("overlap", buffers=1, **FP32)),
    "overlap-buffers2": ("llama", knobs_for("overlap", buffers=2, **FP32)),
    "overlap-recompute2-mb2": ("llama", knobs_for("overlap", recompute_block=2, micro_batches=2, **FP32)),
    "long-context-2-on-gpu": ("llama", knobs_for("long-context", gpu_checkpoints=2, **FP32)),
    "long-context-recompute2-mb2": ("llama", knobs_for("long-context", recompute_block=2, micro_batches=2,
                                                       **FP32)),
    "gpu-adam-mb2": ("llama", knobs_for("gpu-adam", micro_batches=2, **FP32)),
    "split-adam-quarter": ("llama", knobs_for("split-adam", gpu_optimizer_fraction=0.25, **FP32)),
    "split-adam-kept-grads": ("llama", knobs_for("split-adam", retain_grads=1, **FP32)),
    # GPU updates of the previous step's gradients fill the weight slots of this step's forward
    "overlap-split-kept-grads-mb2": ("llama", knobs_for("overlap-split", gpu_optimizer_fraction=0.75, retain_grads=2,
                                                        micro_batches=2, **FP32)),
    "overlap-split-all-gpu-1buffer": ("llama", knobs_for("overlap-split", gpu_optimizer_fraction=1.0, buffers=1,
                                                         state_buffers=1, state_lookahead=0, **FP32)),
    "overlap-split-recompute2": ("llama", knobs_for("overlap-split", gpu_optimizer_fraction=0.5, recompute_block=2,
                                                    state_buffers=2, **FP32)),
    # GPU updates as gradients land: kept gradients, every layer on the GPU, two micro-batches
    "arrival-split-kept-grads-mb2": ("llama", knobs_for("arrival-split", gpu_optimizer_fraction=0.5, retain_grads=2,
                                                        micro_batches=2, **FP32)),
    "arrival-split-all-gpu": ("llama", knobs_for("arrival-split", gpu_optimizer_fraction=1.0, state_buffers=1,
                                                 **FP32)),
    # units that live on the GPU for the whole run, updated there as their gradients land
    "arrival-resident": ("llama", knobs_for("arrival", resident_embeddings=True, resident_layers=2, **FP32)),
    "arrival-split-resident-mb2": ("llama", knobs_for("arrival-split", resident_embeddings=True, resident_layers=1,
                                                      gpu_optimizer_fraction=0.25, retain_grads=1, micro_batches=2,
                                                      **FP32)),
    "qwen2/arrival-resident": ("qwen2", knobs_for("arrival", resident_embeddings=True, resident_layers=1, **FP32)),
    # resident layers whose forward keeps its graph for the backward, which then does not recompute
    "arrival-resident-kept-graphs": ("llama", knobs_for("arrival", resident_embeddings=True, resident_layers=2,
                                                        keep_activations=2, **FP32)),
    "arrival-resident-kept-graph-mb2": ("llama", knobs_for("arrival", resident_layers=2, keep_activations=1,
                                                           micro_batches=2, **FP32)),
    "qwen2/arrival-resident-kept-graph": ("qwen2", knobs_for("arrival", resident_embeddings=True, resident_layers=1,
                                                             keep_activations=1, **FP32)),
    "overlap-chunked-loss": ("llama", knobs_for("overlap", loss_chunk_tokens=5, **FP32)),
    # the layers' norm + MLP in tiles of 5 tokens (forward, recompute and backward)
    "long-context-mlp-tiles": ("llama", knobs_for("long-context", mlp_tile_tokens=5, **FP32)),
    "qwen2/overlap-mlp-tiles-recompute2-mb2": ("qwen2", knobs_for("overlap", mlp_tile_tokens=7, recompute_block=2,
                                                                  micro_batches=2, **FP32)),
    "tied/overlap": ("llama-tied", knobs_for("overlap", **FP32)),
    "tied/after-mb2": ("llama-tied", knobs_for("double-buffer", micro_batches=2, **FP32)),
    "tied/arrival": ("llama-tied", knobs_for("arrival", **FP32)),
    "tied/arrival-split": ("llama-tied", knobs_for("arrival-split", gpu_optimizer_fraction=1.0, **FP32)),
    "tied/gpu-adam": ("llama-tied", knobs_for("gpu-adam", **FP32)),
    "tied/overlap-split-kept-grads": ("llama-tied", knobs_for("overlap-split", gpu_optimizer_fraction=1.0,
                                                              retain_grads=4, **FP32)),
    "qwen2/overlap-split": ("qwen2", knobs_for("overlap-split", gpu_optimizer_fraction=0.5, retain_grads=1, **FP32)),
    "qwen2/overlap-recompute2": ("qwen2", knobs_for("overlap", recompute_block=2, **FP32)),
    # Speculative exact clipping: updates as gradients land, undone and redone when the norm exceeds the max. The
    # debug model's norm (~3) exceeds MAX_NORM in every step, so the executor defers every host update it expects to
    # be undone: here the host units take the deferred path and only GPU units (resident, split) are redone
    # (`check_clipping_paths` counts both); REDO_VARIANTS force the redo of every unit.
    "arrival-clip": ("llama", knobs_for("arrival", clip=MAX_NORM, **FP32)),
    "arrival-clip-mb2": ("llama", knobs_for("arrival", clip=MAX_NORM, micro_batches=2, **FP32)),
    "arrival-resident-clip": ("llama", knobs_for("arrival", clip=MAX_NORM, resident_embeddings=True,
                                                 resident_layers=2, **FP32)),
    "arrival-split-clip": ("llama", knobs_for("arrival-split", clip=MAX_NORM, gpu_optimizer_fraction=0.5, **FP32)),
    "tied/arrival-clip": ("llama-tied", knobs_for("arrival", clip=MAX_NORM, **FP32)),
    "qwen2/arrival-resident-clip": ("qwen2", knobs_for("arrival", clip=MAX_NORM, resident_embeddings=True,
                                                       resident_layers=1, **FP32)),
    "arrival-resident-clip-kept-graphs": ("llama", knobs_for("arrival", clip=MAX_NORM, resident_embeddings=True,
                                                             resident_layers=2, keep_activations=2, **FP32)),
}


def check_clipping_paths(results, knobs: ScheduleKnobs, label: str, min_redone: int) -> None:
    """In every step of a speculative (arrival, clip > 0) run whose norm exceeded the max, every applied unit took
    exactly one of the two exact paths, undone and redone or deferred to its CLIP_REDO (none kept its unclipped
    update). At least `min_redone` units were redone in the first such step: the count the undo's equality rests
    on. In a step after one that clipped, the resident units are deferred too (knob clip_redo unset), so only the
    other GPU units are redone there."""
    if not (knobs.clip and knobs.optimizer.startswith("arrival")):
        return
    resident = set(range(knobs.resident_layers)) | ({EMBED, HEAD} if knobs.resident_embeddings else set())
    clipping = [r for r in results if r.grad_norm is not None and r.grad_norm > knobs.clip]
    assert clipping, f"{label}: no step clipped, so neither the redo nor the deferral was compared"
    previous = {r.step: (r.grad_norm or 0.0) > knobs.clip for r in results}
    for r in clipping:
        plan = r.update
        redone, deferred = set(plan.redone_units), set(plan.deferred_units)
        assert not redone & deferred and set(plan.applied_units) == redone | deferred, \
            f"{label} step {r.step}: applied {plan.applied_units}, redone {plan.redone_units}, deferred {plan.deferred_units}"
        after_clipping = previous.get(r.step - 1, False)
        least = min_redone - len(resident) if after_clipping else min_redone
        assert len(redone) >= least and (not after_clipping or resident <= deferred), \
            f"{label} step {r.step}: {len(redone)} units redone (expected at least {least}), deferred {deferred}"
    assert not previous.get(clipping[0].step - 1, False)  # the first clipping step follows none: its redo is seen


# Units redone in every clipping step by the VARIANTS above: GPU updates never wait for the norm (4 = the embedding,
# head and two layers resident; 2 of the 4 layers updated on the GPU); host updates are all deferred.
MIN_REDONE = {"arrival-resident-clip": 4, "arrival-split-clip": 2, "qwen2/arrival-resident-clip": 3,
              "arrival-resident-clip-kept-graphs": 4}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_schedule_knobs_change_speed_not_results(variant):
    spec_key, knobs = VARIANTS[variant]
    results, state = train(spec_key, knobs)
    check_clipping_paths(results, knobs, variant, MIN_REDONE.get(variant, 0))
    assert_same_training(results, state, reference(spec_key, clip=knobs.clip > 0), spec_key, variant)


def speculate_always(monkeypatch) -> None:
    """Make the executor update every host unit as its gradients land, never deferring one it expects to be undone
    (after a step that clipped, or once the landed norms exceed the max): each then goes through the undo and the
    redo in every clipping step, the path an update takes whenever the clipping was not foreseen."""
    monkeypatch.setattr(Updates, "_clipping_likely", lambda self, unit: False)


REDO_VARIANTS = {
    "arrival-clip": ("llama", knobs_for("arrival", clip=MAX_NORM, **FP32)),
    "arrival-clip-mb2": ("llama", knobs_for("arrival", clip=MAX_NORM, micro_batches=2, **FP32)),
    "arrival-split-clip": ("llama", knobs_for("arrival-split", clip=MAX_NORM, gpu_optimizer_fraction=0.5, **FP32)),
    "tied/arrival-clip": ("llama-tied", knobs_for("arrival", clip=MAX_NORM, **FP32)),
}


@pytest.mark.parametrize("variant", list(REDO_VARIANTS))
def test_updates_undone_and_redone_in_every_clipping_step_train_like_the_plain_loop(variant, monkeypatch):
    """Every unit updated unclipped, then undone and redone with the clip coefficient, in every step (all clip):
    the undo must invert the update exactly enough for 20 steps to stay on the plain loop's trajectory."""
    speculate_always(monkeypatch)
    spec_key, knobs = REDO_VARIANTS[variant]
    results, state = train(spec_key, knobs)
    check_clipping_paths(results, knobs, variant, min_redone=len(SPECS[spec_key].units()))
    assert_same_training(results, state, reference(spec_key, clip=True), spec_key, f"redo/{variant}")


@pytest.mark.parametrize("spec_key,schedule", [("llama", "overlap"), ("llama-tied", "gpu-adam"),
                                               ("llama-tied", "overlap"), ("llama", "overlap-split")])
def test_bf16_weight_wire_with_fp32_compute_equals_a_loop_on_bf16_rounded_weights(spec_key, schedule):
    knobs = knobs_for(schedule, compute_dtype="fp32", weight_wire="bf16")
    results, state = train(spec_key, knobs)
    assert_same_training(results, state, reference(spec_key, weight_wire="bf16"), spec_key, f"bf16-wire-{schedule}",
                         loss_tol=BF16_LOSS_TOL, norm_tol=BF16_NORM_TOL)


@pytest.mark.parametrize("schedule", ["double-buffer", "gpu-adam", "overlap-split", "arrival-clip"])
def test_bf16_grad_wire_equals_a_loop_on_bf16_rounded_gradients(schedule):
    knobs = (knobs_for("arrival", clip=MAX_NORM, grad_wire="bf16", **FP32) if schedule == "arrival-clip"
             else knobs_for(schedule, grad_wire="bf16", **FP32))
    if schedule == "overlap-split":  # gradients kept on the GPU are rounded as the wire would round them
        knobs = dataclasses.replace(knobs, gpu_optimizer_fraction=0.5, retain_grads=1)
    results, state = train("llama", knobs)
    assert_same_training(results, state, reference("llama", grad_wire="bf16"), "llama", f"bf16-grads-{schedule}")


@pytest.mark.parametrize("schedule", ["double-buffer", "overlap", "gpu-adam", "overlap-split", "arrival-clip",
                                      "arrival-resident-clip", "arrival-clip-speculative"])
def test_a_step_with_non_finite_gradients_is_skipped_and_reported(schedule, monkeypatch):
    """Step 5's gradients of layer 1 are poisoned with NaN: that update is skipped (no unit changes, no Adam step
    count advances) and training goes on exactly as a plain loop that skipped it. "arrival-clip-speculative": every
    unit is updated before the norm is known, so the skip is every update undone."""
    bad_step = 5
    calls = {"n": 0}
    real_forward, real = compute_module.layer_functions(False)
    spec = SPECS["llama"]
    per_step = spec.num_layers  # one layer_backward per layer per step (1 micro-batch)

    def poisoned(w, x, cos, sin, spec_, grad_out, grad_acc):
        out = real(w, x, cos, sin, spec_, grad_out, grad_acc)
        if calls["n"] == bad_step * per_step + 1:
            grad_acc["mlp.up_proj.weight"][0, 0] = float("nan")
        calls["n"] += 1
        return out

    monkeypatch.setattr(compute_module, "layer_functions", lambda compiled, mlp_tile_tokens=0: (real_forward, poisoned))
    if schedule == "arrival-clip-speculative":
        speculate_always(monkeypatch)
    knobs = {"arrival-clip": knobs_for("arrival", clip=MAX_NORM, **FP32),
             "arrival-clip-speculative": knobs_for("arrival", clip=MAX_NORM, **FP32),
             "arrival-resident-clip": knobs_for("arrival", clip=MAX_NORM, resident_embeddings=True, resident_layers=2,
                                                **FP32)}.get(schedule) or knobs_for(schedule, **FP32)
    results, state = train("llama", knobs)
    assert [r.skipped for r in results] == [i == bad_step for i in range(STEPS)]
    assert results[bad_step].update.applied_units == [] and results[bad_step - 1].update.applied_units
    assert_same_training(results, state, reference("llama", skip_step=bad_step), "llama", f"nan-{schedule}")
