"""The transformers config of an exported FLT run (scripts/export_hf.py copies this file, modeling_flt.py and
model.py into the folder): every GPTConfig field (model.py) by its own name, checked by GPTConfig itself, plus
the names transformers looks for (hidden_size, num_hidden_layers, max_position_embeddings, ...) mapped onto them."""
from dataclasses import asdict, fields

from transformers import PreTrainedConfig

from .model import GPTConfig


class FLTConfig(PreTrainedConfig):
    model_type = "flt"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "num_key_value_heads": "n_kv_head", "max_position_embeddings": "sequence_len"}

    def __init__(self, **kwargs):
        model = {f.name: kwargs.pop(f.name) for f in fields(GPTConfig) if f.name in kwargs}
        for name, value in asdict(GPTConfig(**model)).items():  # defaults filled in, every setting checked
            setattr(self, name, value)
        kwargs.setdefault("tie_word_embeddings", False)  # wte and lm_head are two matrices
        super().__init__(**kwargs)

    def gpt_config(self):
        """model.py's GPTConfig of these settings (loops: the default K, which forward(loops=...) overrides)."""
        return GPTConfig(**{f.name: getattr(self, f.name) for f in fields(GPTConfig)})
