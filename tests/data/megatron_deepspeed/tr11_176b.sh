# BigScience tr11-176B-ml.slurm (bigscience-workshop/bigscience 9e64ede) CMD, its launcher and flags as given
# there; --vocab-size 250880 added (the fork pads to it with --pad-vocab-size-to, which meshplan does not read)
python -u -m torch.distributed.run --nproc_per_node 8 --nnodes 48 pretrain_gpt.py \
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 12 \
    --pp-partition-method 'type:transformer|embedding' \
    --num-layers 70 --hidden-size 14336 --num-attention-heads 112 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 2 --rampup-batch-size 192 16 9_765_625 --global-batch-size 2048 \
    --train-samples 220_000_000 --tokenizer-type PretrainedFromHF \
    --tokenizer-name-or-path bigscience/tokenizer --init-method-std 0.0048 \
    --embed-layernorm --sync-tp-duplicated-parameters --bf16 --seed 42 \
    --position-embedding-type alibi --checkpoint-activations \
    --abort-on-unmet-fused-kernel-constraints --pad-vocab-size-to 250880 --vocab-size 250880 \
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --lr 6e-5 --min-lr 6e-6 \
    --lr-decay-style cosine --clip-grad 1.0 --weight-decay 1e-1 \
    --log-interval 1 --save-interval 100 --eval-interval 1000 --eval-iters 1 \
    --num-workers 2 --data-impl mmap --distributed-backend nccl \
    --deepspeed --deepspeed_config ds_bf16_z0.json --zero-stage 0 --deepspeed-activation-checkpointing
