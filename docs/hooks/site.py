"""mkdocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

1. **API reference.** A "start here" page that lists the public API (``START_HERE``, each entry
   with the first sentence of its docstring), then one page per subpackage of ``laplace_debiased``
   (and one for the top-level modules), each holding a mkdocstrings ``::: module`` block for every
   public module in it (no leading underscore), found by walking the source tree at build time:
   the user-facing subpackages first, the ``INTERNALS`` below. A module that is added, moved or
   renamed therefore appears without editing any page, and ``--strict`` fails if one cannot be
   collected or a ``START_HERE`` entry has no target.
2. **Files outside docs/.** Pages link to committed results by their path in the checkout
   (``../benchmarks/results/fit_cost.md``), so the links work on a code host and in an editor.
   Such targets are added to the site under ``repo/`` (Markdown as pages, the rest as files,
   following the links of added Markdown files within the same folders), and the links are
   rewritten to them. A target that does not exist is left alone, so ``--strict`` reports it.

The docstrings cross-reference each other in mkdocstrings' Markdown syntax
(``[`name`][laplace_debiased.module.name]``); ``--strict`` fails on a target that has no entry.
"""

from __future__ import annotations

import ast
import os
import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

PACKAGE = "laplace_debiased"
REFERENCE = "reference"
REPO_PREFIX = "repo"
#: the subpackages that implement the others and that a user rarely calls: listed last
INTERNALS = ("two_batch", "curvature", "parallel")
#: the public API, in the order a user meets it: (section, intro, objects)
START_HERE = [
    ("The Laplace classes",
     "Every name of this page is also at the top of the package (`import laplace_debiased as ld`; "
     "`ld.DebiasedKronLaplace`, `ld.GridPredictive`, `ld.run_sweep`, ...). "
     "Import `laplace_debiased` and ask laplace-torch's `Laplace(...)` for `hessian_structure="
     "\"debiased_kron\"` (or `\"debiased_ekfac\"`, `\"debiased_lowrank\"`, `\"debiased_full\"`); "
     "`subset_of_weights=\"last_layer\"` gives the `…LLLaplace` twin of each.",
     ["laplace_debiased.kron.laplace.DebiasedKronLaplace",
      "laplace_debiased.ekfac.laplace.DebiasedEKFACLaplace",
      "laplace_debiased.eigen.laplace.DebiasedLowRankLaplace",
      "laplace_debiased.eigen.laplace.DebiasedFullLaplace"]),
    ("Predicting over a prior-precision grid", "",
     ["laplace_debiased.posterior.grid.GridPredictive"]),
    ("Sweeps, reports and diagnostics", "What the command line runs, from Python.",
     ["laplace_debiased.evaluation.pipeline.run_pipeline",
      "laplace_debiased.evaluation.sweep.run_sweep",
      "laplace_debiased.evaluation.sweep.EvalSet",
      "laplace_debiased.evaluation.sweep.SweepJob",
      "laplace_debiased.evaluation.report_page.write_report",
      "laplace_debiased.diagnostics.bias.diagnose_bias"]),
    ("The command line", "`laplace-debiased COMMAND --help` (or `python -m laplace_debiased`) lists "
     "the options; each command's module says what it does.",
     ["laplace_debiased.cli",
      "laplace_debiased.commands.main",
      "laplace_debiased.commands.sweep",
      "laplace_debiased.commands.report",
      "laplace_debiased.commands.diagnose"]),
]
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def _root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _public_modules(root: Path) -> dict[str, list[str]]:
    """Public modules grouped by their subpackage ("" for the package's top-level modules)."""
    groups: dict[str, list[str]] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts):
            continue
        is_subpackage = len(parts) == 2 and (root / Path(*parts) / "__init__.py").exists()
        group = parts[1] if len(parts) > 2 or is_subpackage else ""
        groups.setdefault(group, []).append(".".join(parts))
    return groups


def _page_name(group: str) -> str:
    return f"{REFERENCE}/{group or 'package'}.md"


def _ordered(groups) -> list[str]:
    """The top level first, then the user-facing subpackages, then ``INTERNALS``."""
    return sorted(groups, key=lambda g: (g in INTERNALS, g != "", g))


def on_config(config):
    groups = _public_modules(_root(config))
    title = {g: g or PACKAGE for g in groups}
    pages = [{"Start here": f"{REFERENCE}/index.md"}]
    pages += [{title[g]: _page_name(g)} for g in _ordered(groups) if g not in INTERNALS]
    pages += [{"Internals": [{title[g]: _page_name(g)} for g in _ordered(groups) if g in INTERNALS]}]
    config["nav"] = [*(config["nav"] or []), {"API reference": pages}]
    return config


def _summary(root: Path, path: str) -> str:
    """The first sentence of the docstring of ``path`` (a module, or a class or function in one)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        base = root / Path(*parts[:cut])
        file = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if file.is_file():
            break
    else:
        raise PluginError(f"START_HERE names {path}, which is no module of the checkout")
    node = ast.parse(file.read_text())
    for name in parts[cut:]:
        node = next((n for n in node.body if getattr(n, "name", None) == name), None)
        if node is None:
            raise PluginError(f"START_HERE names {path}, which {file.relative_to(root)} does not define")
    first = (ast.get_docstring(node) or "").split("\n\n")[0].replace("\n", " ")
    return re.split(r"(?<=\.)\s", first, maxsplit=1)[0]


def _reference_pages(config) -> dict[str, str]:
    root = _root(config)
    groups = _public_modules(root)
    index = ["# API reference: start here", "",
             "The public API first; every public module of `laplace_debiased` follows, generated from "
             "its docstrings (shapes, conventions and the maths). The user guide says how the pieces "
             "fit together.", ""]
    for section, intro, paths in START_HERE:
        index += [f"## {section}", ""] + ([intro, ""] if intro else [])
        index += [f"- [`{p.rsplit('.', 1)[-1] if p.count('.') > 2 else p}`][{p}]: {_summary(root, p)}" for p in paths]
        index.append("")
    pages = {}
    listed = {False: ["## All modules", ""], True: ["## Internals", "",
                                                       "The computations the classes above adapt, for "
                                                       "readers of the code and the maths.", ""]}
    for group in _ordered(groups):
        title = f"`{PACKAGE}.{group}`" if group else f"`{PACKAGE}` (top level)"
        body = [f"# {title}", ""]
        for module in groups[group]:
            body += [f"::: {module}", ""]
        pages[_page_name(group)] = "\n".join(body)
        page = f"{group or 'package'}.md"
        listed[group in INTERNALS].append(
            f"- [{title}]({page}): " + ", ".join(f"[`{m}`]({page}#{m})" for m in groups[group]))
    pages[f"{REFERENCE}/index.md"] = "\n".join(index + listed[False] + [""] + listed[True]) + "\n"
    return pages


def _outside_targets(text: str, page_dir: Path, docs: Path, root: Path) -> set[Path]:
    found = set()
    for match in LINK.finditer(text):
        target = match.group(2).split("#")[0]
        if not target or re.match(r"[a-z]+:|/", target):
            continue
        path = Path(os.path.normpath(page_dir / target))
        if docs not in path.parents and root in path.parents and path.is_file():
            found.add(path)
    return found


def _repo_files(config, files: Files) -> list[Path]:
    docs, root = Path(config["docs_dir"]).resolve(), _root(config)
    todo = set()
    for page in files.documentation_pages():
        if page.abs_src_path is None:  # generated above
            continue
        todo |= _outside_targets(Path(page.abs_src_path).read_text(), Path(page.abs_src_path).parent, docs, root)
    done: set[Path] = set()
    while todo:
        path = todo.pop()
        done.add(path)
        if path.suffix == ".md":
            todo |= _outside_targets(path.read_text(), path.parent, docs, root) - done
    return sorted(done)


def on_files(files: Files, config):
    for src_uri, content in _reference_pages(config).items():
        files.append(File.generated(config, src_uri, content=content))
    root = _root(config)
    for path in _repo_files(config, files):
        src_uri = posixpath.join(REPO_PREFIX, path.relative_to(root).as_posix())
        files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files):
    if page.file.src_uri.startswith(REPO_PREFIX + "/") or page.file.generated_by:
        return markdown
    docs, root = Path(config["docs_dir"]).resolve(), _root(config)
    page_dir = (docs / page.file.src_uri).parent

    def rewrite(match: re.Match) -> str:
        target, _, anchor = match.group(2).partition("#")
        if not target or re.match(r"[a-z]+:|/", target):
            return match.group(0)
        path = Path(os.path.normpath(page_dir / target))
        if docs in path.parents or root not in path.parents or not path.is_file():
            return match.group(0)
        new = posixpath.relpath(posixpath.join(REPO_PREFIX, path.relative_to(root).as_posix()),
                                page_dir.relative_to(docs).as_posix() or ".")
        return f"{match.group(1)}{new}{'#' + anchor if anchor else ''}{match.group(3)}"

    return LINK.sub(rewrite, markdown)


def _public_names(path: Path) -> list[str]:
    """A module's public API: its ``__all__`` if it states one, else its top-level classes and
    functions without a leading underscore (read from the source, nothing imported)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return [node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_")]


def on_post_build(config):
    """Every public class and function of every public module has its entry in the API reference."""
    root, site = _root(config), Path(config["site_dir"])
    missing = []
    for group, modules in _public_modules(root).items():
        html = (site / REFERENCE / (group or "package") / "index.html").read_text()
        for module in modules:
            path = root / Path(*module.split("."))
            path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            if module == PACKAGE:  # the facade: its names are documented in the modules that define them
                continue
            missing += [f"{module}.{name}" for name in _public_names(path) if f'id="{module}.{name}"' not in html]
    if missing:
        raise PluginError(f"{len(missing)} public names have no API reference entry: {', '.join(missing)}")
