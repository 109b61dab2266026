"""Generation by the decoder-only model: prompts continued, greedily or by sampling.

`generate` continues prompts through the decoders of `decoding.py`: they start
from BOS as in translation, and while a row is inside its prompt the step
function allows only the prompt's next token (every other logit is -inf), so
greedy decoding and sampling (any temperature, top-k, top-p) copy the prompt
into the cache one token per step, then continue it freely. Rows with prompts
of different lengths decode together.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from transformer import decoding, inference, sharding
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.errors import InvalidInput
from transformer.model import Transformer
from transformer.tasks.language_model import data


def _init_state(
  params, prompt_tokens_BP: jax.Array, model_config: ModelConfig, max_decode_len: int
):
  """Creates the decoder-only model's cache and the prompt-forcing state."""
  model = Transformer(
    model_config.replace(deterministic=True, decode=True, max_decode_len=max_decode_len)
  )
  bos_B1 = jnp.full((prompt_tokens_BP.shape[0], 1), tokenizer_lib.BOS_ID, jnp.int32)
  _, variables = model.apply(
    {'params': params}, None, None, bos_B1, method=Transformer.decode, mutable=['cache']
  )
  state = {
    'cache': variables['cache'],
    'prompt': prompt_tokens_BP,
    'prompt_lengths': jnp.sum(prompt_tokens_BP != 0, axis=1).astype(jnp.int32),
    'step': jnp.array(0, jnp.int32),  # Shared scalar: the output position being chosen.
  }
  return model, state


def _logits_fn(model: Transformer, params):
  """One step of the decoder-only model; inside its prompt a row can only copy the prompt.

  Never chooses PAD or BOS: they are not tokens of a document.
  """

  def step(tokens_N1, state):
    logits_N1V, variables = model.apply(
      {'params': params, 'cache': state['cache']},
      None,
      None,
      tokens_N1,
      method=Transformer.decode,
      mutable=['cache'],
    )
    logits_NV = logits_N1V[:, 0]
    prompt_NP, position = state['prompt'], state['step']
    forced_N = jax.lax.dynamic_index_in_dim(
      prompt_NP, jnp.minimum(position, prompt_NP.shape[1] - 1), axis=1, keepdims=False
    )
    only_forced_NV = jnp.where(
      jnp.arange(logits_NV.shape[-1]) == forced_N[:, None], 0.0, decoding.NEG_INF
    )
    in_prompt_N1 = (position < state['prompt_lengths'])[:, None]
    logits_NV = jnp.where(in_prompt_N1, only_forced_NV, logits_NV)
    # PAD and BOS never occur inside a document (they are never training targets).
    vocab_V = jnp.arange(logits_NV.shape[-1])
    logits_NV = jnp.where(
      (vocab_V == tokenizer_lib.PAD_ID) | (vocab_V == tokenizer_lib.BOS_ID),
      decoding.NEG_INF,
      logits_NV,
    )
    return logits_NV, {**state, 'cache': variables['cache'], 'step': position + 1}

  return step


def generate(
  params,
  prompt_tokens_BP: jax.Array,
  rng: jax.Array,
  *,
  model_config: ModelConfig,
  options: inference.DecodeOptions,
  first_pass: bool = False,
) -> decoding.Decoded:
  """Each prompt and its continuation: tokens int32 [B, P + max_extra_len], 0-padded after EOS.

  `prompt_tokens_BP`: pieces without BOS or EOS, 0-padded on the right (an
  all-zero row is an empty prompt). Row b holds its prompt in its first P_b
  positions, then at most `max_extra_len` new tokens (EOS included): the
  continuation ends at EOS, the end of the document. Greedy or sampling only.
  With `first_pass`, only `inference.first_pass_steps` steps are decoded (the rest of
  each row is padding) and `done` says which rows finished within them.
  """
  if options.decoder == 'beam':
    raise InvalidInput(
      "Generation decodes greedily or by sampling; decoder='beam' is for translation."
    )
  max_decode_len, max_steps = inference.decode_steps(prompt_tokens_BP.shape[1], options, first_pass)
  model, state = _init_state(params, prompt_tokens_BP, model_config, max_steps)
  max_lengths_B = state['prompt_lengths'] + options.max_extra_len
  return inference.run_decoder(
    _logits_fn(model, params),
    state,
    rng,
    options,
    max_decode_len,
    max_lengths_B,
    max_steps=max_steps,
  )


def make_generate_fn(
  model_config: ModelConfig,
  options: inference.DecodeOptions,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
):
  """`generate(params, prompt_tokens, rng) -> tokens` as a host array, jitted per prompt width.

  In two passes (`inference.TwoPass`), as translation decodes: `inference.first_pass_steps`
  steps first, then all of them for the rows that need more; each row has its own key, so
  the outputs are one pass's. Rows are split over the mesh (`inference.jit_rows`).
  """

  decode_fn = functools.partial(generate, model_config=model_config, options=options)
  return inference.two_pass_fn(decode_fn, mesh, rules)


def continue_prompts(
  config: ml_collections.ConfigDict,
  model_config: ModelConfig,
  params,
  prompts: Sequence[str],
  *,
  options: inference.DecodeOptions,
  batch_size: int | None = None,
  seed: int = 0,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
) -> list[str]:
  """Each prompt followed by the model's continuation (up to EOS or `max_extra_len` tokens).

  Greedy decoding or sampling (temperature, top-k, top-p), seeded.

  Args:
    config: The run's config.
    model_config: Its model.
    params: The parameters to generate with.
    prompts: The texts to continue; an empty one gets a document written from scratch.
    options: The decoder (greedy or sample) and its settings.
    batch_size: Most prompts decoded at once (default: `inference.batch_size`'s for the
      devices of `mesh`).
    seed: Of the sampler's key.
    mesh: The devices the rows are split over (None: one device).
    rules: `mesh`'s logical axis rules.

  Returns:
    One output per prompt, in order.
  """
  tokenizer = tokenizer_lib.get_tokenizer(
    config.data, vocab_size=config.vocab_size, seed=config.seed
  )
  generate_fn = make_generate_fn(model_config, options, mesh, rules)
  if batch_size is None:
    batch_size = inference.batch_size(options, mesh)
  batches = data.prompt_batches(prompts, tokenizer, batch_size, config.model.max_len)
  texts, _ = inference.decode_batches(
    generate_fn,
    params,
    batches,
    tokenizer,
    jax.random.key(seed),
    input_key='prompt_tokens',
    concurrency=inference.concurrent_batches(mesh),
  )
  return [texts[i] for i in range(len(prompts))]
