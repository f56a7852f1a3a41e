"""The map stays true. A page or a docstring points at code as `file.py: name`, in backticks: the
file's path from the repository root (`model.py`, `flt/decoding.py`, `scripts/plot.py`), a colon and
a space, then a name the file defines at its top level (a def, a class, an assignment) or a dotted
member of one of its classes (`model.py: GPT.loop_states`: a method, a class attribute, or an
attribute its methods set on self). Every such reference in README.md, docs/*.md and the .py files
at the root and in flt/, scripts/ and config/ must resolve, so a name that moves cannot leave one
pointing at nothing. So must the older form, a module-qualified name (`model.KVCache`: a class or
a constant after its module's name; `flt.cluster.PREEMPTED`). And README's file map and
flt/__init__.py's docstring name every module there is. Text and ast only: nothing is imported."""
import ast
import glob
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `path.py: name` or `path.py: Class.member`; the span may break across lines in a page
REFERENCE = re.compile(r"`((?:[\w.-]+/)*[\w-]+\.py):\s+([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)`")
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))]


def sources():
    """The .py files whose docstrings and comments may point at code, relative to the root."""
    found = glob.glob(f"{ROOT}/*.py") + glob.glob(f"{ROOT}/flt/**/*.py", recursive=True)
    found += glob.glob(f"{ROOT}/scripts/*.py") + glob.glob(f"{ROOT}/config/*.py")
    return sorted(os.path.relpath(p, ROOT) for p in found)


def references(path):
    """[(line, file, name)] of the references in the file at path (relative to the root)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
            for m in REFERENCE.finditer(text)]


def assigned(targets):
    """The names an assignment's targets bind (a, b = ... binds both)."""
    for target in targets:
        if isinstance(target, ast.Name):
            yield target.id
        elif isinstance(target, (ast.Tuple, ast.List)):
            yield from assigned(target.elts)


def definitions(body):
    """{name: its node} of the defs, classes and assignments of a module's or a class's body,
    including those under an if, a try or a with at that level."""
    names = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update(dict.fromkeys(assigned(node.targets), node))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            names.update(dict.fromkeys(assigned([node.target]), node))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            nested = node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            nested += [n for handler in getattr(node, "handlers", []) for n in handler.body]
            names.update(definitions(nested))
    return names


def members(cls):
    """{name: node} of a class: its methods, class attributes and nested classes, and every
    attribute a method sets on self (self.done = ...)."""
    names = definitions(cls.body)
    for node in ast.walk(cls):
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        for target in targets:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id == "self"):
                names.setdefault(target.attr, target)
    return names


def unresolved(file, name, parsed):
    """Why `file: name` does not resolve, or None when it does. parsed caches each file's ast."""
    path = os.path.join(ROOT, file)
    if not os.path.isfile(path):
        return f"no file {file} (a path from the repository root)"
    if file not in parsed:
        with open(path, encoding="utf-8") as f:
            parsed[file] = ast.parse(f.read())
    first, *rest = name.split(".")
    scope = definitions(parsed[file].body)
    node = scope.get(first)
    if node is None:
        return f"{file} defines no {first} at its top level"
    for part in rest:
        if not isinstance(node, ast.ClassDef):
            return f"{node_name(node)} in {file} is not a class: it has no member {part}"
        node = members(node).get(part)
        if node is None:
            return f"{file}: {name}: no member {part}"
    return None


def node_name(node):
    return getattr(node, "name", None) or ast.unparse(node).split("=")[0].strip()


def stale(paths):
    """['where: `file: name`: why'] of the references in paths that do not resolve."""
    parsed, found = {}, []
    for path in paths:
        for line, file, name in references(path):
            why = unresolved(file, name, parsed)
            if why:
                found.append(f"{path}:{line}: `{file}: {name}`: {why}")
    return found


def module_files():
    """{module name: [its files]}: a tutorial file, a support module or a script by its stem."""
    found = {}
    for path in sources():
        if not path.startswith("config/") and not path.endswith("__init__.py"):
            found.setdefault(os.path.basename(path)[:-3], []).append(path)
    return found


def qualified(text, stems, python=False):
    """[(line, module, name)] of the module-qualified names (`model.KVCache`, a class or a constant
    by its module's name; `flt.cluster.PREEMPTED`, anything by its package path) in a page's text,
    or in the comments and strings of a .py file's: the form older docstrings point at code with."""
    by_package = r"flt\.(\w+)\.(\w+(?:\.\w+)*)"
    by_module = rf"({'|'.join(stems)})\.([A-Z]\w*(?:\.\w+)*)"
    pattern = re.compile(rf"(?<![\w./])(?:{by_package}|{by_module})")
    pieces = [(1, text)]
    if python:
        kinds = (tokenize.COMMENT, tokenize.STRING)
        pieces = [(tok.start[0], tok.string) for tok in
                  tokenize.generate_tokens(io.StringIO(text).readline) if tok.type in kinds]
    found = []
    for line, piece in pieces:
        for m in pattern.finditer(piece):
            module, name = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            found.append((line + piece.count("\n", 0, m.start()), module, name))
    return found


def test_the_reference_syntax_resolves_what_it_should_and_only_that():
    tree = ast.parse("class A:\n    x = 1\n    def f(self):\n        self.done = None\n"
                     "if True:\n    B = 2\nC, D = 3, 4\ndef g():\n    pass\n")
    parsed = {"model.py": tree}
    for name in ("A", "A.x", "A.f", "A.done", "B", "C", "D", "g"):
        assert unresolved("model.py", name, parsed) is None, name
    for name in ("E", "A.y", "g.x", "B.x"):
        assert unresolved("model.py", name, parsed), name
    assert unresolved("nowhere.py", "A", parsed)
    text = "`model.py: GPT.loop_states` and `flt/decoding.py:\n  KVCache`, not `train.py: 2`"
    assert [m.groups() for m in REFERENCE.finditer(text)] == [
        ("model.py", "GPT.loop_states"), ("flt/decoding.py", "KVCache")]
    code = '# model.KVCache, torch.optim.AdamW, eval.json\nx = model.head  # flt.cluster.PREEMPTED\n'
    assert qualified(code, ["model", "optim", "eval"], python=True) == [
        (1, "model", "KVCache"), (2, "cluster", "PREEMPTED")]


def test_the_tour_points_at_the_code_of_each_step():
    # the paper read in order: the loop, the variants, the recipe, the protocol, beyond the paper
    pointed = {f"{file}: {name}" for _, file, name in references("docs/tour.md")}
    for expected in ("model.py: restart", "model.py: injection", "model.py: GPT.loop_states",
                     "optim.py: Muon", "optim.py: AdamW", "data.py: DataLoader",
                     "eval.py: evaluate_bpb", "flt/decoding.py: draft_and_verify",
                     "flt/tasks.py: Task"):
        assert expected in pointed, expected
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "(docs/tour.md)" in f.read()


@pytest.mark.parametrize("where", ["pages", "sources"])
def test_every_reference_resolves(where):
    paths = PAGES if where == "pages" else sources()
    assert sum(len(references(p)) for p in paths) > 0 or where == "sources"
    assert stale(paths) == [], "\n".join(stale(paths))


@pytest.mark.parametrize("where", ["pages", "sources"])
def test_every_module_qualified_name_is_defined_by_that_module(where):
    # model.KVCache once named a class that had moved to flt/decoding.py
    files, parsed, found = module_files(), {}, []
    stems = sorted(files, key=len, reverse=True)
    for path in PAGES if where == "pages" else sources():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        for line, module, name in qualified(text, stems, python=path.endswith(".py")):
            homes = files.get(module, [])
            if not homes or all(unresolved(home, name, parsed) for home in homes):
                found.append(f"{path}:{line}: {module}.{name}: {homes or 'no such module'} "
                             f"does not define {name}")
    assert found == [], "\n".join(found)


def file_map():
    """{folder ("" for the root): [the names README's file map lists in it]}."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## The files"):]
    block = re.search(r"```\n(.*?)```", section, re.DOTALL).group(1)
    listed, folder = {"": []}, ""
    for line in block.splitlines():
        entry = re.match(r"( *)(\S+)( |$)", line)
        # a description's continuation lines are indented past the names
        if not entry or len(entry.group(1)) > 2:
            continue
        indent, name = entry.group(1), entry.group(2)
        if not indent:
            listed[""].append(name)
            folder = name.rstrip("/") if name.endswith("/") else ""
            listed.setdefault(folder, [])
        elif folder:
            listed[folder].append(name)
    return listed, block


def modules(folder):
    """The modules of a folder (its .py files but __init__.py) and its packages ("name/")."""
    path = os.path.join(ROOT, folder)
    found = [n for n in os.listdir(path) if n.endswith(".py") and n != "__init__.py"]
    found += [f"{n}/" for n in os.listdir(path)
              if glob.glob(os.path.join(path, n, "*.py")) and not n.startswith(("_", "."))]
    return sorted(found)


@pytest.mark.parametrize("folder", ["flt", "scripts"])
def test_the_readme_file_map_names_every_module(folder):
    listed, _ = file_map()
    assert sorted(listed.get(folder, [])) == modules(folder)


def test_the_readme_file_map_names_every_tutorial_file_and_recipe():
    listed, block = file_map()
    tutorial = sorted(n for n in os.listdir(ROOT) if n.endswith(".py"))
    assert sorted(n for n in listed[""] if n.endswith(".py")) == tutorial
    config = re.search(r"^config/\s+(.*?)(?=^\S)", block, re.DOTALL | re.MULTILINE).group(1)
    named = set(re.findall(r"\b(\w+\.py)\b", config))
    assert named == set(os.listdir(os.path.join(ROOT, "config"))) - {"__init__.py", "__pycache__"}


def test_the_package_docstring_names_every_module_and_script():
    with open(os.path.join(ROOT, "flt", "__init__.py"), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    for name in modules("flt"):
        # a module as "(name)", a package as "name/"
        assert (name if name.endswith("/") else f"({name[:-3]})") in doc, name
    for name in modules("scripts"):
        assert re.search(rf"\b{name[:-3]}\b", doc), name
