"""gas_lab reads top-down: each module sits in a layer, imports only from its own layer or the
ones below, and no chain of imports comes back to where it started.

The layers, lowest first (README.md, "The library", draws the same map):

1. **floor**: the concept, what lessons 01-05 and 09 build (accumulate, dp, toys, engine,
   zero1, zero2); nothing of DeepSpeed's bookkeeping.
2. **rules**: DeepSpeed's refusals and traps as data, the vocabulary of engine operations,
   the errors gas_lab raises.
3. **deepspeed**: ``gas_lab.deepspeed_compat``, DeepSpeed's engine on top of the floor.
4. **checking**: measuring against DeepSpeed (``gas_lab.measure``, with the refusal matrix,
   predictions and the unsafe teaching mode, which run or parse configs; and
   ``python -m gas_lab.timeline``).
5. **lessons**: what the notebooks need besides the concept.
6. **package**: ``gas_lab`` itself (``gas_lab.initialize``, ``gas_lab.start_cluster``).

The notebook runtime (``gas_lab.runtime``) stands beside them: it imports only the floor (and
itself), and only checking, lessons and the package import it. Every import counts, also one
inside a function.
"""

import ast
import re
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    ("floor", ["gas_lab.accumulate", "gas_lab.dp", "gas_lab.toys", "gas_lab.engine",
               "gas_lab.zero1", "gas_lab.zero2"]),
    ("rules", ["gas_lab.errors", "gas_lab.rules", "gas_lab.rules.operations",
               "gas_lab.rules.rule", "gas_lab.rules.config_refusals",
               "gas_lab.rules.call_refusals", "gas_lab.rules.idle_rank_refusals",
               "gas_lab.rules.out_of_scope", "gas_lab.rules.refusals", "gas_lab.rules.traps"]),
    ("deepspeed", ["gas_lab.deepspeed_compat", "gas_lab.deepspeed_compat.*"]),
    ("checking", ["gas_lab.measure", "gas_lab.measure.*", "gas_lab.timeline",
                  "gas_lab.check", "gas_lab.check.*"]),
    ("lessons", ["gas_lab.lessons", "gas_lab.lessons.*"]),
    ("package", ["gas_lab"]),
]  # fmt: skip
RUNTIME = ["gas_lab.runtime", "gas_lab.runtime.*"]
RUNTIME_IMPORTS = {"floor"}  # besides itself
IMPORTS_RUNTIME = {"checking", "lessons", "package"}


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "gas_lab").rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The gas_lab modules ``name`` imports (``from pkg import module`` is that module)."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {resolve(a.name) for a in node.names if a.name.startswith("gas_lab")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gas_lab"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in known else resolve(node.module))
    return out - {None, name}


def layer_of(name: str) -> str:
    if any(fnmatch(name, pattern) for pattern in RUNTIME):
        return "runtime"
    for layer, patterns in LAYERS:
        if name in patterns or any(fnmatch(name, p) for p in patterns if "*" in p):
            return layer
    raise AssertionError(f"{name} is in no layer: add it to LAYERS in tests/test_layers.py")


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer to a higher one (or across the runtime's fence)."""
    rank = {layer: i for i, (layer, _) in enumerate(LAYERS)}
    out = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            la, lb = layer_of(a), layer_of(b)
            if la == "runtime" or lb == "runtime":
                ok = (la == lb or (la == "runtime" and lb in RUNTIME_IMPORTS)
                      or (lb == "runtime" and la in IMPORTS_RUNTIME))  # fmt: skip
            else:
                ok = rank[lb] <= rank[la]
            if not ok:
                out.append(f"{a} ({la}) imports {b} ({lb})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on.discard(w)
                component.append(w)
            on.discard(v)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_module_is_in_a_layer():
    for name in modules():
        layer_of(name)


def test_no_import_goes_up_a_layer():
    assert upward(graph()) == []


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_checks_can_fail():
    """The two checks find what they look for (else the tests above prove nothing)."""
    bad = {"gas_lab.engine": {"gas_lab.deepspeed_compat.config"},
           "gas_lab.deepspeed_compat.config": {"gas_lab.engine"},
           "gas_lab.runtime.cluster": {"gas_lab.rules.refusals"}}  # fmt: skip
    assert upward(bad) == [
        "gas_lab.engine (floor) imports gas_lab.deepspeed_compat.config (deepspeed)",
        "gas_lab.runtime.cluster (runtime) imports gas_lab.rules.refusals (rules)",
    ]
    assert cycles(bad) == [["gas_lab.deepspeed_compat.config", "gas_lab.engine"]]


def readme_map() -> set[str]:
    """The modules README.md's map of the package names, each in its folder."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```text", text.index("## The library (`gas_lab/`)"))
    lines = text[start : text.index("```", start + 3)].splitlines()[2:]  # after "gas_lab/"
    folders, names = [], {"gas_lab"}
    for line in lines:
        depth = (len(line) - len(line.lstrip())) // 2 - 1
        if depth > len(folders):
            continue  # a description's second line
        folders = folders[:depth]
        head = re.split(r"\s{2,}", line.strip())[0]
        if head.endswith("/"):
            folders.append(head[:-1])
            names.add(".".join(["gas_lab", *folders]))
            continue
        for file in head.split(", "):
            if " ... " in file:  # lesson00.py ... lesson09.py
                first, last = (int(re.search(r"\d+", f).group()) for f in file.split(" ... "))
                files = [f"lesson{n:02d}" for n in range(first, last + 1)]
            else:
                files = [file.removesuffix(".py")]
            names |= {".".join(["gas_lab", *folders, f]) for f in files if f != "__init__"}
    return names


def test_the_readme_map_names_every_module():
    """README.md's map lists every module of gas_lab, each in its folder, and nothing else."""
    assert readme_map() == set(modules())


# What exists only to match DeepSpeed, by the names gas_lab gives it: it lives in
# gas_lab.deepspeed_compat, never in the floor the lessons print.
DEEPSPEED_ONLY = {
    "comm_dtype", "plan", "precision", "buffers", "reciprocal", "average", "deferred",
    "last_norm", "skip_nonfinite", "replicated_grad_norm", "deepspeed",
}  # fmt: skip


def deepspeed_names(source: str) -> set[str]:
    """The DeepSpeed-only names ``source``'s code uses (identifiers, attributes, arguments,
    imported modules; not its docstrings and comments)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found |= {part for n in names for part in n.split(".")}
    return found & DEEPSPEED_ONLY


def test_the_floor_names_nothing_deepspeed_only():
    floor = [name for name in modules() if layer_of(name) == "floor"]
    assert floor and {n: deepspeed_names(modules()[n].read_text()) for n in floor} == {
        n: set() for n in floor
    }
    # ... and the check finds such a name where there is one (else it proves nothing).
    assert deepspeed_names("def f(g, comm_dtype=None):\n    return g.plan\n") == {
        "comm_dtype",
        "plan",
    }


def test_the_readme_states_the_floor_size():
    """README.md says how many lines the floor is, to the nearest 100: the floor's files."""
    text = (ROOT / "README.md").read_text()
    stated = re.search(
        r"The floor is six files, .*?: about ([\d,]+) lines \(to the nearest 100", text, re.S
    )
    assert stated, "README.md's 'The library' section no longer states the floor's size"
    floor = [path for name, path in modules().items() if layer_of(name) == "floor"]
    lines = sum(len(path.read_text().splitlines()) for path in floor)
    assert len(floor) == 6 and int(stated.group(1).replace(",", "")) == round(lines, -2), lines


MAX_LINES = 400  # a module a reader holds in their head; past it, split it by what it holds


def test_no_module_is_over_400_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "gas_lab").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split each by what it holds): {long}"
