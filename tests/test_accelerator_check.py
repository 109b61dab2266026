"""bench/accelerator_check.py in its CPU smoke mode: the GPU machine's command, end to end, small.

One config (the base model's, shrunk) keeps it to seconds; the big model's run is the same code.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_smoke_mode_trains_decodes_checks_attention_and_reports(tmp_path):
  out = tmp_path / 'check.json'
  command = [sys.executable, 'bench/accelerator_check.py', '--smoke', '--configs=base']
  command += ['--train_steps=3', f'--out={out}', f'--root={tmp_path / "root"}']
  result = subprocess.run(
    command,
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report['devices'] == '1 x cpu (cpu)' and report['smoke']
  base = report['configs']['base']
  assert base['train_steps'] == 3 and base['dtype'] == 'bfloat16'
  assert base['rows_x_length_per_step'] == [16, 32]  # configs/tiny.py's batch: 512 tokens.
  assert base['target_tokens_per_sec'] > 0 and base['steps_per_sec'] > 0
  assert base['input_wait_ms_per_step'] > 0 and 0 < base['input_wait_share'] < 1
  assert base['beam4_sentences_per_sec'] > base['beam4_sentences_per_sec_with_compiles'] > 0
  assert 0 <= base['test_bleu_after_these_steps'] <= 100
  assert base['mfu'] is None and base['peak_memory_gib'] is None  # No published peak on CPUs.
  assert base['dry_run_memory_estimate_gib'] > 0
  # On a CPU 'auto' is the einsum, compared with jax.nn's XLA path: equal up to bfloat16.
  assert base['fused_kernel_in_step'] is False
  assert base['loss_auto'] == pytest.approx(base['loss_xla'], rel=1e-3)
  assert base['grad_relative_difference'] < 0.05
  lines = result.stdout.splitlines()
  header = next(i for i, line in enumerate(lines) if line.startswith('config | target tok/s'))
  assert lines[header + 2].startswith('base | ')  # The table: a header, a rule, a row.
