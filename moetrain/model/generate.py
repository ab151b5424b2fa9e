"""Autoregressive generation with a KV cache: greedy, or temperature + top-p sampling.

Single-device and dropless: the MoE layers must route without capacity (a capacity limit
per token group would make the output depend on how the prompt is chunked), which
``generate`` checks.

Shape legend: B batch (1), S prompt length, V vocabulary.
"""

from __future__ import annotations

import torch

from moetrain.model.attention import KVCache
from moetrain.model.transformer import Transformer


def sample_next(
    logits_V: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None
) -> int:
    """Greedy (argmax, lowest id on ties) at temperature 0; otherwise a draw from the
    smallest set of tokens whose probability reaches ``top_p``, at ``temperature``."""
    if temperature == 0:
        return int(torch.argmax(logits_V))
    probs_V = torch.softmax(logits_V.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_V, order_V = probs_V.sort(descending=True)
        # Keep a token while the mass before it is below top_p (the first always stays).
        keep_V = (sorted_V.cumsum(-1) - sorted_V) < top_p
        probs_V = torch.zeros_like(probs_V).scatter(0, order_V[keep_V], sorted_V[keep_V])
    return int(torch.multinomial(probs_V.float(), 1, generator=gen))


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    """The ids that follow ``prompt_ids`` (not including them): up to ``max_new_tokens``,
    stopping after ``eos_id`` or at ``model.max_seq_len``. The prompt runs as one forward;
    every later step feeds one token against the cache."""
    if not prompt_ids:
        raise ValueError("generate: the prompt is empty")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"generate: temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}"
        )
    for layer in model.moe_layers().values():
        if layer.cfg.capacity_factor is not None:
            raise ValueError("generate: MoE layers must be dropless (moe.capacity_factor=null)")
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    cache = KVCache()
    limit = model.cfg.max_seq_len
    if len(prompt_ids) >= limit:
        raise ValueError(
            f"generate: the prompt has {len(prompt_ids)} tokens, model.max_seq_len is {limit}"
        )
    tokens_BS = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out: list[int] = []
    while len(out) < max_new_tokens and cache.length + tokens_BS.shape[1] <= limit:
        logits_V = model(tokens_BS, cache)[0, -1].float()
        next_id = sample_next(logits_V, temperature, top_p, gen)
        out.append(next_id)
        if next_id == eos_id:
            break
        tokens_BS = torch.tensor([[next_id]], dtype=torch.long, device=device)
    return out
