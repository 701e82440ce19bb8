"""Every dotted name of ours that the docs and docstrings cite exists; every package's docstring names what it holds.

What is checked: each backticked span in a docstring of glm46_jax/, data_prep/ and configs/, and in docs/*.md
and README.md (not data_prep/README.md: its dotted names are its report's keys, `clean.empty`), plus `--config.a.b`
flags, `python -m a.b` commands and `from a.b import c` lines in the pages' code blocks. A dotted name counts as ours
by its first part:
- `glm46_jax...` / `data_prep...`: a module path from the top;
- a module or package of ours by its last name (`sharding.use_mesh`, `training.trainer.Recipe`, `data.curriculum`):
  it resolves if it does under any module of that name (`generate.sample`: glm46_jax.generate or infer.generate);
- a name that was a module of ours in git history and is none now (`train_step.make_step`): always a failure;
- a field of the run's config (`train.steps`, `config.rl.group_size`, `--config.monitor.sinks`): RunConfig's fields,
  followed through their dataclasses' annotations (a section typed `Any`: the class named after it, `rl` ->
  RLConfig), plus the keys the config files set themselves (`data.phases`); likewise the RLHF rounds' config
  (RLHFConfig: `rounds`, `sampling.samples`, and `reward.` / `ppo.` followed by a run config's fields);
- a class of ours (`GLMMoE.__call__`, `ModelConfig.head_dim`): its body, `self.x` assignments and our base classes.
A first part that can be several of these (`train`, `model`, `checkpoint`) resolves if any reading does. Anything
else (`jax.lax.scan`, `tx.update`, `cfg.seed`, HF tensor names like `model.norm.weight`) is not ours and is skipped.
A bare `file.py` counts when its stem is a module name of ours, and `glm46_jax/...` paths must exist.

Resolution reads source with `ast` (top-level definitions, assignments, imports re-exported, class attributes) and
imports nothing, so it stays fast and works while a module cannot be imported.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import re
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
PACKAGES = ("glm46_jax", "data_prep")
# First parts that the pages use for something else than the module of that name. Kept short, each with its reason.
NOT_MODULES = {
    "recipe": "the recipe object (`recipe.start`, `recipe.finish`), not one of the recipe.py modules",
}
# Whole names that are someone else's though their first part is ours.
NOT_OURS = {
    "model.norm": "Hugging Face's final norm module (docs/architecture.md)",
    "config._experts_implementation": "the transformers model config's attribute (docs/gpu.md)",
}
# Last parts that make a name a checkpoint tensor (`model.norm.weight`, `mlp.gate.e_score_correction_bias`).
TENSOR_SUFFIXES = ("weight", "bias", "e_score_correction_bias")
FILE_EXTENSIONS = ("py", "md", "json", "jsonl", "safetensors", "txt", "gz", "sh", "jinja", "npy", "yaml", "toml")

TICKS = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(\*?)(?![\w/-]|\.\w)")
PATH = re.compile(r"(?<![\w./-])((?:glm46_jax|data_prep)/[\w/.-]*)")
CONFIG_FLAG = re.compile(r"--config\.([\w.]+)")
RUN_MODULE = re.compile(r"python3? -m ((?:glm46_jax|data_prep)[\w.]*)")
IMPORT = re.compile(r"^\s*from ((?:glm46_jax|data_prep)[\w.]*) import ([\w, ()]+)"
                    r"|^\s*import ((?:glm46_jax|data_prep)[\w.]*)")
FENCE = re.compile(r"^\s*(```|~~~)")


# ---------------------------------------------------------------------------------------------------------- the index
def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


@functools.cache
def modules() -> dict[str, str]:
    """{dotted name: path} of every module and package of ours."""
    out = {}
    for package in PACKAGES:
        for path in glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True):
            name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            out[name] = path
    return out


@functools.cache
def by_last_name() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in modules():
        out.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return out


@functools.cache
def former_modules() -> dict[str, str]:
    """{last name: a path it had} of the modules and packages of ours in git history that no module is named now
    (empty without git): `train_step`, `recipe_base`."""
    try:
        listed = subprocess.run(["git", "log", "--all", "--name-only", "--format=", "--", *PACKAGES], cwd=ROOT,
                                capture_output=True, text=True, check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    for path in listed:
        if not path.endswith(".py"):
            continue
        parts = path[:-3].split("/")
        for i in range(1, len(parts)):  # the module and every package above it
            name = parts[i] if i < len(parts) - 1 or parts[i] != "__init__" else None
            if name and name != "__main__" and name not in by_last_name():
                out.setdefault(name, "/".join(parts[:i + 1]) + (".py" if i == len(parts) - 1 else "/"))
    return out


@functools.cache
def tree(module: str) -> ast.Module:
    return ast.parse(_read(modules()[module]))


def _top_statements(body):
    for node in body:  # definitions under a top-level if / try / with count too
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                yield from _top_statements(block)
        else:
            yield node


def _bound_names(node) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


@functools.cache
def symbols(module: str) -> dict[str, tuple]:
    """A module's top-level names: ("class", node, module), ("def",), ("value",), ("from", source, name) or
    ("import", source)."""
    out: dict[str, tuple] = {}
    package = module if modules()[module].endswith("__init__.py") else module.rsplit(".", 1)[0]
    for node in _top_statements(tree(module).body):
        if isinstance(node, ast.ClassDef):
            out[node.name] = ("class", node, module)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = ("def",)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            out.update((n, ("value",)) for n in _bound_names(node))
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([source] if source else []))
            out.update((a.asname or a.name, ("from", source, a.name)) for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = ("import", a.name if a.asname else a.name.split(".")[0])
    return out


@functools.cache
def classes() -> dict[str, list[tuple]]:
    """{class name: [("class", node, module), ...]} over every module of ours (top-level classes)."""
    out: dict[str, list[tuple]] = {}
    for module in modules():
        for name, sym in symbols(module).items():
            if sym[0] == "class" and sym[2] == module:
                out.setdefault(name, []).append(sym)
    return out


def class_attributes(node: ast.ClassDef) -> dict[str, ast.AST]:
    """Names a class defines: its body's defs, classes, assignments and annotated fields, and `self.x = ...`."""
    out: dict[str, ast.AST] = {}
    for item in _top_statements(node.body):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[item.name] = item
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            out.update((n, item) for n in _bound_names(item))
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Assign, ast.AnnAssign)):
            for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.setdefault(t.attr, sub)
    return out


# --------------------------------------------------------------------------------------------------------- resolution
def resolve_in_module(module: str, parts: list[str]) -> str | None:
    """None if `module.<parts>` exists, else what is missing."""
    if not parts:
        return None
    head, rest = parts[0], parts[1:]
    if f"{module}.{head}" in modules():
        return resolve_in_module(f"{module}.{head}", rest)
    sym = symbols(module).get(head)
    if sym is None:
        return f"{module} has no `{head}`"
    return resolve_symbol(sym, rest, f"{module}.{head}")


def resolve_symbol(sym: tuple, rest: list[str], where: str) -> str | None:
    if not rest:
        return None
    if sym[0] == "class":
        return resolve_in_class(sym, rest)
    if sym[0] == "def":
        return f"{where} is a function, it has no `{rest[0]}`"
    if sym[0] == "from":
        source, name = sym[1], sym[2]
        if f"{source}.{name}" in modules():
            return resolve_in_module(f"{source}.{name}", rest)
        if source in modules():
            return resolve_in_module(source, [name, *rest])
    if sym[0] == "import" and sym[1] in modules():
        return resolve_in_module(sym[1], rest)
    return None  # a value, or a library's object: what it holds is not read from source


def resolve_in_class(sym: tuple, rest: list[str], seen: frozenset = frozenset()) -> str | None:
    _, node, module = sym
    attrs = class_attributes(node)
    if rest[0] in attrs:
        found = attrs[rest[0]]
        return resolve_in_class(("class", found, module), rest[1:]) if isinstance(found, ast.ClassDef) and rest[1:] \
            else None
    for base in node.bases:  # inherited: through our base classes; a library base may hold it (not read)
        name = base.id if isinstance(base, ast.Name) else None
        base_sym = symbols(module).get(name) if name else None
        while base_sym and base_sym[0] == "from" and base_sym[1] in modules():
            base_sym = symbols(base_sym[1]).get(base_sym[2])
        if not base_sym or base_sym[0] != "class":
            if name not in ("object", "Protocol", "NamedTuple"):
                return None
            continue
        if (base_sym[2], base_sym[1].name) not in seen and \
                resolve_in_class(base_sym, rest, seen | {(module, node.name)}) is None:
            return None
    return f"class {module}.{node.name} has no `{rest[0]}`"


@functools.cache
def config_file_keys() -> dict[str, set[str]]:
    """{section: keys} the config files set themselves beside the dataclass fields (`c.data.phases = ...`)."""
    out: dict[str, set[str]] = {}
    for path in glob.glob(os.path.join(ROOT, "configs", "*.py")):
        for node in ast.walk(ast.parse(_read(path))):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute):
                        out.setdefault(t.value.attr, set()).add(t.attr)
    return out


def resolve_config(parts: list[str], root: str = "RunConfig") -> str | None:
    """None if `config.<parts>` is a field of the run's config (RunConfig and the dataclasses of its fields), or of
    another config class `root` (RLHFConfig, whose stages are run configs)."""
    current = classes().get(root, [])
    path = "config"
    for i, part in enumerate(parts):
        if not current:
            return None  # a value with no dataclass of ours (a mapping, a string): its keys are not read from source
        found = [(sym, class_attributes(sym[1]).get(part)) for sym in current]
        found = [(sym, f) for sym, f in found if f is not None]
        if not found:
            if i == 1 and part in config_file_keys().get(parts[0], ()):
                return None
            names = "/".join(sorted({sym[1].name for sym in current}))
            return f"config field {path} ({names}) has no `{part}`"
        annotations = [f.annotation for _, f in found if isinstance(f, ast.AnnAssign)]
        if not annotations:
            return None  # a method or property: a value from here on
        names = {n.id if isinstance(n, ast.Name) else n.value for a in annotations for n in ast.walk(a)
                 if isinstance(n, ast.Name) or (isinstance(n, ast.Constant) and isinstance(n.value, str))}
        current = [c for n in names for c in classes().get(n, [])]
        if not current:  # a section typed loosely (`rl: Any`): the dataclass named after it (RLConfig)
            current = [c for n, syms in classes().items() if n.lower() == f"{part}config" for c in syms]
            if not current and i == 0 and parts[1:] and "Any" in names:
                return f"config section `{part}` is typed Any and no class {part}Config (any case) describes it"
        path += f".{part}"
    return None


def check_name(name: str) -> str | None:
    """None if `name` is not ours or resolves; else what is missing."""
    parts = name.split(".")
    first = parts[0]
    if parts[-1] in FILE_EXTENSIONS:  # a file name: ours when its stem is a module name of ours
        stem = name.rsplit(".", 1)[0]
        if parts[-1] == "py" and "." not in stem and (stem in by_last_name() or stem in former_modules()):
            return None if stem in by_last_name() else f"no module {stem}.py (was {former_modules()[stem]})"
        return None
    if parts[-1] in TENSOR_SUFFIXES or first in NOT_MODULES or name in NOT_OURS:
        return None
    errors, ours = [], False
    if first in PACKAGES:
        return resolve_in_module(first, parts[1:])
    for module in by_last_name().get(first, []):
        ours = True
        error = resolve_in_module(module, parts[1:])
        if error is None:
            return None
        errors.append(error)
    config_fields = {n for sym in classes().get("RunConfig", []) for n in class_attributes(sym[1])}
    if first == "config" or first in config_fields:
        ours = True
        error = resolve_config(parts[1:] if first == "config" else parts)
        if error is None:
            return None
        errors.append(error)
    rlhf_fields = {n for sym in classes().get("RLHFConfig", []) for n in class_attributes(sym[1])}
    if first in rlhf_fields or (first == "config" and parts[1:2] and parts[1] in rlhf_fields):
        ours = True  # configs/rlhf.py's fields: `rounds`, `sampling.samples`, `--config.ppo.rl.labeller`
        error = resolve_config(parts[1:] if first == "config" else parts, root="RLHFConfig")
        if error is None:
            return None
        errors.append(error)
    for sym in classes().get(first, []):
        ours = True
        error = resolve_in_class(sym, parts[1:])
        if error is None:
            return None
        errors.append(error)
    if first in former_modules():
        ours = True
        errors.append(f"no module `{first}` (was {former_modules()[first]})")
    return "; ".join(dict.fromkeys(errors)) if ours else None


def check_prefix(name: str) -> str | None:
    """None if a module of ours that `name` (`cli.check_*`) points into has a name starting with its last part."""
    *head, prefix = name.split(".")
    starts = [head[0]] if head[0] in PACKAGES else by_last_name().get(head[0], [])
    targets = [".".join([s, *head[1:]]) for s in starts if ".".join([s, *head[1:]]) in modules()]
    if not targets:
        return check_name(".".join(head))
    if any(n.startswith(prefix) for t in targets for n in [*symbols(t), *(m[len(t) + 1:] for m in modules()
                                                                          if m.startswith(t + "."))]):
        return None
    return f"{' / '.join(targets)} has no name starting `{prefix}`"


def check_path(path: str) -> str | None:
    path = path.rstrip(".,:;")
    return None if os.path.exists(os.path.join(ROOT, path)) else f"no file or directory {path}"


# ------------------------------------------------------------------------------------------------------- the sources
def docstrings(path: str):
    """(line, text) of every docstring in a Python file."""
    source = ast.parse(_read(path))
    for node in ast.walk(source):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                yield first.lineno, first.value.value


def names_in_text(text: str, code: bool = False):
    """(offset, kind, name) cited in prose (`kind` "name", "config", "path") or, with `code`, in a code block."""
    if code:
        for m in IMPORT.finditer(text):
            if m.group(3):
                yield m.start(), "name", m.group(3)
            else:
                for imported in re.findall(r"\w+", m.group(2)):
                    yield m.start(), "name", f"{m.group(1)}.{imported}"
        spans = [(0, text)]
    else:
        spans = [(m.start(1), m.group(1)) for m in TICKS.finditer(text)]
    for start, span in spans:
        for m in CONFIG_FLAG.finditer(span):
            flag = m.group(1).strip(".")
            if max(len(p) for p in flag.split(".")) > 1:  # `--config.x.y=` is a placeholder
                yield start + m.start(), "config", flag
        for m in RUN_MODULE.finditer(span):
            yield start + m.start(), "name", m.group(1).strip(".")  # `python -m glm46_jax.<name>`: the package
        if code:
            continue
        for m in DOTTED.finditer(span):
            before = span[:m.start()]
            if sum(before.count(c) for c in "([{") > sum(before.count(c) for c in ")]}"):
                continue  # an argument of a call (`make_step(loss, {name: model.tx})`): a variable, not a name
            yield start + m.start(), "prefix" if m.group(2) else "name", m.group(1)
        for m in PATH.finditer(span):
            yield start + m.start(), "path", m.group(1)


def cited_names():
    """(file:line, name, kind) of every citation, from docstrings and the markdown pages."""
    root = ROOT
    for pattern in ("glm46_jax/**/*.py", "data_prep/**/*.py", "configs/*.py"):
        for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
            rel = os.path.relpath(path, root)
            for line, text in docstrings(path):
                for offset, kind, name in names_in_text(text):
                    yield f"{rel}:{line + text.count(chr(10), 0, offset)}", name, kind
    for pattern in ("docs/*.md", "README.md"):
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            rel, fenced = os.path.relpath(path, root), False
            for n, line in enumerate(_read(path).splitlines(), 1):
                if FENCE.match(line):
                    fenced = not fenced
                    continue
                for _, kind, name in names_in_text(line, code=fenced):
                    yield f"{rel}:{n}", name, kind


def stale_names() -> list[str]:
    """`file:line `name` -> what is missing` for every cited name of ours that does not resolve."""
    problems = []
    for where, name, kind in cited_names():
        if kind == "path":
            error = check_path(name)
        elif kind == "config":  # a run's flag, or the RLHF rounds' (`--config.rounds`)
            error = resolve_config(name.split(".")) and check_name(f"config.{name}")
        elif kind == "prefix":
            error = check_prefix(name)
        else:
            error = check_name(name)
        if error:
            problems.append(f"{where} `{name}` -> {error}")
    return problems


# -------------------------------------------------------------------------------------------------------------- tests
def test_every_cited_name_exists():
    problems = stale_names()
    assert not problems, f"{len(problems)} cited names that do not exist:\n" + "\n".join(problems)


def test_every_package_docstring_names_its_modules():
    """A package's docstring says what it holds now: each of its modules and subpackages, by name."""
    missing = []
    for package, path in sorted(modules().items()):
        if not path.endswith("__init__.py"):
            continue
        doc = ast.get_docstring(tree(package)) or ""
        children = sorted({m[len(package) + 1:].split(".")[0] for m in modules() if m.startswith(package + ".")})
        absent = [c for c in children if c != "__main__" and not re.search(rf"\b{c}\b", doc)]
        if absent:
            missing.append(f"{os.path.relpath(path, ROOT)}: {', '.join(absent)}")
    assert not missing, "package docstrings that do not name a module they hold:\n" + "\n".join(missing)


def test_the_checker_finds_stale_names():
    """The resolver against known answers: names that exist, names that do not, names that are not ours."""
    assert check_name("glm46_jax.parallel.sharding.use_mesh") is None
    assert check_name("sharding.use_mesh") is None
    assert check_name("model.apply") is None  # the package's re-export
    assert check_name("train.steps") is None  # a config field, though `train` is also a module
    assert check_name("config.checkpoint.init_from") is None
    assert resolve_config(["monitor", "sinks"]) is None
    assert check_name("ModelConfig.head_dim") is None
    assert check_name("jax.lax.scan") is None and check_name("tx.update") is None  # not ours
    assert check_name("model.norm.weight") is None  # a checkpoint tensor
    assert "no `no_such_function`" in check_name("sharding.no_such_function")
    assert "has no `no_such_field`" in check_name("train.no_such_field")
    assert "has no `nope`" in check_name("glm46_jax.interop.nope")
    assert "has no `nope`" in check_name("ModelConfig.nope")
    assert resolve_config(["train", "nope"]) is not None
    assert check_path("glm46_jax/model/nope.py") is not None and check_path("glm46_jax/model/moe.py") is None
    assert check_name("rl.recipe.GRPO") is not None  # the examples
    if former_modules():  # with git history
        assert "was glm46_jax/train_step.py" in check_name("train_step.make_step")
        assert "was glm46_jax/recipe_base.py" in check_name("recipe_base.RecipeBase")
