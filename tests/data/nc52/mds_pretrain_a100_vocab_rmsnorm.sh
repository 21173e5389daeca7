#!/bin/bash
# Megatron-DeepSpeed pretraining of a Llama-3-70B-like model, 4 nodes x 8 A100 40GB
NNODES=4
GPUS_PER_NODE=8
MASTER_ADDR=node001
MASTER_PORT=6000

torchrun --nproc_per_node 8 --nnodes 4 --rdzv_backend c10d --rdzv_endpoint node001:6000 \
    pretrain_gpt.py \
    --tensor-model-parallel-size 8 \
    --pipeline-model-parallel-size 4 \
    --num-layers 80 --vocab-size 128256 \
    --hidden-size 8192 \
    --ffn-hidden-size 28672 \
    --num-attention-heads 64 \
    --num-key-value-heads 8 \
    --seq-length 4096 \
    --max-position-embeddings 4096 \
    --micro-batch-size 1 \
    --global-batch-size 512 \
    --train-iters 250000 \
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
    --bf16 \
    --swiglu \
    --normalization rmsnorm \
    --use-rotary-position-embeddings \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --no-query-key-layer-scaling \
    --attention-dropout 0 --hidden-dropout 0 \
    --use-flash-attn-v2 \
    --sequence-parallel \
    --tokenizer-type HFTokenizer --tokenizer-model /data/llama3-tokenizer \
    --data-path /data/pile_text_document \
    --checkpoint-activations \
    --deepspeed-activation-checkpointing \
    --deepspeed --deepspeed_config ds_mds.json --zero-stage 1 \
    --save /ckpt --load /ckpt --save-interval 500 --log-interval 10
