# Reasoning that needs depth, on a laptop (docs/beyond.md): S3 state tracking, 2 blocks looped 4 times
#   python train.py config/reasoning.py --variant=LT_i     # -> out/reasoning/d2_lt_i_k4_s3
dataset = "s3"
task_difficulty = 8         # items of 8 elements; a target at each, its prefix's product
sequence_len = 63           # 7 items of 9 tokens a row
depth = 2                   # d_model 128, one head of 128
loops = 4
device_batch_size = 32
total_batch_size = 32 * 63
num_steps = 1500
eval_interval = 250
sample_tokens = 0           # no text to continue
out_root = "out/reasoning"
