"""The code examples of README.md and the documentation pages (docs/**/*.md), run as a reader
runs them, so that none rots unnoticed.

Every fenced block names its language, and each one is run, checked or says why not:

- ``bash`` and ``python`` blocks run, against one real cluster started once for the module:
  README's ``pdqueue up --prefill 1 --decode 1`` (SmolLM2, the embedded Redis, the gateway).
  A block that CI cannot run is marked in the Markdown, right before it, with its reason:
  ``<!-- not run in CI: needs Docker (scripts/check-compose --up runs it) -->``; the test
  fails on a block that is neither, so no example can be added unrun.
- ``toml`` blocks are tenant files: the gateway's own loader reads them. ``yaml`` blocks are
  loaded by a YAML parser. ``text`` blocks (pictures, formats, output) are not code.
- A ``text`` block right after a run block and marked ``<!-- output of the block above -->``
  is what that block prints: each of its lines must be printed, in that order (other lines
  may come between), where ``...`` matches any text. Without one, a block must exit 0.
- Every ``pdqueue ...`` command line of every ``bash`` block, run or not, is parsed by the
  real command line (the options exist, the values have the right type), without running it.

How a block runs (what differs from a reader's terminal, all of it here):

- A page is read in one shell, top to bottom: a bash block runs in ``bash -e -o pipefail``,
  and the environment it leaves (``source .venv/bin/activate``, ``eval "$(pdqueue up
  --print-env)"``, exports) is the next block's, Python's included. Each page starts as a
  reader with pdqueue's venv active, in a folder of its own that looks like the checkout's
  root (its top-level entries linked there: ``tests``, ``scripts``, ``.venv``, ...), with a
  HOME of its own.
- ``pdqueue up`` serving in the foreground ("terminal 1") is not started again: the module's
  cluster serves in its place (its options are parsed, as above). ``--watch`` runs for a few
  seconds. curl's progress meter, which it shows only when its output is not a terminal, is
  off. Whatever a block starts in the background is stopped when it ends (its process group:
  SIGTERM, then SIGKILL).
- The cluster listens on free ports, not on 6379 and 8000 (the suite's other tests may hold
  them): ``SUBSTITUTIONS`` points the blocks' addresses at it (a ``redis-cli`` without ``-p``
  gets the port), and paths under ``/tmp/`` go to the test's temporary folder.
- A block repeated on several pages (README's tour is on its page too) runs once.

Cost: one SmolLM2 cluster (~10 s to start) and short answers (the examples ask for 8-64
tokens); the pages run one after another on one xdist worker (the module is one group).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = {"docs/reference/cli.md"}   # scripts/gen-cli-docs: the commands' --help, not examples
RUN = {"bash", "python"}
CHECKED = {"toml", "yaml"}
TEXT = {"text"}
NOT_RUN = re.compile(r"<!--\s*not run in CI:\s*(.*?)\s*-->", re.S)
OUTPUT = re.compile(r"<!--\s*output of the block above\b.*?-->", re.S)
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
# redis-cli prints an error reply and still exits 0 (outside a terminal too): its error lines fail a block.
REDIS_ERROR = re.compile(r"^(\(error\) )?(ERR|NOAUTH|WRONGPASS|NOPERM|WRONGTYPE|NOGROUP|BUSYGROUP|LOADING)\b", re.M)
BLOCK_TIMEOUT_S = 180
WATCH_S = 2

pytestmark = pytest.mark.xdist_group("test_docs_examples")


def pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if str(p.relative_to(ROOT)) not in GENERATED)
    return [ROOT / "README.md", *docs]


@dataclass
class Block:
    page: str
    line: int            # of the opening fence, 1-based
    lang: str
    text: str
    not_run: str | None = None     # the reason given, when marked
    output: str | None = None      # the output shown after it, when marked
    errors: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, each with the mark before it (the nearest
    non-blank line, an HTML comment) and the output block after it."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j]]
        block = Block(page, i + 1, lang, "\n".join(body) + "\n")
        before = _comment_before(lines, i)
        if before is not None:
            text, at = before
            if (reason := NOT_RUN.fullmatch(text)) is not None:
                block.not_run = reason.group(1)
            elif OUTPUT.fullmatch(text):
                # What the page's previous block prints (prose may come between).
                if block.lang not in TEXT:
                    block.errors.append(f"{block.where}: output is shown in a `text` block, not `{block.lang}`")
                elif not found or found[-1].lang not in RUN or found[-1].not_run is not None:
                    block.errors.append(f"{block.where}: the output of a block that is not run")
                else:
                    found[-1].output = block.text
        found.append(block)
        i = j + 1
    return found


def _comment_before(lines: list[str], i: int) -> tuple[str, int] | None:
    """The HTML comment ending on the nearest non-blank line before line ``i`` (0-based), and
    the line it starts on (1-based)."""
    k = i - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    if k < 0 or not lines[k].strip().endswith("-->"):
        return None
    start = k
    while start >= 0 and "<!--" not in lines[start]:
        start -= 1
    if start < 0:
        return None
    return "\n".join(ln.strip() for ln in lines[start:k + 1]), start + 1


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]


# ---- every block is run, checked or says why not (no process: the fast tier) -----------------

def test_every_block_names_its_language_and_is_run_or_says_why_not():
    problems = []
    for b in all_blocks():
        problems += b.errors
        if b.lang in RUN:
            if b.not_run is not None and not b.not_run.strip():
                problems.append(f"{b.where}: `not run in CI:` without a reason")
            if b.not_run is not None and b.output is not None:
                problems.append(f"{b.where}: output shown for a block that is not run")
        elif b.lang in CHECKED:
            if b.not_run is not None:
                problems.append(f"{b.where}: a {b.lang} block is always checked; drop its mark")
        elif b.lang in TEXT:
            if b.not_run is not None:
                problems.append(f"{b.where}: a text block is not code: drop its `not run in CI` mark")
        elif not b.lang:
            problems.append(f"{b.where}: name the block's language (bash, python, toml, yaml; text for a "
                            f"picture, a format or output)")
        else:
            problems.append(f"{b.where}: a `{b.lang}` block: this test can run bash and python, check toml "
                            f"and yaml, and leaves text alone")
    assert not problems, "\n".join(problems)


def test_the_rules_parts():
    """The parts the rules rest on: a page's blocks, a mark with its reason, an output block,
    a command line that does not parse, an error redis-cli prints."""
    import click

    with pytest.raises(click.UsageError):
        parse_pdqueue(["up", "--prefil", "1"])
    with pytest.raises(click.BadParameter):
        parse_pdqueue(["up", "--decode-weights", "int3"])
    assert command_lines("A=1 pdqueue up --x 2>&1 | head -5 # c\necho 'a;b' && pdqueue status\n") == [
        ["A=1", "pdqueue", "up", "--x"], ["head", "-5"], ["echo", "a;b"], ["pdqueue", "status"]]
    assert REDIS_ERROR.search("1-0\nNOAUTH Authentication required.\n")
    md = ROOT / "README.md"
    found = blocks(md)
    assert found and found[0].lang == "text"          # the picture
    runs = [b for b in all_blocks() if b.lang in RUN]
    assert sum(b.not_run is None for b in runs) >= 15 and sum(b.not_run is not None for b in runs) >= 5
    assert any(b.output for b in runs)


def test_output_is_matched_line_by_line_in_order():
    shown = "batch <id>: 2 answered, ...\n...\n{\"text\": \" Paris...\"}\n"
    printed = "progress\nbatch 61: 2 answered, 1 errors\nmore\n{\"text\": \" Paris.\\n\"}\n"
    assert missing_output(shown.replace("<id>", "..."), printed) is None
    assert missing_output("2 answered\n1 answered\n", "1 answered\n2 answered\n") == "1 answered"


# ---- every `pdqueue` command line parses (no process either) -------------------------------

SEPARATORS = {";", "&", "&&", "|", "||", "|&", "(", ")", ";;"}


def command_lines(script: str) -> list[list[str]]:
    """The simple commands of a bash block, as words (backslash-continued lines joined;
    heredoc bodies, comments and redirections left out); shell syntax is not expanded."""
    kept, heredoc = [], None
    for line in script.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        if m := re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line):
            heredoc = m.group(1)
        kept.append(line)
    commands = []
    for line in kept:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split, lexer.commenters = True, "#"
        tokens = list(lexer)
        words: list[str] = []
        k = 0
        while k < len(tokens):
            token = tokens[k]
            if token in SEPARATORS:
                if words:
                    commands.append(words)
                words = []
            elif set(token) <= set("<>&"):          # a redirection: its target goes with it
                if words and words[-1].isdigit():   # 2>&1: the 2 is the redirection's
                    words.pop()
                k += 1
            else:
                words.append(token)
            k += 1
        if words:
            commands.append(words)
    return commands


def pdqueue_args(words: list[str]) -> list[str] | None:
    """``pdqueue``'s arguments in a command (after ``VAR=value`` words, or after ``--`` as in
    ``kubectl exec ... -- pdqueue status``), else None."""
    for k, word in enumerate(words):
        if word == "pdqueue" and (all(re.match(r"\w+=", w) for w in words[:k]) or (k and words[k - 1] == "--")):
            return words[k + 1:]
    return None


def parse_pdqueue(args: list[str]):
    """What `pdqueue ARGS` would run (click parses, nothing runs): scripts/check_k8s.py's way."""
    import click

    from workers.cli import cli

    parent = click.Context(cli, info_name="pdqueue")
    cmd, rest, name = cli, list(args), "pdqueue"
    while isinstance(cmd, click.Group):
        if not rest:
            raise click.UsageError(f"`{name}` needs a command")
        name = rest.pop(0)
        sub = cmd.get_command(parent, name)
        if sub is None:
            raise click.UsageError(f"no such command {name!r}")
        if isinstance(sub, click.Group):
            parent = click.Context(sub, info_name=name, parent=parent)
        cmd = sub
    return cmd.make_context(name, rest, parent=parent)


def test_every_pdqueue_command_line_parses():
    """Run or not, each ``pdqueue ...`` line of a bash block has options that exist and values
    of their types. A file the line names need not exist here (the block makes it, or it is
    the reader's), and shell variables stay as written."""
    import click

    problems, parsed = [], 0
    for b in all_blocks():
        if b.lang != "bash":
            continue
        for words in command_lines(b.text):
            args = pdqueue_args(words)
            if args is None or "--help" in args or "-h" in args:
                continue
            try:
                parse_pdqueue(args)
                parsed += 1
            except click.exceptions.Exit:
                parsed += 1
            except click.ClickException as exc:
                message = exc.format_message()
                if "does not exist" in message:
                    parsed += 1
                    continue
                problems.append(f"{b.where}: `pdqueue {shlex.join(args)}`: {message}")
    assert not problems, "\n".join(problems)
    assert parsed >= 40, parsed


# ---- the blocks, run against one cluster ----------------------------------------------------

def missing_output(shown: str, printed: str) -> str | None:
    """The first line of ``shown`` that ``printed`` lacks (in order; ``...`` matches any
    text; other lines may come between), else None."""
    out = [ln.rstrip() for ln in printed.splitlines()]
    k = 0
    for line in shown.splitlines():
        line = line.rstrip()
        if not line or line == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in line.split("...")))
        while k < len(out) and not pattern.fullmatch(out[k]):
            k += 1
        if k == len(out):
            return line
        k += 1
    return None


PRELUDE = r"""
pdqueue() {
  # `pdqueue up` serving in the foreground (terminal 1): the module's cluster does.
  if [ "${1:-}" = up ]; then
    case " $* " in
      *" --print-env "*|*" --print-url "*|*" --help "*|*" -h "*) ;;
      *) echo "[docs test] pdqueue $*: the module's cluster serves in its place"; return 0 ;;
    esac
  fi
  case " $* " in
    *" --watch "*)
      local rc=0
      timeout -s INT __WATCH_S__ pdqueue "$@" || rc=$?
      if [ "$rc" = 124 ]; then return 0; fi
      return "$rc" ;;
  esac
  command pdqueue "$@"
}
# curl shows its progress meter only when its output is not a terminal (here it never is).
curl() { command curl --no-progress-meter "$@"; }
"""


class Cluster:
    """README's `pdqueue up --prefill 1 --decode 1` on free ports, for the module."""

    def __init__(self, tmp: Path):
        from pdqueue.queue.redis_server import free_port
        from tests.test_cli import Up

        self.tmp = tmp
        run = tmp / "run"
        run.mkdir()
        venv_bin = str(Path(sys.executable).parent)
        self.env = {k: v for k, v in os.environ.items()
                    if (not k.startswith("PDQ_") or k in ("PDQ_CACHE_DIR", "PDQ_REDIS_SERVER"))
                    and k not in ("REDISCLI_AUTH", "VIRTUAL_ENV")}
        self.env.update(XDG_RUNTIME_DIR=str(run), PYTHONUNBUFFERED="1", VIRTUAL_ENV=str(Path(sys.prefix)),
                        PATH=venv_bin + os.pathsep + self.env.get("PATH", ""), COLUMNS="120")
        self.up = Up(tmp, self.env, "--prefill", "1", "--decode", "1", "--redis-port", str(free_port()),
                     "--gateway-port", str(free_port()), "--answer-grace-s", "0")
        self.state = self.up.wait_ready()
        self.redis_port = int(self.state["url"].rsplit(":", 1)[1].split("/")[0])
        self.gateway = self.state["gateway_url"].removeprefix("http://")
        self.metrics_port, self.tls_port = free_port(), free_port()
        self.ran: dict[tuple[str, str], tuple] = {}   # (lang, text as run) -> (status, output, env change)
        self.seconds: dict[str, float] = {}         # per page
        self.block_seconds: dict[str, float] = {}   # per block run

    def substitute(self, text: str) -> str:
        """The blocks' addresses pointed at this cluster, /tmp/ at the test's folder."""
        for pattern, repl in SUBSTITUTIONS:
            text = re.sub(pattern, repl.format(c=self), text)
        return text

    def stop(self) -> None:
        self.up.ensure_stopped()


SUBSTITUTIONS = (
    (r"127\.0\.0\.1:8000\b", "{c.gateway}"),
    (r"127\.0\.0\.1:6379\b", "127.0.0.1:{c.redis_port}"),
    (r"\bport=6379\b", "port={c.redis_port}"),
    (r"\bredis-cli\b(?! -p\b)", "redis-cli -p {c.redis_port}"),
    (r"(\bredis-cli -p) 6379\b", r"\1 {c.redis_port}"),
    (r"\b9464\b", "{c.metrics_port}"),
    (r"\b6390\b", "{c.tls_port}"),   # docs/security.md's TLS server
    (r"(?<![\w.])/tmp/", "{c.tmp}/"),
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("docs"))
    try:
        yield c
    finally:
        c.stop()
        slowest = sorted(c.block_seconds.items(), key=lambda kv: -kv[1])[:8]
        print(f"\ndocs examples: {sum(c.seconds.values()):.1f} s over {len(c.seconds)} pages; the slowest blocks: "
              + ", ".join(f"{where} {s:.1f} s" for where, s in slowest))


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop what a block left in the background (its process group)."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def run_block(c: Cluster, block: Block, folder: Path, env: dict) -> tuple[int, str, dict]:
    """(exit status, stdout and stderr together, the environment it leaves)."""
    text = c.substitute(block.text)
    env_out = folder / ".env-after"
    if block.lang == "bash":
        script = folder / "block.sh"
        script.write_text(PRELUDE.replace("__WATCH_S__", str(WATCH_S)) + text + f'\nenv -0 > "{env_out}"\n')
        argv = ["bash", "-e", "-o", "pipefail", str(script)]
    else:
        script = folder / "block.py"
        script.write_text(text)
        argv = [shutil.which("python", path=env["PATH"]) or "python", str(script)]
    env_out.unlink(missing_ok=True)
    # Output to a file, not a pipe: what the block leaves in the background would hold a pipe
    # open; the block ends when its shell does.
    log = folder / "block.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        proc.wait()
        with open(log, "a") as out:
            out.write(f"\n[docs test] still running after {BLOCK_TIMEOUT_S} s")
    finally:
        _stop_group(proc)
    out = log.read_text(errors="replace")
    left = env
    if env_out.exists():
        left = dict(item.split("=", 1) for item in env_out.read_text().split("\0") if "=" in item)
    return proc.returncode, out, left


def check_config(block: Block, folder: Path) -> None:
    if block.lang == "toml":
        from pdqueue.frontends.tenants import load_tenants

        path = folder / "tenants.toml"
        path.write_text(block.text)
        assert load_tenants(str(path)), block.where
    else:
        import yaml

        assert yaml.safe_load(block.text), block.where


def page_folder(c: Cluster, page: str) -> Path:
    """A folder of the page's own that looks like the checkout's root, and its HOME."""
    folder = c.tmp / "pages" / page.replace("/", "_")
    folder.mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "site") and not entry.name.startswith(".venv"):
            (folder / entry.name).symlink_to(entry)
    (folder / ".venv").symlink_to(Path(sys.prefix))
    (folder / "home").mkdir()
    return folder


PAGES_WITH_CODE = [str(p.relative_to(ROOT)) for p in pages()
                   if any(b.lang in RUN | CHECKED and b.not_run is None for b in blocks(p))]


SHELL_OWN = {"PWD", "OLDPWD", "SHLVL", "_"}


def env_change(before: dict, after: dict) -> dict:
    """What a block changed in its environment (None: removed)."""
    change = {k: v for k, v in after.items() if before.get(k) != v and k not in SHELL_OWN}
    return change | {k: None for k in before if k not in after and k not in SHELL_OWN}


def apply_change(env: dict, change: dict) -> dict:
    return {k: v for k, v in {**env, **change}.items() if v is not None}


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_the_examples_of_a_page_run(cluster, page):
    started = time.monotonic()
    folder = page_folder(cluster, page)
    env = {**cluster.env, "HOME": str(folder / "home")}
    failures, missing = [], []
    for block in blocks(ROOT / page):
        if block.not_run is not None or block.lang in TEXT:
            continue
        if block.lang in CHECKED:
            check_config(block, folder)
            continue
        tools = [t for t in ("redis-cli", "curl", "openssl") if re.search(rf"\b{t}\b", block.text)]
        if absent := [t for t in tools if shutil.which(t) is None]:
            missing.append(f"{block.where} ({', '.join(absent)})")
            continue
        key = (block.lang, cluster.substitute(block.text))
        if key not in cluster.ran:   # a block repeated on an earlier page ran there: once is enough
            block_started = time.monotonic()
            rc, out, after = run_block(cluster, block, folder, env)
            cluster.ran[key] = (rc, out, env_change(env, after))
            cluster.block_seconds[block.where] = time.monotonic() - block_started
        rc, out, change = cluster.ran[key]
        env = apply_change(env, change)
        if rc == 0 and block.lang == "bash" and "redis-cli" in key[1] and REDIS_ERROR.search(out):
            rc = "0, but redis-cli printed an error"
        if rc != 0:
            failures.append(f"{block.where}: exit status {rc}\n--- block (as run)\n{key[1]}--- output\n{out}")
        elif block.output is not None and (line := missing_output(block.output, out)) is not None:
            failures.append(f"{block.where}: the output shown has {line!r}, which it did not print\n"
                            f"--- output\n{out}")
    cluster.seconds[page] = time.monotonic() - started
    assert not failures, "\n\n".join(failures)
    if missing:   # CI has them (.ci/run installs redis-server, which brings redis-cli)
        pytest.skip(f"the rest ran; not run for want of a tool on PATH: {', '.join(missing)}")
