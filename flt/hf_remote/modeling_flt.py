"""A thin transformers wrapper around model.py's GPT (copied beside this file): AutoModelForCausalLM with
trust_remote_code=True. forward and generate take `loops` (K; None = config.loops), `exit_threshold`
and `exit_rule` (decoding.py's EXIT_RULES; "gate": an export of a run with a learned exit gate), and
`cache_slots` (the KV cache's loop slots per layer, 1 to K; None = K, exact);
generate decodes with model.py's own KVCache, left-padded prompts included (attention_mask). The weights
are GPT's, under `model.`."""
import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_flt import FLTConfig
from .decoding import ExitGate
from .model import GPT, KVCache, rotary_tables


class FLTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = FLTConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.model = GPT(config.gpt_config())
        # the learned exit gate (config.json's exit_gate: its hidden size and margin), its weights
        # under model.exit_gate.
        gate = getattr(config, "exit_gate", None)
        if gate:
            self.model.exit_gate = ExitGate(config.n_embd, **gate)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # generate must not make a DynamicCache: forward makes model.py's KVCache

    @torch.no_grad()
    def _init_weights(self, module):
        """Only the RoPE tables: transformers builds the model on the meta device and loads the saved weights,
        but the tables are not saved (GPT's non-persistent buffers), so they are computed again here."""
        if isinstance(module, GPT):
            for buffer, table in zip((module.cos, module.sin), rotary_tables(module.config)):
                buffer.copy_(table)

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def get_output_embeddings(self):
        return self.model.lm_head

    def forward(self, input_ids, attention_mask=None, cache=None, use_cache=None, loops=None, exit_threshold=None,
                labels=None, return_dict=True, cache_slots=None, exit_rule="kl", **kwargs):
        """Logits (B, T, vocab_size) of the last of K = `loops` loops (None: config.loops). With use_cache
        (generate) the first call makes the KVCache, from attention_mask (0 = left padding) and cache_slots,
        and returns it as `cache`; the later calls append to it. A padded call without a cache gets one of
        its own."""
        B, T = input_ids.shape
        K = self.config.loops if loops is None else loops
        padded = attention_mask is not None and not bool(attention_mask.all())
        if cache is None and (use_cache or padded):
            cache = KVCache(B, self.model.loop_count(K), self.model.config, capacity=None if use_cache else T,
                            attention_mask=attention_mask, cache_slots=cache_slots)
        logits = self.model(input_ids, loops=K, kv_cache=cache, exit_threshold=exit_threshold,
                            exit_rule=exit_rule)
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here; -100 ignored
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)
