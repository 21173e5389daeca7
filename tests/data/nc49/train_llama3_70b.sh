#!/bin/bash
# Llama-3-70B pretraining, Megatron-LM core (style of examples/llama/train_llama3_8b_h100_fp8.sh)
# 128 nodes x 8 H100 SXM; TP 8 (SP + tp-comm-overlap), PP 4 interleaved (vpp 4), CP 1, DP 32
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_IB_TIMEOUT=19
export NVTE_FWD_LAYERNORM_SM_MARGIN=16
export NVTE_BWD_LAYERNORM_SM_MARGIN=16

GPUS_PER_NODE=8
NNODES=128
NODE_RANK=${SLURM_NODEID:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=6000

CHECKPOINT_PATH=/lustre/ckpt/llama3-70b
TOKENIZER_MODEL=meta-llama/Meta-Llama-3-70B
DATA_PATH=/lustre/data/llama3_text_document

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --transformer-impl transformer_engine
    --num-layers 80
    --hidden-size 8192
    --ffn-hidden-size 28672
    --num-attention-heads 64
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --seq-length 8192
    --max-position-embeddings 8192
    --position-embedding-type rope
    --rotary-base 500000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --attention-backend fused
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1024
    --train-iters 500000
    --lr 1.5e-4
    --min-lr 1.5e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --recompute-granularity selective
    --recompute-modules core_attn
    --cross-entropy-loss-fusion
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 4
    --num-layers-per-virtual-pipeline-stage 5
    --context-parallel-size 1
    --sequence-parallel
    --tp-comm-overlap
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model $TOKENIZER_MODEL
    --vocab-size 128256
    --split 99,1,0
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --log-throughput
    --save-interval 500
    --eval-interval 1000
    --eval-iters 10
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --ckpt-format torch_dist
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
