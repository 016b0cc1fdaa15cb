"""Which settings the code reads, found in its syntax tree: `<section>.<field>` where <section> is an expression
that denotes a config section, so a field is read only where its own section's is (train.k by `c.k` with
`c = cfg.train`, not by any `.k`). tests/test_config.py holds every field to it."""

import ast

from pydantic import BaseModel

from rlhf.config import Config


def _sections(model=Config, prefix=""):
    """section path -> its class, e.g. "train" -> TrainConfig, "train.lora" -> LoraConfig ("" -> Config)."""
    out = {prefix.rstrip("."): model}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out |= _sections(field.annotation, f"{prefix}{name}.")
    return out


SECTIONS = _sections()
BY_CLASS = {cls.__name__: path for path, cls in SECTIONS.items()}
BY_NAME = {path.rsplit(".", 1)[-1]: path for path in SECTIONS if path}  # "lora" -> "train.lora"


def section_reads(source: str) -> set[str]:
    """Dotted settings read in `source`: `<section>.<field>` where <section> is an expression that is a config
    section by its name (`cfg.train`, `self.cfg.train.lora`), by assignment from one (`c = cfg.train`) or by its
    annotation (`c: TrainConfig`), in the same function."""
    reads, tree = set(), ast.parse(source)
    fields = {}  # "self.<name>" -> section, from annotated class fields (`cfg: TrainConfig` of a dataclass)
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(node.annotation, ast.Name) and node.annotation.id in BY_CLASS:
                    fields[f"self.{node.target.id}"] = BY_CLASS[node.annotation.id]
    for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        bound = dict(fields)
        for arg in [*func.args.args, *func.args.kwonlyargs]:
            ann = arg.annotation
            name = ann.id if isinstance(ann, ast.Name) else getattr(ann, "value", None)
            if isinstance(name, str) and name in BY_CLASS:
                bound[arg.arg] = BY_CLASS[name]
        for node in ast.walk(func):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                continue
            target, value = node.targets[0], node.value
            pairs = (
                zip(target.elts, value.elts)
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                else [(target, value)]
            )
            for name, expr in pairs:  # `c = cfg.train` and `c, device = run.cfg.train, run.acc.device`
                if isinstance(name, ast.Name) and (path := _path(expr, bound)) is not None:
                    bound[name.id] = path
        for node in ast.walk(func):
            if isinstance(node, ast.Attribute) and (path := _path(node.value, bound)) is not None:
                reads.add(f"{path}.{node.attr}".lstrip("."))
    return reads


def _path(expr, bound) -> str | None:
    """The section path an expression denotes, or None."""
    if isinstance(expr, ast.Name):
        return bound.get(expr.id, "" if expr.id in ("cfg", "config") else None)
    if isinstance(expr, ast.Attribute):
        if isinstance(expr.value, ast.Name) and f"{expr.value.id}.{expr.attr}" in bound:
            return bound[f"{expr.value.id}.{expr.attr}"]
        if expr.attr == "cfg":
            return ""
        parent = _path(expr.value, bound)
        if parent is not None and f"{parent}.{expr.attr}".lstrip(".") in SECTIONS:
            return f"{parent}.{expr.attr}".lstrip(".")
        if expr.attr in BY_NAME and parent is None and expr.attr not in ("model", "data", "eval", "reward"):
            return BY_NAME[expr.attr]
    return None
