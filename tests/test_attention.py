"""Scaled dot-product attention and masks on hand-computed cases."""

import jax.numpy as jnp
import numpy as np

from transformer import attention


def test_dot_product_attention_matches_hand_computation():
  # One batch, one head, d_k = 4; two queries over three keys.
  q = np.array([[1.0, 0, 0, 0], [0, 2.0, 0, 0]], np.float32)
  k = np.array([[2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 0, 0]], np.float32)
  v = np.array([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]], np.float32)
  out, weights = attention.dot_product_attention(
    q[None, :, None], k[None, :, None], v[None, :, None], mask_B1LS=None
  )
  # Eq. 1 by hand: logits = q k^T / sqrt(4).
  logits = np.array([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
  expected_w = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.testing.assert_allclose(weights[0, 0], expected_w, rtol=1e-6)
  np.testing.assert_allclose(out[0, :, 0], expected_w @ v, rtol=1e-6)


def test_masked_keys_get_zero_weight_and_do_not_change_output():
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(1, 2, 2, 4)).astype(np.float32) for _ in range(3))
  mask = jnp.array([True, False])[None, None, None, :]
  out, weights = attention.dot_product_attention(q, k, v, mask)
  np.testing.assert_allclose(weights[..., 1], 0.0, atol=0)
  # Only key 0 is visible: every query returns value 0 exactly.
  np.testing.assert_allclose(out, np.broadcast_to(v[:, :1], out.shape), rtol=1e-6)


def test_segment_mask_is_padding_mask_and_separates_packed_examples():
  segments = jnp.array([[1, 1, 2, 0]])
  mask = np.asarray(attention.segment_mask(segments, segments))[0, 0]
  expected = np.array(
    [
      [1, 1, 0, 0],
      [1, 1, 0, 0],
      [0, 0, 1, 0],
      [0, 0, 0, 0],  # Padding attends nowhere (and is never attended).
    ],
    dtype=bool,
  )
  np.testing.assert_array_equal(mask, expected)


def test_causal_mask_is_lower_triangular():
  mask = np.asarray(attention.causal_mask(3))[0, 0]
  np.testing.assert_array_equal(mask, [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
