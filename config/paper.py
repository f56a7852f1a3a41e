# The paper's training recipe (SPEC 6), shared by every GPU run: small.py and base.py add the size,
# and the command line adds the rest, e.g.
#   torchrun --nproc_per_node=8 train.py config/base.py --variant=LT_i --loops=6   # -> out/base_lt_i_k6
dataset = "fineweb"            # FineWeb-Edu parquet shards, as many as the horizon needs, on demand
tokenizer = "Qwen/Qwen3-0.6B"  # the Qwen3 BPE: 151643 tokens + specials, padded to 151680
bos_token = "<|im_start|>"     # the authors' document token with Qwen3 (not <|endoftext|>)
sequence_len = 1024
total_batch_size = 2**19       # 524,288 tokens per optimizer step
device_batch_size = 8          # per GPU; gradient accumulation makes up 2**19 (memory: python train.py ... --dry_run)
num_steps = -1                 # the horizon: 20 tokens per parameter, all of them as in the authors' code
eval_interval = 250
eval_tokens = 2**20
final_eval_tokens = 40 * 2**19  # the authors' final validation: 40 batches of 2**19 tokens
save_interval = 1000
divergence_window = 500        # a collapsed run stops (non-zero exit) instead of burning GPU-days
