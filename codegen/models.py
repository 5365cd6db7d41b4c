"""Catalogue of real MoE model shapes users can name.

Figures from the models' published configuration files (``hidden_size``, routed expert count,
experts per token): DeepSeek-V3 and Kimi K2 (7168, 256/384 routed experts, top-8), Qwen3-235B-A22B
(4096, 128, 8), Qwen3-30B-A3B (2048, 128, 8), gpt-oss-120b (2880, 128, 4), Mixtral 8x7B
(4096, 8, 2), Llama 4 Maverick (5120, 128 routed, top-1), DeepSeek-V2 (5120, 160 routed experts, top-6).
"""

from __future__ import annotations

import difflib

import attrs


@attrs.frozen
class ModelShape:
    """The MoE shape of one model: hidden size H, routed experts E and top-k K."""

    name: str
    hidden: int
    num_experts: int
    topk: int


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("deepseek-v3", 7168, 256, 8),
        ModelShape("qwen3-235b-a22b", 4096, 128, 8),
        ModelShape("qwen3-30b-a3b", 2048, 128, 8),
        ModelShape("gpt-oss-120b", 2880, 128, 4),
        ModelShape("mixtral-8x7b", 4096, 8, 2),
        ModelShape("kimi-k2", 7168, 384, 8),
        ModelShape("llama4-maverick", 5120, 128, 1),
        ModelShape("deepseek-v2", 5120, 160, 6),
    )
}


def model(name: str) -> ModelShape:
    """Return the catalogue entry ``name``.

    Raises:
        ValueError: unknown name; the message suggests the closest catalogue names.
    """
    if not isinstance(name, str):
        raise ValueError(f"model={name!r}: must be a model name (str); known: {', '.join(MODELS)}")
    try:
        return MODELS[name]
    except KeyError:
        close = difflib.get_close_matches(name, MODELS, n=3, cutoff=0.4)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"model={name!r}: not in the catalogue ({', '.join(MODELS)}){hint}") from None
