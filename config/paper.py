# config/: paper.py is the paper's shared recipe (SPEC 6); each experiment file does
# `from config.paper import *` (diag_*.py through diag.py) and sets only what differs.
# cpu.py and cpu_diag_*.py are CPU-scale runs on the embedded corpus instead.
dataset = "fineweb"            # FineWeb-Edu parquet shards, downloaded on demand
tokenizer = "Qwen/Qwen3-0.6B"  # the Qwen3 BPE: 151643 tokens + <|endoftext|>, padded to 151680
sequence_len = 1024
total_batch_size = 2**19       # 524,288 tokens per optimizer step
# Sequences per forward per GPU. Saved activations per 1024-token sequence, measured on CPU
# with bf16 autocast at base size: ~1.2 GB for the 151680-way fp32 logits + ~0.45 GB per loop.
# So 32 would need 40 GB + K * 15 GB; 8 needs ~55 GB at K = 12, inside an 80 GB H100. Raise it
# for few loops or the small model (gradient accumulation adapts).
device_batch_size = 8
num_steps = -1                 # the 20x horizon: 20 tokens per non-embedding parameter
# Horizon of the base model (depth 12): (317.9M - 151680*768 embedding) * 20 = 4.03B tokens
# = 7683 steps. A shard holds ~250M characters ~ 55M Qwen3 tokens, so 74 shards; 80 leaves
# ~10% slack for the estimate (a short corpus would silently repeat). Small needs 26.
num_shards = 80
eval_interval = 250
eval_tokens = 2**20
save_interval = 1000
sample_tokens = 64
