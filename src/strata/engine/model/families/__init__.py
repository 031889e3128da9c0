"""The supported model families: one module each, mapping Hugging Face names onto shared roles.

A family module says two things: how its `config.json` maps onto `ModelConfig` fields
(`config_fields`, reading each through `_fields.Fields`, which checks its type and range), and
what its checkpoint tensors are called (`global_names`, `layer_names`, `expert_names`), by
*role*. The roles and their shapes are common to all families and listed here; the shared layers
(`strata.engine.model.layers`) are built from roles, so the families differ only in which roles
they have and what they call them.

Roles, with shapes in the engine's dimension letters (D hidden, H heads, G kv heads, Dh head
dim, E experts, F expert width, Fs shared-expert width, V vocabulary):

| role | shape | present when |
| --- | --- | --- |
| embed | [V, D] | always |
| final_norm | [D] | always |
| lm_head | [V, D] | not tie_word_embeddings |
| attn_norm, mlp_norm | [D] | always |
| q / k / v | [H*Dh, D] / [G*Dh, D] / [G*Dh, D] | always |
| o | [D, H*Dh] | always |
| q_bias / k_bias / v_bias | [H*Dh] / [G*Dh] / [G*Dh] | qkv_bias |
| o_bias | [D] | o_bias |
| q_norm / k_norm | [H*Dh] / [G*Dh] ("full") or [Dh] / [Dh] ("head") | qk_norm != "none" |
| router | [E, D] | always |
| shared_gate, shared_up / shared_down | [Fs, D] / [D, Fs] | shared_expert_width > 0 |
| shared_router | [1, D] | shared_expert_width > 0 |
| expert gate, up / down | [F, D] / [D, F] | for each of the E experts |
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

from strata.engine.model.families import mixtral, olmoe, qwen2_moe, qwen3_moe
from strata.engine.model.families._shape import ModelShape

FAMILIES: dict[str, ModuleType] = {
    module.MODEL_TYPE: module for module in (mixtral, olmoe, qwen2_moe, qwen3_moe)
}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(sorted(FAMILIES))


def family(model_type: str) -> ModuleType:
    """The module of one family; ValueError listing the supported ones otherwise."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
        ) from None


def global_shapes(cfg: ModelShape) -> dict[str, tuple[int, ...]]:
    """Role -> shape of the tensors outside the layers."""
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def layer_shapes(cfg: ModelShape) -> dict[str, tuple[int, ...]]:
    """Role -> shape of one layer's dense (non-expert) tensors."""
    d, qw, kvw = cfg.hidden_size, cfg.q_width, cfg.kv_width
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (d,),
        "q": (qw, d),
        "k": (kvw, d),
        "v": (kvw, d),
        "o": (d, qw),
        "mlp_norm": (d,),
        "router": (cfg.n_experts, d),
    }
    if cfg.qkv_bias:
        shapes.update(q_bias=(qw,), k_bias=(kvw,), v_bias=(kvw,))
    if cfg.o_bias:
        shapes["o_bias"] = (d,)
    if cfg.qk_norm == "full":
        shapes.update(q_norm=(qw,), k_norm=(kvw,))
    elif cfg.qk_norm == "head":
        shapes.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    fs = cfg.shared_expert_width
    if fs:
        shapes.update(shared_gate=(fs, d), shared_up=(fs, d), shared_down=(d, fs))
        shapes["shared_router"] = (1, d)
    return shapes


def expert_shapes(cfg: ModelShape) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Shapes of one expert's gate [F, D], up [F, D] and down [D, F]."""
    f, d = cfg.expert_width, cfg.hidden_size
    return (f, d), (f, d), (d, f)


def expected_tensors(cfg: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold -> its shape, in load order."""
    return dict(iter_expected_tensors(cfg))


def iter_expected_tensors(cfg: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor the checkpoint must hold, in load order, one at a time: a
    check that stops at the first missing one never lists more names than the files hold."""
    fam = family(cfg.family)
    names = fam.global_names(cfg)
    yield from ((names[role], shape) for role, shape in global_shapes(cfg).items())
    for layer in range(cfg.n_layers):
        names = fam.layer_names(cfg, layer)
        yield from ((names[role], shape) for role, shape in layer_shapes(cfg).items())
        for expert in range(cfg.n_experts):
            yield from zip(fam.expert_names(layer, expert), expert_shapes(cfg), strict=True)


def tensor_count(cfg: ModelShape, n_layers: int | None = None) -> int:
    """len(expected_tensors(cfg)), counted without listing them; of its first `n_layers`
    layers only, if given."""
    per_layer = len(layer_shapes(cfg)) + 3 * cfg.n_experts
    return len(global_shapes(cfg)) + (cfg.n_layers if n_layers is None else n_layers) * per_layer
