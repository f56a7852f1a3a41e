# The paper's training recipe (docs/recipe.md), shared by every GPU run: small.py and base.py add the size,
# and the command line adds the rest, e.g.
#   torchrun --nproc_per_node=8 train.py config/base.py --variant=LT_i --loops=6   # -> out/base_lt_i_k6
dataset = "fineweb"            # FineWeb-Edu: the authors' shards 0-248 for training, 249 for validation
tokenizer = "Qwen/Qwen3-4B"    # the authors' (nanochat/tokenizer.py): 151643 BPE + specials, padded to 151680
bos_token = "<|im_start|>"     # the authors' document token with Qwen3 (not <|endoftext|>)
sequence_len = 1024
total_batch_size = 2**19       # 524,288 tokens per optimizer step
device_batch_size = 8          # per GPU; gradient accumulation makes up 2**19 (memory: python train.py ... --dry_run)
num_steps = -1                 # the horizon: 20 tokens per parameter, all of them as in the authors' code
eval_interval = 250            # the authors' in-training validation (scripts/base_train.py):
eval_tokens = 20 * 2**19       # every 250 steps on 20 x 2**19 tokens
final_eval_tokens = 40 * 2**19  # Table 1's count at the last step (eval.py scores it with eval.sh's layout)
save_interval = 1000
divergence_window = 500        # a collapsed run stops (non-zero exit) instead of burning GPU-days
