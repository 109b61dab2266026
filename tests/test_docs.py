"""The README, the docs/ pages (the manual) and the results/ pages (the studies) stay true to the
repository: links resolve, commands use real flags and config keys, every figure the README quotes
is in the file it cites (its quoted result block verbatim in the config docstring), the README's
install and test commands are those CI runs, and each study opens with its result and keeps only
the run outputs its pages cite.

Reads files only (no JAX), so it runs in well under a second.
"""

import ast
import importlib.util
import pathlib
import re
import shlex

import ml_collections
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
MANUAL = sorted((REPO_ROOT / 'docs').rglob('*.md'))
# A study's page; the summary.md files beside it are sweep outputs, read as committed.
STUDIES = sorted((REPO_ROOT / 'results').glob('*.md'))
PAGES = [REPO_ROOT / 'README.md', *MANUAL, *STUDIES]
CONFIG_FILES = sorted(
  [*(REPO_ROOT / 'configs').glob('*.py'), *(REPO_ROOT / 'configs' / 'sweeps').glob('*.py')]
)
# Markdown links and images: [text](target) and ![alt](target).
_LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
_FENCE = re.compile(r'^```(\w*)\n(.*?)^```', re.MULTILINE | re.DOTALL)
_COMMAND = re.compile(r'python (\S+\.py)\b(.*)')
_DEFINED_FLAG = re.compile(r"""(?:DEFINE_\w+|add_argument)\(\s*['"]-{0,2}([A-Za-z_]\w*)['"]""")


def _rel(path: pathlib.Path) -> str:
  return str(path.relative_to(REPO_ROOT))


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
  heading = re.sub(r'[^\w\- ]', '', heading.strip().lower())
  return heading.replace(' ', '-')


def _anchors(page: pathlib.Path) -> set[str]:
  text = _FENCE.sub('', page.read_text(encoding='utf-8'))
  return {_slug(m.group(1)) for m in re.finditer(r'^#+ (.+)$', text, re.MULTILINE)}


def _links(page: pathlib.Path) -> list[str]:
  text = _FENCE.sub('', page.read_text(encoding='utf-8'))
  return [t for t in _LINK.findall(text) if not re.match(r'[a-z]+://|mailto:', t)]


@pytest.mark.parametrize(
  'page', [*PAGES, *sorted((REPO_ROOT / 'results').rglob('*/**/*.md'))], ids=_rel
)
def test_relative_links_resolve(page):
  broken = []
  for target in _links(page):
    path, _, anchor = target.partition('#')
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
      broken.append(f'{target}: no file {file}')
    elif anchor and file.suffix == '.md' and anchor not in _anchors(file):
      broken.append(f'{target}: no heading with anchor #{anchor} in {_rel(file)}')
  assert not broken, f'{_rel(page)} has broken links (fix the link or the heading): {broken}'


def test_every_docs_and_study_page_is_linked_from_the_readme():
  linked = {(REPO_ROOT / t.partition('#')[0]).resolve() for t in _links(REPO_ROOT / 'README.md')}
  missing = [_rel(p) for p in PAGES[1:] if p.resolve() not in linked]
  assert not missing, f'pages the README does not link to (add them to "Read more"): {missing}'


def test_studies_are_apart_from_the_manual():
  """docs/ is the manual: pages and the figures they show; run outputs live in results/."""
  stray = [
    _rel(p)
    for p in (REPO_ROOT / 'docs').rglob('*')
    if p.is_file() and p.suffix not in ('.md', '.png')
  ]
  assert not stray, f'run outputs belong beside their study in results/, not in docs/: {stray}'


def test_results_keep_only_what_their_pages_cite():
  """A study keeps the run outputs its pages cite: every file in a study's folder is named by a
  page, or lies in a folder a page names, deeper than the study's own folder (which would cite
  everything)."""
  results = REPO_ROOT / 'results'
  studies = '|'.join(re.escape(p.name) for p in results.iterdir() if p.is_dir())
  mention = re.compile(rf'(?<![\w/])(?:results/)?((?:{studies})/[^\s)\]`\'",*]+)')
  cited = set()
  for page in [*STUDIES, *MANUAL]:
    for path in mention.findall(page.read_text(encoding='utf-8')):
      path = (results / path.rstrip('/.:;')).resolve()
      if path.exists() and path.parent != results.resolve():
        cited.add(path)
  uncited = [
    _rel(f)
    for f in sorted(results.rglob('*'))
    if f.is_file()
    and f.parent != results
    and not any(c == f.resolve() or c in f.resolve().parents for c in cited)
  ]
  assert not uncited, (
    f'run outputs no page cites (cite them where the study reads them, or delete them): {uncited}'
  )


@pytest.mark.parametrize('page', STUDIES, ids=_rel)
def test_every_study_opens_with_its_result(page):
  headings = re.findall(
    r'^#+ (.+)$', _FENCE.sub('', page.read_text(encoding='utf-8')), re.MULTILINE
  )
  assert headings[1:2] == ['Result'], (
    f'{_rel(page)} should open with a short "## Result" section, right under its title; '
    f'its headings are {headings[:3]}'
  )


def _docstring(path: pathlib.Path) -> str:
  return ast.get_docstring(ast.parse(path.read_text(encoding='utf-8'))) or ''


def _commands() -> list[tuple[str, str, list[str]]]:
  """(where, script, arguments) of every `python X.py ...` in the docs' shell blocks and the
  configs' docstrings, continuation lines joined."""
  sources = []
  for page in PAGES:
    for lang, block in _FENCE.findall(page.read_text(encoding='utf-8')):
      if lang == 'bash':
        sources.append((_rel(page), block))
  sources += [(_rel(p), _docstring(p)) for p in CONFIG_FILES]
  commands = []
  for where, text in sources:
    for line in text.replace('\\\n', ' ').splitlines():
      match = _COMMAND.search(line)
      if not match:
        continue
      rest = match.group(2).split('"')[0]  # The end of a command quoted inside another.
      rest = re.split(r'\s(?:&|;|\|)', rest)[0]
      try:
        args = shlex.split(rest, comments=True)
      except ValueError:  # An apostrophe in prose after a command.
        args = rest.split()
      commands.append((where, match.group(1), args))
  return commands


COMMANDS = _commands()


def _defined_flags(script: str) -> set[str]:
  """Flags defined by the script or by the library it imports (absl flags are global)."""
  sources = [REPO_ROOT / script, *(REPO_ROOT / 'transformer').rglob('*.py')]
  return {name for f in sources for name in _DEFINED_FLAG.findall(f.read_text(encoding='utf-8'))}


def _load_config(path: str) -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location('doc_config', REPO_ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_commands_were_found():
  scripts = {script for _, script, _ in COMMANDS}
  assert {'train.py', 'eval.py', 'sweep.py', 'compare.py'} <= scripts, scripts


@pytest.mark.parametrize(
  ('where', 'script', 'args'),
  COMMANDS,
  ids=[f'{w}:{s}:{i}' for i, (w, s, _) in enumerate(COMMANDS)],
)
def test_commands_use_real_flags_and_config_keys(where, script, args):
  assert (REPO_ROOT / script).exists(), f'{where}: `python {script}`: there is no {script}'
  flags = [a.strip('[]').lstrip('-').partition('=')[0] for a in args if a.strip('[]')[:2] == '--']
  defined = _defined_flags(script)
  unknown = [
    f
    for f in flags
    if f not in defined
    and not (f.startswith('no') and f[2:] in defined)
    and not (f.startswith('config.') and 'config' in defined)
  ]
  assert not unknown, f'{where}: `python {script}` passes flags it does not define: {unknown}'
  overrides = [f[len('config.') :] for f in flags if f.startswith('config.')]
  if not overrides:
    return
  config_file = next(
    (a.partition('=')[2] for a in args if a.startswith('--config=')), 'configs/default.py'
  )
  config = _load_config(config_file)
  missing = []
  for key in overrides:
    node = config
    for part in key.split('.'):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        missing.append(key)
        break
      node = node[part]
  assert not missing, f'{where}: `python {script}`: not keys of {config_file}: {missing}'


README = REPO_ROOT / 'README.md'


def _quickstart() -> str:
  readme = README.read_text(encoding='utf-8')
  quickstart = readme[readme.index('## Quickstart') :]
  return quickstart[: quickstart.index('\n## ', 1)]


def test_readme_quotes_the_quickstart_config_result_verbatim():
  """The quickstart's measured result is owned by the docstring of the config it trains."""
  quickstart = _quickstart()
  configs = re.findall(r'python train\.py --config=(configs/\w+\.py)', quickstart)
  assert configs, 'The README quickstart should train a config: `python train.py --config=...`'
  quotes = [block for lang, block in _FENCE.findall(quickstart) if lang == 'text']
  assert len(quotes) == 1, f'The README quickstart should quote one block of {configs[0]}'
  docstring = _docstring(REPO_ROOT / configs[0])
  assert quotes[0].strip('\n') in docstring, (
    f'The README quickstart quotes {configs[0]}, the config it trains, whose docstring owns the '
    'figures; copy the changed lines of the docstring into the README quote, verbatim.'
  )


def test_readme_quickstart_is_install_test_train_evaluate_and_ci_runs_the_first_two():
  """A newcomer copies the first four commands in order; CI (.ci/run) runs the first two as they
  are written (its `python3` is the `python` of the README's environment)."""
  commands = [block.strip() for lang, block in _FENCE.findall(_quickstart()) if lang == 'bash']
  ci = [
    line.strip().replace('python3 ', 'python ', 1)
    for line in (REPO_ROOT / '.ci' / 'run').read_text(encoding='utf-8').splitlines()
    if re.match(r'\s*python3 -m (pip install|pytest)\b', line)
  ]
  assert len(ci) == 2, f'.ci/run should run one pip install and one pytest command: {ci}'
  assert commands[:2] == ci, (
    f'The README quickstart should open with the install and test commands .ci/run runs '
    f'(python3 written python): {ci}; it has {commands[:2]}'
  )
  train, evaluate = commands[2:4]
  workdir = re.search(r'--workdir=(\S+)', train)
  assert train.startswith('python train.py --config=') and workdir, train
  assert evaluate.startswith(f'python eval.py --workdir={workdir.group(1)}'), (
    f'The fourth quickstart command should evaluate the run the third trains: {evaluate}'
  )


# A figure: a number of the README's prose, or a pair `MEAN +- STD` (or ±) read as one.
# Read in text _normal has written: no thousands separators, ± as +-.
_PAIR = re.compile(r'(?<![\w.])(\d+(?:\.\d+)?) *\+- *(\d+(?:\.\d+)?)')
_NUMBER = re.compile(r'(?<![\w.])\d+(?:\.\d+)?')
_INLINE_CODE = re.compile(r'`([^`\n]+)`')


def _normal(text: str) -> str:
  """Thousands separators dropped and ± written +-, so that 2,800 is 2800 and 40.02 ± 0.12 is
  40.02 +- 0.12 in the README and in its sources alike."""
  return re.sub(r'(?<=\d),(?=\d{3}(?!\d))', '', text).replace('±', '+-')


def _readme_units() -> list[str]:
  """The README outside its code blocks, one paragraph or one table row at a time."""
  text = _FENCE.sub('\n\n', README.read_text(encoding='utf-8'))
  units = []
  for block in re.split(r'\n\s*\n', text):
    lines = block.strip().splitlines()
    units += lines if lines and all(line.startswith('|') for line in lines) else [block.strip()]
  return [unit for unit in units if unit]


def _cited_files(unit: str) -> list[pathlib.Path]:
  """The files a paragraph or row cites: its relative links and the repository paths it names."""
  targets = [t.partition('#')[0] for t in _LINK.findall(unit) if not re.match(r'[a-z]+://', t)]
  targets += _INLINE_CODE.findall(unit)
  return [REPO_ROOT / t for t in targets if t and (REPO_ROOT / t).is_file()]


def _figure_errors(unit: str) -> list[str]:
  prose = _normal(_INLINE_CODE.sub(' ', unit))
  pairs = [f'{mean} +- {std}' for mean, std in _PAIR.findall(prose)]
  numbers = _NUMBER.findall(_PAIR.sub(' ', prose))
  if not pairs and not numbers:
    return []
  sources = {_rel(f): _normal(f.read_text(encoding='utf-8')) for f in _cited_files(unit)}
  if not sources:
    return [f'{unit[:80]!r}... quotes {pairs + numbers} but cites no file they come from']

  def found(figure: str) -> bool:
    pattern = rf'(?<![\d.]){re.escape(figure)}(?![\d]|\.\d)'
    return any(re.search(pattern, text) for text in sources.values())

  missing = [figure for figure in pairs + numbers if not found(figure)]
  return [f'{unit[:80]!r}...: {missing} are in none of {sorted(sources)}'] if missing else []


def test_every_figure_the_readme_quotes_is_in_the_file_it_cites():
  """Each paragraph or table row of the README that quotes a number links to, or names, the file
  the number comes from (a config, a docs page, a study), and the number is there."""
  errors = [error for unit in _readme_units() for error in _figure_errors(unit)]
  assert not errors, (
    'README figures not found in the files their paragraph cites (copy the figure from its '
    'source, or cite the file that holds it):\n' + '\n'.join(errors)
  )


def test_the_test_files_run_longest_first(request):
  """tests/conftest.py orders the collection by its `LONGEST_FILES` (xdist keeps that order)."""
  import conftest

  assert len(set(conftest.LONGEST_FILES)) == len(conftest.LONGEST_FILES)
  for name in conftest.LONGEST_FILES:
    assert (REPO_ROOT / 'tests' / name).is_file(), name
  files = list(dict.fromkeys(item.path.name for item in request.session.items))
  ranked = [name for name in files if name in conftest.LONGEST_FILES]
  assert files[: len(ranked)] == ranked
  assert ranked == [name for name in conftest.LONGEST_FILES if name in ranked]
  assert not request.config.getoption('loadscopereorder', False)
