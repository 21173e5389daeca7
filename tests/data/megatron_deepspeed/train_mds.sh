torchrun --nnodes 2 --nproc_per_node 8 pretrain_gpt.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --global-batch-size 64 --seq-length 4096 \
  --bf16 --sequence-parallel --use-flash-attn-v2 --lr 3e-4 \
  --deepspeed --deepspeed_config ds_zero1.json --zero-stage 1 \
  --deepspeed-activation-checkpointing --checkpoint-activations
