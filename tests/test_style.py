"""The tutorial files read as a tutorial: a linter's rules (ruff: lines within 100 characters, one
statement per line, no lambda assigned to a name, no unused import or variable) and the budgets a
reader feels (non-blank lines, the mean line length, comments above the code rather than beside
it), measured here so that they cannot drift."""
import ast
import io
import os
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# non-blank lines a reader meets in each tutorial file, at most
BUDGETS = {"model.py": 420, "train.py": 330, "optim.py": 330, "data.py": 280, "eval.py": 420,
           "configurator.py": 60}
RULES = "E501,E701,E702,E703,E731,F401,F811,F841"


def test_the_tutorial_files_pass_the_linter():
    files = [os.path.join(ROOT, name) for name in BUDGETS]
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated",
                        "--line-length=100", f"--select={RULES}", "--output-format=concise", *files],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_support_package_and_scripts_pass_the_linter():
    """flt/ and scripts/, which a reader meets less often: the same rules, lines within 120
    characters, and two blank lines around top-level definitions (pycodestyle's E30x)."""
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--preview",
                        "--line-length=120", f"--select={RULES},E301,E302,E303,E305",
                        "--output-format=concise", os.path.join(ROOT, "flt"), os.path.join(ROOT, "scripts")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def right_comments(source):
    """(code lines, code lines with a comment to their right), from Python's tokenizer."""
    code, commented = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.line[:tok.start[1]].strip():
            commented.add(tok.start[0])
        elif tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT, tokenize.ENDMARKER):
            code.add(tok.start[0])
    return len(code), len(commented & code)


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_each_tutorial_file_keeps_its_budget(name):
    with open(os.path.join(ROOT, name)) as f:
        source = f.read()
    lines = [line for line in source.splitlines() if line.strip()]
    assert len(lines) <= BUDGETS[name]
    assert sum(map(len, lines)) / len(lines) <= 62
    code, commented = right_comments(source)
    # the comment above the code it explains; a setting may keep a short one beside it (--help)
    assert commented <= 0.15 * code, (commented, code)


def test_the_gpt_class_stays_under_200_lines():
    with open(os.path.join(ROOT, "model.py")) as f:
        source = f.read()
    gpt = next(node for node in ast.parse(source).body
               if isinstance(node, ast.ClassDef) and node.name == "GPT")
    body = source.splitlines()[gpt.lineno - 1:gpt.end_lineno]
    assert len([line for line in body if line.strip()]) < 200


def test_the_loop_is_a_plain_loop_over_the_paper_s_loops():
    # Sec. 4's loop as plain code on one screen: for t = 1..K, where it starts and each layer's
    # injection, the blocks, norm; truncated backprop and checkpointing one line each; no object
    # runs the loop for it (decoding's loop is flt/decoding.py's, held to it by test_loop_cache)
    with open(os.path.join(ROOT, "model.py")) as f:
        source = f.read()
    gpt = next(node for node in ast.parse(source).body
               if isinstance(node, ast.ClassDef) and node.name == "GPT")
    loop = next(node for node in gpt.body
                if isinstance(node, ast.FunctionDef) and node.name == "loop_states")
    assert loop.end_lineno - loop.lineno + 1 <= 40
    options = [a.arg for a in loop.args.args + loop.args.kwonlyargs if a.arg not in ("self", "idx")]
    assert options == ["loops", "bptt_loops"]
    body = ast.get_source_segment(source, loop)
    assert "for t in range(1, K + 1):" in body
    for step in ("self.loop_start(t, e, x0, h_prev)", "blocks(x, rope, h_prev, injects)", "norm(x)",
                 "torch.no_grad()", "checkpoint"):
        assert step in body, step
