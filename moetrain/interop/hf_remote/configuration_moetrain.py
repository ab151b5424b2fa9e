"""The transformers config of a model exported by ``moetrain export-hf`` when no Hugging Face
family expresses its architecture (loaded with ``trust_remote_code=True``).

Self-contained: it needs transformers and torch only, never moetrain. ``moetrain_model`` and
``moetrain_moe`` hold moetrain's architecture keys of the ``model`` and ``moe`` sections
(docs/config.md of moetrain); the usual transformers keys (hidden_size, ...) are derived from
them for tools that read those.
"""

from transformers import PretrainedConfig


class MoetrainConfig(PretrainedConfig):
    model_type = "moetrain"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        moetrain_model: dict | None = None,
        moetrain_moe: dict | None = None,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        **kwargs,
    ):
        self.use_cache = use_cache
        self.moetrain_model = dict(moetrain_model or {})
        self.moetrain_moe = dict(moetrain_moe or {})
        m = self.moetrain_model
        if m:
            self.vocab_size = m["vocab_size"]
            self.hidden_size = m["dim"]
            self.num_hidden_layers = m["n_layers"]
            self.num_attention_heads = m["n_heads"]
            self.num_key_value_heads = m.get("n_kv_heads") or m["n_heads"]
            self.max_position_embeddings = m["max_seq_len"]
            self.rms_norm_eps = m["norm_eps"]
        kwargs.setdefault("initializer_range", 0.02)
        self.initializer_range = kwargs.pop("initializer_range")
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


__all__ = ["MoetrainConfig"]
