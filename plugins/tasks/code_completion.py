"""Next-line code completion on real Python source, scored by edit similarity: LongBench's
``lcc`` / ``repobench-p`` (Bai et al., 2024, arXiv 2308.14508; Guo et al., 2023, LongCoder)
rebuilt offline. A sparsity-robust task (Elastic Attention, arXiv 2601.17367, §4): the next line
depends mostly on the code right above it, so sink + local-window attention loses little
(SmolLM2-135M-Instruct at 1,500 tokens, 12 eval samples: edit similarity 0.54 with full
attention, 0.49 with every head streaming, 64 sink + 256 local tokens).

The corpus is the running Python's standard library (minus tests, data tables and removed
modules), split into ``"train"`` / ``"eval"`` by a hash of each file's path (:func:`split_of`): no
download, and one seed's samples are identical across machines with the same Python minor
version. A sample is a one-line simple statement; the prompt is the ``context_tokens`` tokens of
code before it, ending without its newline; no chat template by default. Score:
:func:`elasticfw.eval.metrics.code_edit_similarity` of the first completion line. The module also
holds the corpus helpers and the prompt rendering the other robust tasks share. The construction
in detail: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import random
import sysconfig
import tokenize
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.metrics import CODE_LINE_SKIP, code_edit_similarity
from elasticfw.eval.task import Sample, Split, Task, TaskConfig, check_split

# ---------------------------------------------------------------------------------------------
# The standard-library corpus (shared by the robust tasks)
# ---------------------------------------------------------------------------------------------

#: directories whose files are not ordinary library code: test suites and their data, codec
#: tables, generated documentation, compiled-module folders, demos, installed third-party
#: packages, and packages that Python 3.12 removed (distutils) or deprecated for removal (lib2to3)
EXCLUDED_DIRS: frozenset[str] = frozenset(
    {
        "__phello__", "__pycache__", "dist-packages", "distutils", "encodings", "idle_test", "lib-dynload",
        "lib2to3", "pydoc_data", "site-packages", "test", "tests", "turtledemo",
    }
)
#: top-level modules removed in 3.12 (asynchat, asyncore, imp, smtpd) or 3.13 (PEP 594), left
#: out so that the pool stays as alike as possible from 3.10 to 3.13
EXCLUDED_MODULES: frozenset[str] = frozenset(
    {
        "aifc.py", "asynchat.py", "asyncore.py", "cgi.py", "cgitb.py", "chunk.py", "crypt.py", "imghdr.py",
        "imp.py", "mailcap.py", "nntplib.py", "pipes.py", "smtpd.py", "sndhdr.py", "sunau.py", "telnetlib.py",
        "uu.py", "xdrlib.py",
    }
)
#: a file is in the eval split when its hash falls below this share (half the files)
EVAL_SHARE = 0.5
SPLIT_SALT = "elasticfw-stdlib-split/"


def stdlib_root() -> Path:
    """The running Python's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=2)
def _stdlib_files(root: str) -> tuple[str, ...]:
    base = Path(root)
    files = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base)
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if len(rel.parts) == 1 and (rel.name in EXCLUDED_MODULES or rel.name.startswith("_sysconfigdata")):
            continue
        files.append(rel.as_posix())
    if not files:
        raise UnsupportedInputError(
            f"no Python source files found under the standard-library directory {root!r} "
            "(sysconfig.get_paths()['stdlib']); the robust tasks need the library's .py files"
        )
    return tuple(sorted(files))


def stdlib_files() -> tuple[str, ...]:
    """Sorted relative (POSIX) paths of the corpus files of the running Python."""
    return _stdlib_files(str(stdlib_root()))


def split_of(rel_path: str) -> Split:
    """The split a corpus file belongs to: a stable SHA-256 hash of its relative path."""
    digest = hashlib.sha256((SPLIT_SALT + rel_path).encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2.0**64 < EVAL_SHARE else "train"


def split_files(split: Split) -> list[str]:
    """The corpus files of ``split``, sorted."""
    check_split(split)
    return [f for f in stdlib_files() if split_of(f) == split]


@lru_cache(maxsize=1024)
def read_source(rel_path: str) -> str:
    """A corpus file's text (decoded as Python does: PEP 263 coding cookie, universal newlines)."""
    with tokenize.open(stdlib_root() / rel_path) as handle:
        return handle.read()


@lru_cache(maxsize=8)
def parse_source(rel_path: str) -> ast.Module | None:
    """The file's syntax tree, or ``None`` when the running Python cannot parse it (then the file
    is not Python source of this version and contributes no sample). Few trees are cached (they
    are large); the tasks cache what they derive from them."""
    try:
        return ast.parse(read_source(rel_path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return None


def n_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens of ``text`` (no special tokens added)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, body: str, *, chat_template: bool, answer_prefix: str) -> str:
    """The prompt text: ``body`` in the tokenizer's chat template (one user turn, generation prompt)
    when ``chat_template`` is on and the tokenizer has one, else ``body`` as is; then the answer
    prefix (the start of the assistant's answer)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
        )
        return str(text) + answer_prefix
    return body + answer_prefix


def line_starts(text: str) -> list[int]:
    """Character offsets at which the lines of ``text`` start."""
    starts = [0]
    for i, ch in enumerate(text):
        if ch == "\n" and i + 1 < len(text):
            starts.append(i + 1)
    return starts


@dataclass(frozen=True)
class TokenizedFile:
    """A file's text with the character offset at which each of its tokens starts."""

    text: str
    token_starts: list[int]
    line_starts: list[int]

    @classmethod
    def build(cls, tokenizer: Any, text: str) -> TokenizedFile:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = [int(a) for a, _ in enc["offset_mapping"]]
        return cls(text, starts, line_starts(text))

    def tokens_before(self, char: int) -> int:
        return bisect.bisect_left(self.token_starts, char)

    def window_start(self, end_char: int, budget: int) -> int | None:
        """Character offset where ``budget`` tokens before ``end_char`` begin, moved to the nearest
        line start when that costs at most 5% of the budget; ``None`` if the file holds fewer tokens
        before ``end_char``."""
        t_end = self.tokens_before(end_char)
        t_start = t_end - budget
        if t_start < 0:
            return None
        char = self.token_starts[t_start] if t_start < len(self.token_starts) else end_char
        i = bisect.bisect_right(self.line_starts, char) - 1
        best: tuple[int, int] | None = None
        for cand in (self.line_starts[i], self.line_starts[i + 1] if i + 1 < len(self.line_starts) else None):
            if cand is None or cand >= end_char:
                continue
            cost = abs(self.tokens_before(cand) - t_start)
            if cost <= max(1, budget // 20) and (best is None or cost < best[0]):
                best = (cost, cand)
        return best[1] if best is not None else char


def may_hold(text: str, tokens: int) -> bool:
    """Whether ``text`` can hold ``tokens`` tokens: a token covers at least one UTF-8 byte, so text
    of fewer bytes cannot (this spares tokenizing files too short for a long context)."""
    return len(text.encode("utf-8")) >= tokens


def check_length(task: str, n: int, context_tokens: int) -> None:
    """Refuse a prompt more than 10% away from ``context_tokens`` (the tasks' length contract)."""
    if abs(n - context_tokens) > 0.1 * context_tokens:
        raise UnsupportedInputError(
            f"task {task!r}: built a prompt of {n} tokens for context_tokens={context_tokens} (outside ±10%); "
            "the tokenizer's chat template or answer prefix is too long for this context_tokens — raise it"
        )


# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------

_SIMPLE_STATEMENTS = (
    ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Raise, ast.Expr, ast.Assert, ast.Delete,
    ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal,
)



def definitions(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """(qualified name, node) of every function and class of a module, in source order (the fewshot and
    summary tasks read their examples from these)."""
    out: list[tuple[str, ast.AST]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = f"{prefix}{child.name}"
                out.append((qualname, child))
                visit(child, qualname + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


class CodeCompletionConfig(TaskConfig):
    name: Literal["code_completion"] = "code_completion"
    context_tokens: int = Field(
        1500, ge=128, le=1_000_000, description="Approximate prompt length in tokens (code before the line)."
    )
    num_samples: int = Field(20, ge=1, le=1_000_000, description="Number of samples (per split).")
    chat_template: bool = Field(
        False, description="Wrap the prompt in the tokenizer's chat template if it has one (LongBench lcc: no)."
    )
    instruction: str = Field(
        "", max_length=2000,
        description="Text before the code (LongBench lcc: 'Please complete the code given below. \\n').",
    )
    answer_prefix: str = Field(
        "", max_length=200,
        description="Text after the code, where the answer starts (LongBench lcc: 'Next line of code:\\n'); "
        "empty: the prompt ends with the code (the model writes the newline and the next line).",
    )
    min_line_chars: int = Field(16, ge=1, le=400, description="Shortest line (stripped) chosen as an answer.")
    max_line_chars: int = Field(80, ge=1, le=400, description="Longest line (stripped) chosen as an answer.")

    @model_validator(mode="after")
    def _line_bounds(self) -> CodeCompletionConfig:
        if self.min_line_chars > self.max_line_chars:
            raise ValueError(
                f"min_line_chars ({self.min_line_chars}) must not exceed max_line_chars ({self.max_line_chars})"
            )
        return self


@lru_cache(maxsize=1024)
def candidate_lines(rel_path: str, min_chars: int, max_chars: int) -> tuple[int, ...]:
    """0-based indices of the lines of a corpus file that can be answers (see the module docstring)."""
    tree = parse_source(rel_path)
    if tree is None:
        return ()
    lines = read_source(rel_path).split("\n")
    found: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, _SIMPLE_STATEMENTS) or node.lineno != node.end_lineno:
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # docstrings and other bare literals
        line = lines[node.lineno - 1]
        stripped = line.strip()
        raw = line.rstrip().encode("utf-8")  # ast column offsets count UTF-8 bytes
        if node.col_offset != len(raw) - len(raw.lstrip()) or node.end_col_offset != len(raw):
            continue  # another statement shares the line (`a = 1; b = 2`)
        if not min_chars <= len(stripped) <= max_chars or any(m in line for m in CODE_LINE_SKIP):
            continue
        found.add(node.lineno - 1)
    return tuple(sorted(found))


class CodeCompletionTask(Task):
    """Complete the next line of real Python code (LongBench lcc-style), scored by edit similarity."""

    name = "code_completion"
    config_class = CodeCompletionConfig
    config: CodeCompletionConfig
    category = "robust"
    metric = "edit_sim"
    default_max_new_tokens = 32

    def _render(self, tokenizer: Any, code: str) -> str:
        cfg = self.config
        templated = cfg.chat_template and bool(getattr(tokenizer, "chat_template", None))
        # the code ends before its last newline; a framed prompt puts that newline back
        tail = "\n" if cfg.answer_prefix and not templated else ""
        return render_prompt(
            tokenizer, cfg.instruction + code + tail, chat_template=cfg.chat_template, answer_prefix=cfg.answer_prefix
        )

    def _plain_continuation(self, tokenizer: Any) -> bool:
        """Whether the prompt ends with the code itself (then the target is the text that follows it
        in the file: newline, indentation and the line)."""
        cfg = self.config
        templated = cfg.chat_template and bool(getattr(tokenizer, "chat_template", None))
        return not templated and cfg.answer_prefix == ""

    def samples(self, tokenizer: Any, *, seed: int, split: Split = "eval") -> list[Sample]:
        check_split(split)
        cfg = self.config
        rng = random.Random(f"code_completion:{split}:{seed}")
        overhead = n_tokens(tokenizer, self._render(tokenizer, ""))
        budget = cfg.context_tokens - overhead
        if budget < cfg.context_tokens // 2:
            raise UnsupportedInputError(
                f"eval.task.context_tokens={cfg.context_tokens} leaves {budget} tokens of code after the "
                f"{overhead} tokens of instruction, chat template and answer prefix; raise context_tokens"
            )
        files = split_files(split)
        rng.shuffle(files)
        tokenized: dict[str, TokenizedFile] = {}
        eligible: dict[str, list[int]] = {}
        used: set[tuple[str, int]] = set()
        plain = self._plain_continuation(tokenizer)
        out: list[Sample] = []
        while len(out) < cfg.num_samples:
            added = 0
            for rel in files:
                if len(out) == cfg.num_samples:
                    break
                if rel not in eligible:
                    eligible[rel] = self._eligible_lines(tokenizer, rel, budget, tokenized)
                choices = [i for i in eligible[rel] if (rel, i) not in used]
                if not choices:
                    continue
                index = rng.choice(choices)
                used.add((rel, index))
                out.append(self._sample(tokenizer, tokenized[rel], rel, index, budget, plain))
                added += 1
            if added == 0:
                raise UnsupportedInputError(
                    f"task 'code_completion': the {split} split has only {len(out)} lines with "
                    f"{budget} tokens of code before them (context_tokens={cfg.context_tokens}), fewer than "
                    f"num_samples={cfg.num_samples}; lower context_tokens or num_samples"
                )
        return out

    def _eligible_lines(self, tokenizer: Any, rel: str, budget: int, cache: dict[str, TokenizedFile]) -> list[int]:
        cfg = self.config
        if not may_hold(read_source(rel), budget):
            return []
        lines = candidate_lines(rel, cfg.min_line_chars, cfg.max_line_chars)
        if not lines:
            return []
        tf = cache.get(rel) or TokenizedFile.build(tokenizer, read_source(rel))
        cache[rel] = tf
        return [i for i in lines if tf.tokens_before(self._code_end(tf, i)) >= budget]

    @staticmethod
    def _code_end(tf: TokenizedFile, index: int) -> int:
        """Where the prompt's code ends: at the end of the last non-blank line before line ``index``,
        *before* its newline. Code tokenizers merge a newline with the next line's indentation
        (``"\\n        "`` is one token), so a prompt ending in a bare newline would announce an
        unindented line; the model writes the newline and indentation itself."""
        return len(tf.text[: tf.line_starts[index]].rstrip())

    def _sample(self, tokenizer: Any, tf: TokenizedFile, rel: str, index: int, budget: int, plain: bool) -> Sample:
        cfg = self.config
        line_start = tf.line_starts[index]
        end = self._code_end(tf, index)
        start = tf.window_start(end, budget)
        if start is None:  # _eligible_lines keeps only lines with `budget` tokens before them
            raise RuntimeError(f"code_completion: {rel}:{index + 1} has fewer than {budget} tokens before it")
        code = tf.text[start:end]
        line_end = tf.text.find("\n", line_start)
        following = tf.text[end : line_end if line_end >= 0 else len(tf.text)]  # newline(s), indentation, line
        answer = following.strip()
        ids = list(tokenizer(self._render(tokenizer, code), add_special_tokens=False)["input_ids"])
        check_length(self.name, len(ids), cfg.context_tokens)
        return Sample(
            ids,
            answer,
            meta={"file": rel, "line": index + 1, "code_start": start, "code_end": end, "tokens": len(ids)},
            target=following if plain else answer,
            answers=(answer,),
        )

    def score(self, sample: Sample, completion: str) -> float:
        return code_edit_similarity(completion, sample.answer)
