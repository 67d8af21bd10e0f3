"""The Llama decoder's shape (torch-free): the tensors of each unit and their HF names, FLOPs, the planner's
working-set model of a layer's backward, the profile signature and the init rule.

`LlamaFamily` is also the base of the Llama-shaped families (Mistral, Qwen2: `megatrain/model/mistral`, `qwen2`),
which override what differs. Every per-layer fact goes through `ffn_size(spec, layer)`, so a family whose layers
differ in MLP width overrides that one method (and `layer_kind`) and gets tensors, FLOPs and working set that follow.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatrain.model.fields import EMBED, HEAD, SpecError
from megatrain.model.llama import hf

if TYPE_CHECKING:
    from megatrain.model.spec import ModelSpec

LAYER_KIND = "layer"


class LlamaFamily:
    """Pre-norm decoder: GQA attention with rotate-half RoPE, SwiGLU MLP, RMSNorm; embedding, final norm, lm_head."""

    name = "llama"
    architecture = "LlamaForCausalLM"
    hf_defaults = hf.LLAMA_DEFAULTS

    # ---- shape -------------------------------------------------------------------------------------------------
    def ffn_size(self, spec: ModelSpec, layer: int) -> int:
        """The MLP width of one decoder layer (the same for every layer of a Llama)."""
        return spec.intermediate_size

    def layer_kind(self, spec: ModelSpec, layer: int) -> str:
        return LAYER_KIND

    def unit_tensors(self, spec: ModelSpec, unit: int) -> list[tuple[str, tuple[int, ...]]]:
        """Matrices first and 1-D tensors (norms, biases) last, so that weight decay, which applies to matrices
        only, covers one contiguous prefix of the unit's flat tile."""
        d = spec.hidden_size
        if unit == EMBED:
            return [("embed_tokens.weight", (spec.vocab_size, d))]
        if unit == HEAD:
            # With tied embeddings the head reads the embedding matrix; it is streamed as its own copy and
            # its gradient is added to the embedding's on the host.
            return [("lm_head.weight", (spec.vocab_size, d)), ("norm.weight", (d,))]
        _check_layer(spec, unit)
        f = self.ffn_size(spec, unit)
        mats = [
            ("self_attn.q_proj.weight", (spec.q_dim, d)),
            ("self_attn.k_proj.weight", (spec.kv_dim, d)),
            ("self_attn.v_proj.weight", (spec.kv_dim, d)),
            ("self_attn.o_proj.weight", (d, spec.q_dim)),
            ("mlp.gate_proj.weight", (f, d)),
            ("mlp.up_proj.weight", (f, d)),
            ("mlp.down_proj.weight", (d, f)),
        ]
        vecs = [("input_layernorm.weight", (d,)), ("post_attention_layernorm.weight", (d,))]
        if spec.qkv_bias:
            vecs += [
                ("self_attn.q_proj.bias", (spec.q_dim,)),
                ("self_attn.k_proj.bias", (spec.kv_dim,)),
                ("self_attn.v_proj.bias", (spec.kv_dim,)),
            ]
        return mats + vecs

    def hf_name(self, spec: ModelSpec, unit: int, local_name: str) -> str:
        if unit == EMBED:
            return f"model.{local_name}"
        if unit == HEAD:
            return local_name if local_name.startswith("lm_head") else f"model.{local_name}"
        return f"model.layers.{unit}.{local_name}"

    # ---- cost models -------------------------------------------------------------------------------------------
    def unit_forward_flops(self, spec: ModelSpec, unit: int, batch: int, seq: int) -> float:
        """Matmuls + causal attention; the embedding is a gather (0)."""
        tokens = batch * seq
        d = spec.hidden_size
        if unit == EMBED:
            return 0.0
        if unit == HEAD:
            return 2.0 * tokens * d * spec.vocab_size
        f = self.ffn_size(spec, unit)
        matmul = 2.0 * tokens * (d * (spec.q_dim + 2 * spec.kv_dim) + spec.q_dim * d + 3 * d * f)
        # QK^T and PV, each 2*S*S*q_dim per sequence, halved by the causal mask.
        attention = 2.0 * batch * seq * seq * spec.q_dim
        return matmul + attention

    def tiled_mlp_flops(self, spec: ModelSpec, unit: int, batch: int, seq: int) -> float:
        """The tiled MLP's backward recomputes its forward (3 matmuls of d x ffn per token)."""
        return 6.0 * batch * seq * spec.hidden_size * self.ffn_size(spec, unit)

    def layer_working_set(self, spec: ModelSpec, unit: int, act_bytes: int, tokens: int, cast_weights: bool,
                          mlp_tile_tokens: int, seq: int = 0) -> dict[str, int]:
        """GPU bytes of one layer's BACKWARD task (recompute from its checkpoint + local backward) at the moments
        that can be the peak, beyond the buffers, the checkpoints and the RoPE tables. Per micro-batch of n tokens,
        a = bytes of the compute dtype, what the recompute saves for the backward (eager layer, `layer.py`):

        - each RMSNorm: an fp32 copy of its input (4d per token; none in fp32, where the input itself is kept), the
          normalized value and the scaled output (a*d each);
        - SDPA (flash on CUDA): the rotated q and k, v and its output (a*(2q + 2kv)), fp32 logsumexp (4 per head);
          RoPE's products save only the tables, not q and k;
        - the MLP untiled: gate, silu(gate), up and their product (4a*ffn); tiled: only its input h (a*d);
        - around the call: the layer's output (alive until autograd.grad returns) and the incoming gradient (a*d).

        Moments: "mlp" = the MLP's backward (untiled: at the product's backward, the gradients of the product, silu
        and up exist while the product is released: 6a*ffn; tiled: the full-length gradient of h plus one tile
        recomputed and differentiated); "attention" = the flash backward after the MLP's saved tensors are
        released: the accumulated gradient of h and of the attention output (a*d, a*q), the kernel's fp32 dq
        accumulator (4q) and softmax sums (4 per head), dq, dk, dv, and with grouped KV heads dk and dv expanded to
        every query head (2a*q). Each adds the layer's weights cast to the compute dtype (`cast_weights`: the
        weight wire differs) and the weight gradients autograd returns (a per parameter), and the tiled MLP its
        fp32 weight-gradient sums.

        A sliding window shorter than the sequence (`masked_window`; `seq` tokens a sequence) adds, at both
        moments, the (T, T) mask in the compute dtype (rows padded to 16 elements: `layer.window_mask`), which SDPA
        saves for its backward, and with grouped KV heads the K and V expanded to every query head (a*2(q - kv) per
        token more than the grouped ones).
        """
        a, n = act_bytes, tokens
        d, f, q, kv, nh = spec.hidden_size, self.ffn_size(spec, unit), spec.q_dim, spec.kv_dim, spec.num_heads
        norm, attn = self._saved_per_token(spec, a)
        around = 2 * a * d  # the layer output and the gradient coming in
        weights = spec.unit_params(unit) * (a + (a if cast_weights else 0))
        if mlp_tile_tokens:
            t = mlp_tile_tokens
            tile = t * (norm + 2 * a * d + 6 * a * f)  # the tile's norm, output, gradient; MLP at its product's bwd
            mlp = n * (norm + attn + around + 2 * a * d) + tile + 4 * (3 * d * f + d)  # + h, its gradient; fp32 sums
        else:
            mlp = n * (2 * norm + attn + around + 6 * a * f)
        gqa_expand = 2 * a * q if spec.num_kv_heads != spec.num_heads else 0
        flash = 4 * q + 4 * nh + gqa_expand + a * (q + 2 * kv)
        attention = n * (norm + attn + around + a * d + a * q + flash)
        window = 0
        if masked_window(spec, seq):
            window = seq * (-(-seq // 16) * 16) * a + n * 2 * a * (q - kv)
        return {"mlp": mlp + weights + window, "attention": attention + weights + window}

    def layer_graph_bytes(self, spec: ModelSpec, unit: int, act_bytes: int, tokens: int, cast_weights: bool,
                          compiled: bool) -> int:
        """GPU bytes a layer's forward graph holds until its backward (knob keep_activations): what its forward
        saves for the backward, per token, and the weights cast to the compute dtype when the wire differs (they
        are the graph's leaves). The input is the checkpoint and the RoPE tables are the step's: counted apart.

        Eager (`compiled` false): autograd's saved tensors, `layer_working_set`'s list: two RMSNorms (an fp32 copy
        of the input below fp32, the normalized value and the scaled output), SDPA's q, k, v, output and
        logsumexp, the untiled MLP's gate, silu(gate), up and their product.

        Compiled (`Placement.layer_kernel` "compiled"): what AOTAutograd's min-cut partitioner (the one inductor
        uses) keeps of the fused graph, which recomputes the cheap elementwise ops in its backward instead of
        saving their outputs: in the compute dtype the first norm's output, the second norm's input and output
        (3d), q, k, v and the attention output (2q + 2kv), gate, up and their product (3 ffn); in fp32 SDPA's
        logsumexp (4 per head) and each norm's rsqrt statistic (4 per norm). No fp32 copies of the norms' inputs,
        no silu(gate). This is the structure the partitioner gives the CPU (tests/test_kept_graphs.py counts it)
        and the one that matches the H100 (torch 2.11, inductor, bf16) within 1%: bench-3b at 8x2048 with 24
        resident layers peaked at 45.21 GiB and with 12 of them keeping their graphs at 62.65 GiB, 1.453 GiB a
        kept layer (here 1.452: 83,048 B a token + the cast weights, 0.185); at 16x2048 with 16 resident and 6
        kept at 54.05 GiB, about 2.7 GiB a kept layer (here 2.719). The eager count, unchanged, says 2.17 and 4.16
        for those (130,144 B a token): the compiled layer must not be planned with it.
        """
        a, d, f = act_bytes, spec.hidden_size, self.ffn_size(spec, unit)
        norm, attn = self._saved_per_token(spec, a)
        if compiled:
            per_token = 3 * a * d + 2 * 4 + attn + 3 * a * f  # norms: 3 (n, d) + rsqrt; attention; gate, up, product
        else:
            per_token = 2 * norm + attn + 4 * a * f
        return tokens * per_token + (spec.unit_params(unit) * a if cast_weights else 0)

    @staticmethod
    def _saved_per_token(spec: ModelSpec, act_bytes: int) -> tuple[int, int]:
        """Bytes a token's forward saves for the backward (`layer_working_set`'s list): (one RMSNorm with the
        projections after it: an fp32 copy of its input below fp32, the normalized value and the scaled output;
        SDPA: the rotated q and k, v and its output, fp32 logsumexp per head)."""
        a, d = act_bytes, spec.hidden_size
        norm = (4 * d if a < 4 else 0) + 2 * a * d
        attn = a * (2 * spec.q_dim + 2 * spec.kv_dim) + 4 * spec.num_heads
        return norm, attn

    def signature(self, spec: ModelSpec) -> str:
        """Two models that share it have the same per-layer (and embedding / head) compute times."""
        bias = "-qkvbias" if spec.qkv_bias else ""
        window = f"-sw{spec.sliding_window}" if spec.sliding_window is not None else ""  # a masked attention kernel
        return (f"{spec.model_type}-d{spec.hidden_size}-f{spec.intermediate_size}-h{spec.num_heads}x{spec.head_dim}"
                f"-kv{spec.num_kv_heads}-v{spec.vocab_size}{bias}{window}")

    # ---- init ----------------------------------------------------------------------------------------------------
    def init_rule(self, name: str, shape: tuple[int, ...]) -> str:
        """As HF's `_init_weights` for Llama / Qwen2 (`initializer_range`): every matrix (embedding, projections,
        lm_head) N(0, std), RMSNorm weights 1, biases 0."""
        if len(shape) == 2:
            return "normal"
        return "ones" if name.endswith("norm.weight") else "zeros"

    # ---- HF config.json ------------------------------------------------------------------------------------------
    def from_hf_config(self, cfg: dict) -> dict[str, Any]:
        c = {**self.hf_defaults, **{k: v for k, v in cfg.items() if v is not None}}
        hf.check_values(c)
        self.check_hf_options(c)
        # `c` drops nulls so that defaults fill them; the window reads the file itself, where null means "none"
        return hf.spec_fields(c, model_type=self.name, qkv_bias=self.qkv_bias_of(c),
                              sliding_window=self.sliding_window_of({**c, **cfg}))

    # Refused fields beyond `hf.UNSUPPORTED_FIELDS` (field, accepted values, what it does): transformers' Llama
    # reads attention_bias; it ignores sliding_window and layer_types, which a Llama config carries only by mistake.
    unsupported_fields: tuple[tuple[str, tuple, str], ...] = (
        ("attention_bias", (False,), "biases on the attention projections of a llama model "
                                     "(model_type qwen2 has q/k/v biases)"),
        ("sliding_window", (), "sliding windows in a llama model (transformers' Llama ignores the field; "
                               "model_type mistral has them)"),
        ("use_sliding_window", (False,), "sliding windows in a llama model (model_type qwen2 has them)"),
    )
    # Whether a spec of this family may carry a sliding window (`ModelSpec.sliding_window`).
    has_sliding_window = False

    def check_hf_options(self, c: dict) -> None:
        """Refuse options of the family's config that megatrain does not implement (`unsupported_fields`)."""
        hf.check_unsupported(c, self.unsupported_fields)
        types = hf.layer_types_of(c)
        if types and any(t != "full_attention" for t in types):
            raise SpecError("config.json: layer_types names sliding_attention layers; a llama model has none "
                            "(model_type mistral or qwen2 has sliding windows)")

    def sliding_window_of(self, c: dict) -> int | None:
        """The window of every layer (None: full causal attention); a Llama has none."""
        return None

    def qkv_bias_of(self, c: dict) -> bool:
        """Whether q/k/v projections have biases (never, for Llama)."""
        return False

    def to_hf_config(self, spec: ModelSpec) -> dict:
        cfg = hf.common_config(spec, self.architecture)
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
        return hf.with_rope_scaling(cfg, spec)

    # ---- layer math ----------------------------------------------------------------------------------------------
    def layer(self):
        from megatrain.model.llama import layer  # imports torch: loaded on first use, so specs and the CLI stay torch-free
        return layer

    def __repr__(self) -> str:
        return f"<model family {self.name}>"


def masked_window(spec: ModelSpec, seq: int) -> bool:
    """Whether attention over sequences of `seq` tokens runs with the sliding-window mask: a window shorter than
    the sequence (a window of at least `seq` tokens sees the whole causal context: plain causal attention)."""
    return spec.sliding_window is not None and spec.sliding_window < seq


def _check_layer(spec: ModelSpec, unit: int) -> None:
    if not 0 <= unit < spec.num_layers:
        raise SpecError(f"unit {unit} is not a layer of {spec.name} ({spec.num_layers} layers)")

