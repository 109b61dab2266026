"""Multi30k En->De with a small Transformer that trains on 2 CPU cores.

The paper's base architecture (post-LN, sinusoidal positions, shared embeddings,
label smoothing 0.1, Adam 0.9/0.98/1e-9 with inverse-sqrt warmup) scaled down to
d_model=256, 3+3 layers, so that it trains on a laptop-class CPU within an hour.

Command (offline, reading the corpus from a local directory):

  python train.py --config=configs/default.py --workdir=workdirs/m30k \
      --config.data.manual_dir=../shared/data/multi30k

Expected (measured once, 2-core x86 CPU): 7.6M parameters; 1,500 steps at 0.55
steps/s, 45.7 min alone (before the 2-D matmuls of docs/benchmarks.md: 0.46
steps/s, 55 min). At step 1,500: validation loss 2.81 (label-smoothed),
perplexity 5.63, token accuracy 66.6%. On test_2016_flickr (1,000 sentences),
scored by `python eval.py --workdir=workdirs/m30k [FLAGS]`:

  checkpoint, decoder (FLAGS)             sacreBLEU  compound-split BLEU  chrF
  step 1500, beam 4, alpha 0.6 (none)     37.2       37.2                 61.4
  last 5 averaged (--checkpoint=avg:5)    37.2       37.3                 61.3
  step 1500, greedy (--decoder=greedy)    35.6       35.5                 60.4

Each BLEU equals `sacrebleu REF -i WORKDIR/eval/<file>.txt` run by hand on the
written translations. Over 3 seeds (results/recipe.md stage 8), the last checkpoint, beam 4:
test_2016_flickr 36.69 +- 0.60 sacreBLEU, 37.12 +- 0.58 lowercased; validation 36.60 +- 0.75,
36.70 +- 0.71; 49-53 min each, not alone. Published text-only Transformers reach 38-41 (tokenized
BLEU) on this test set with longer training.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  """Returns the default configuration (Multi30k En->De, small model)."""
  config = ml_collections.ConfigDict()

  config.seed = 0  # Root of every PRNG key: parameters, dropout and data order.
  config.dtype = 'float32'  # Activation/matmul dtype: 'float32' or 'bfloat16'.
  config.vocab_size = 8000  # Shared SentencePiece vocabulary size (both languages).

  # Optimisation (section 5.3 of the paper).
  config.num_train_steps = 1500  # Optimizer updates to train for (~15 epochs).
  config.warmup_steps = 400  # Steps of linear warmup to the peak learning rate (paper: 4000).
  config.lr_scale = 0.5  # Multiplier on d_model^-0.5 * min(step^-0.5, step*warmup^-1.5).
  config.schedule = 'inverse_sqrt'  # After warmup: 'inverse_sqrt' (paper), 'linear' or 'cosine'.
  config.peak_learning_rate = config_dict.placeholder(float)  # At warmup's end; None: lr_scale's.
  config.final_lr_fraction = 0.0  # linear/cosine: rate at num_train_steps, a fraction of the peak.
  config.weight_decay = 0.0  # AdamW's decoupled decay (0: Adam); not of biases and norm scales.
  config.adam_b1 = 0.9  # Adam beta1 (paper: 0.9).
  config.adam_b2 = 0.98  # Adam beta2 (paper: 0.98).
  config.adam_eps = 1e-9  # Adam epsilon (paper: 1e-9).
  config.label_smoothing = 0.1  # Label smoothing epsilon_ls (section 5.4).
  config.grad_accum_steps = 1  # Micro-batches accumulated per optimizer update.
  config.grad_clip_norm = 0.0  # Clip gradients to this global L2 norm first (0: off, the paper).
  config.skip_nonfinite_steps = False  # NaN/inf loss or grad norm: skip the update, not stop.

  # Logging, evaluation and checkpoints.
  config.log_every_steps = 25  # Console/metrics cadence for training rows.
  config.eval_every_steps = 250  # Validation loss cadence (always also at the end).
  config.eval_bleu_sentences = 512  # Validation sentences decoded for BLEU per eval (0: off).
  config.eval_bleu_decoder = 'greedy'  # 'greedy' or 'beam' (config.decode's) for that BLEU.
  config.checkpoint_every_steps = 100  # Checkpoint cadence (always also at the end).
  config.keep_checkpoints = 5  # Most recent checkpoints kept on disk.
  # The next two select by validation BLEU: eval_bleu_lc where it is config.target_metric, else
  # the cased eval_bleu.
  config.keep_best_checkpoints = 0  # Also keep the params of the N best val-BLEU evals (0: none).
  config.early_stopping_patience = 0  # Stop after N evals without a better val BLEU (0: never).
  config.target_metric = 'eval_bleu'  # Ranks sweeps: 'eval_bleu', 'eval_bleu_lc' or 'eval_loss'.

  # Fine-tuning (docs/training.md): the parameters of another run; optimizer, schedule, data anew.
  config.init_from = ''  # That run's workdir (a path or gs://), or hf:DIR; '': random.
  config.init_checkpoint = 'latest'  # As eval.py's --checkpoint: 'latest', a step, 'avg:N', 'best'.

  # Decoding (section 6.1): eval.py's defaults (its flags override them), validation BLEU's beam.
  config.decode = ml_collections.ConfigDict()
  config.decode.beam_size = 4  # Beam width (paper: 4).
  config.decode.alpha = 0.6  # GNMT length penalty exponent (paper: 0.6; 0: none).
  config.decode.max_extra_len = 50  # Output limit: source length + this (paper: 50).
  config.decode.checkpoint = 'latest'  # Scored: 'latest', a step, 'avg:N', 'best', 'avg_best:N'.

  # Model (section 3); read through transformer.model.ModelConfig.
  config.model = ml_collections.ConfigDict()
  config.model.architecture = 'encoder_decoder'  # Or 'decoder_only' (a language model).
  config.model.num_layers = 3  # N: layers in the encoder and in the decoder.
  config.model.d_model = 256  # d_model: width of the residual stream.
  config.model.num_heads = 4  # h: attention heads; d_k = d_v = d_model / h.
  config.model.d_ff = 1024  # d_ff: inner width of the position-wise FFN.
  config.model.dropout_rate = 0.1  # P_drop on sub-layer outputs and embedding sums.
  config.model.attention_dropout_rate = 0.0  # Dropout on attention weights (paper: none).
  config.model.ffn_dropout_rate = 0.0  # Dropout on the FFN's activation, after act() (paper: none).
  config.model.norm = 'post_ln'  # 'post_ln' (paper), 'pre_ln' or 'rmsnorm' (pre-norm RMSNorm).
  config.model.position = 'sinusoidal'  # 'sinusoidal' (paper), 'learned', 'rope' or 'alibi'.
  config.model.ffn_activation = 'relu'  # 'relu' (paper), 'gelu', 'swiglu' or 'swish' (Marian).
  config.model.use_bias = True  # Biases in attention/FFN Dense layers and LayerNorm (paper: yes).
  config.model.norm_epsilon = 1e-6  # Epsilon of every LayerNorm/RMSNorm (Marian, PyTorch: 1e-5).
  config.model.logits_bias = False  # A learned bias on the softmax logits (paper: none).
  config.model.share_embeddings = True  # One matrix for source, target and softmax (3.4).
  config.model.max_len = 512  # Longest position the model supports.
  config.model.attention_impl = 'auto'  # 'auto' (fused cuDNN where it applies), 'xla', 'cudnn'.
  config.model.remat = 'none'  # 'layer': recompute each layer's activations for gradients.

  # Data.
  config.data = ml_collections.ConfigDict()
  # 'multi30k', 'parallel_text' or 'wmt14_translate/de-en'; language models: 'text_lines', 'lm1b'.
  config.data.dataset = 'multi30k'
  config.data.source_lang = 'en'  # Source language code (explicit: never reversed).
  config.data.target_lang = 'de'  # Target language code (a language model's text_lines language).
  config.data.manual_dir = config_dict.placeholder(str)  # Local raw files; None: download.
  config.data.data_dir = '~/tensorflow_datasets'  # Where prepared TFDS data is written.
  config.data.vocab_path = config_dict.placeholder(str)  # SentencePiece model; None: beside data.
  config.data.target_vocab_path = config_dict.placeholder(str)  # Imported target model; None: one.
  config.data.train_split = 'train'  # Split to train on.
  config.data.eval_split = 'validation'  # Split for validation loss.
  config.data.test_split = 'test_2016_flickr'  # Default split for eval.py.
  config.data.max_len = 64  # Max tokens per side (with EOS) in training; longer is dropped.
  config.data.max_eval_len = 256  # Packed row length for evaluation (never drops a line).
  config.data.tokens_per_batch = 4096  # Global token budget per side per batch.
  config.data.spm_train_sentences = 1_000_000  # Sentences sampled to train SentencePiece.
  config.data.spm_model_type = 'unigram'  # SentencePiece's 'unigram' or 'bpe' (a vocabulary each).
  config.data.spm_normalization = 'nmt_nfkc'  # 'nmt_nfkc', or 'nmt_nfkc_cf': lowercases all text.
  config.data.num_workers = 0  # Grain worker processes reading/packing training batches (0: none).
  config.data.lines_per_document = 1  # Language models: consecutive lines joined per document.

  # Device mesh; one axis may be -1 (all remaining devices).
  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # Data-parallel replicas.
  config.mesh.fsdp = 1  # Fully sharded data parallel (params and optimizer state).
  config.mesh.tensor = 1  # Tensor parallel (heads, mlp, vocab).
  # The one table from logical axis names (on every parameter and activation) to mesh axes.
  config.mesh.rules = (
    ('batch', ('data', 'fsdp')),  # Rows of every batch: split over data x fsdp.
    ('embed', 'fsdp'),  # d_model of the weights: FSDP shards parameters along it.
    ('heads', 'tensor'),  # Attention heads: tensor parallel.
    ('mlp', 'tensor'),  # d_ff, the FFN's inner dimension: tensor parallel.
    ('vocab', 'tensor'),  # Vocabulary of the shared embedding/softmax: tensor parallel.
    ('kv', None),  # d_k = d_v within a head: never split.
    ('length', None),  # Sequence positions: never split.
  )

  # Processes of the run, as `sweep.py --launcher=slurm` asks Slurm for them (one srun task each;
  # train.py itself runs with the processes it is started with, see transformer/distributed.py).
  config.launch = ml_collections.ConfigDict()
  config.launch.nodes = 1  # Hosts (Slurm nodes) the run spans.
  config.launch.tasks_per_node = 1  # Processes per host: 1 with all its devices, or 1 per GPU.

  # Weights & Biases, opt-in (transformer/wandb_run.py): the rows and config of the run.
  config.wandb = ml_collections.ConfigDict()
  config.wandb.project = ''  # W&B project to log to ('': off; needs requirements/tracking.txt).
  config.wandb.entity = ''  # W&B user or team ('': the login's default).
  config.wandb.group = ''  # Groups runs in W&B, e.g. a sweep's trials ('': none).
  config.wandb.mode = 'online'  # 'offline': kept under WORKDIR/wandb/ for a later `wandb sync`.

  return config
