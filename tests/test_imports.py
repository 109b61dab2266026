"""The imports inside `transformer/` go one way: no module imports, even indirectly, itself.

Every import counts: at module level, under `if TYPE_CHECKING:` and inside
functions. A circle there is a circle of ideas even when Python tolerates it at
run time (a type-only import, a deferred one), and it makes the modules on it
impossible to read, test or move one at a time.

Reads files only (no JAX), so it runs in well under a second.
"""

import ast
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / 'transformer'


def _module_name(path: pathlib.Path) -> str:
  """'transformer.tasks.task' for transformer/tasks/task.py; a package is named by its folder."""
  parts = path.relative_to(REPO_ROOT).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob('*.py'))}


def _imports(name: str, path: pathlib.Path) -> dict[str, int]:
  """The modules of the package that `name` imports, each with the line of its first import.

  `from P import x` imports the module P.x when there is one, else P (x is a name
  P defines). Importing P.x also runs P's __init__.py, but before P.x itself, so
  that is no edge from P.x to P.
  """
  package = name if path.name == '__init__.py' else name.rpartition('.')[0]
  found = {}
  for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
    targets = []
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:  # Relative: one dot is the importing module's package.
        parent = package.split('.')[: len(package.split('.')) - node.level + 1]
        base = '.'.join([*parent, *([node.module] if node.module else [])])
      targets = [
        f'{base}.{alias.name}' if f'{base}.{alias.name}' in MODULES else base
        for alias in node.names
      ]
    for target in targets:
      if target in MODULES and target != name:
        found.setdefault(target, node.lineno)
  return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
  """One cycle per edge back to a module still being visited, by depth-first search."""
  cycles, done, path = [], set(), []

  def visit(module: str) -> None:
    path.append(module)
    for target in sorted(graph[module]):
      if target in path:
        cycles.append([*path[path.index(target) :], target])
      elif target not in done:
        visit(target)
    path.pop()
    done.add(module)

  for module in sorted(graph):
    if module not in done:
      visit(module)
  return cycles


def _describe(cycle: list[str]) -> str:
  """'a (a.py:12) -> b (b.py:30) -> a': each arrow at the line of its import."""
  steps = [
    f'{module} ({MODULES[module].relative_to(REPO_ROOT)}:{GRAPH[module][target]})'
    for module, target in zip(cycle, cycle[1:], strict=False)
  ]
  return ' -> '.join([*steps, cycle[-1]])


def test_the_graph_sees_the_imports():
  # Guards the test below against passing on a graph without edges.
  assert 'transformer.checkpoints' in GRAPH['transformer.training'], GRAPH['transformer.training']
  assert 'transformer.tasks.task' in GRAPH['transformer.tasks'], GRAPH['transformer.tasks']


def test_no_import_cycles():
  cycles = [_describe(cycle) for cycle in _cycles(GRAPH)]
  assert not cycles, (
    'Import cycles in transformer/ (move what both sides need into a module below them):\n'
    + '\n'.join(cycles)
  )


def test_the_library_never_imports_tools():
  # transformer/tools/ is tooling around the library (its __init__.py, the README's layout).
  imports = [
    f'{module} imports {target}'
    for module, targets in GRAPH.items()
    if not module.startswith('transformer.tools')
    for target in targets
    if target.startswith('transformer.tools')
  ]
  assert not imports, imports


def test_the_commands_start_without_the_heavy_packages_they_seldom_need():
  """Every command imports its library at start; torch (which tensorboardX imports where it is
  installed), sacremoses, matplotlib and scipy cost seconds of each start, so they wait for the
  code that uses them: an event file, the tokenized BLEU, a figure, a t-test."""
  heavy = {'torch', 'tensorboardX', 'sacremoses', 'matplotlib', 'scipy'}
  script = (
    'import atexit, runpy, sys\n'
    'atexit.register(lambda: print(sorted({m.split(".")[0] for m in sys.modules} & '
    f'{heavy!r})))\n'
    'runpy.run_path(sys.argv[1], run_name="__main__")'
  )
  started = {
    command: subprocess.Popen(
      [sys.executable, '-c', script, command, '--help'],
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      text=True,
      cwd=REPO_ROOT,
    )
    for command in ('train.py', 'eval.py', 'sweep.py', 'convert.py', 'compare.py')
  }
  imported = {
    command: process.communicate()[0].splitlines()[-1] for command, process in started.items()
  }
  assert imported == dict.fromkeys(started, '[]')


def test_an_event_file_is_written_without_importing_torch_which_imports_as_before(tmp_path):
  """Every run writes TensorBoard event files through tensorboardX, whose package imports torch
  where it is installed (seconds of each start) only to accept torch tensors; it is hidden for
  that one import and imports as before afterwards."""
  script = (
    'import sys\n'
    'from transformer import metrics\n'
    'events = metrics.EventFile(sys.argv[1])\n'
    "events.write_scalars(1, {'loss': 2.0})\n"
    'events.close()\n'
    "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'tensorboardX'}))\n"
    'import torch\n'
    'print(torch.zeros(2).sum().item())\n'
  )
  result = subprocess.run(
    [sys.executable, '-c', script, str(tmp_path)],
    capture_output=True,
    text=True,
    cwd=REPO_ROOT,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == ["['tensorboardX']", '0.0'], result.stdout
  (event_file,) = tmp_path.iterdir()
  assert event_file.name.startswith('events.out.tfevents.')


# Libraries that load JAX's plugins (libtpu, the CUDA plugin) when they import JAX.
_JAX_LIBRARIES = {'jax', 'flax', 'optax', 'orbax', 'grain', 'chex'}


def _first_module_imports(path: pathlib.Path) -> list[str]:
  """The top-level packages a script imports at module level, in order."""
  names = []
  for node in ast.parse(path.read_text(encoding='utf-8')).body:
    if isinstance(node, ast.Import):
      names += [alias.name.split('.')[0] for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.append(node.module.split('.')[0])
  return names


def test_scripts_import_the_package_before_jax():
  # transformer/__init__.py keeps JAX from loading libtpu and the CUDA plugin on a CPU-only host
  # (otherwise 105 + 93 MiB more per process and their errors on the console): it works only
  # when it runs before the first import of JAX.
  scripts = sorted(REPO_ROOT.glob('*.py')) + sorted((REPO_ROOT / 'bench').glob('*.py'))
  late = []
  for script in scripts:
    names = _first_module_imports(script)
    jax_at = next((i for i, n in enumerate(names) if n in _JAX_LIBRARIES), None)
    if jax_at is not None and 'transformer' not in names[:jax_at]:
      late.append(f'{script.relative_to(REPO_ROOT)} imports {names[jax_at]} first')
  assert not late, late
