"""Old import paths of modules that moved into subpackages, kept working for existing code.

Before the package was split into layers (``core``, ``formats``, ``predict``, ``sources``,
``consumers``, ``app``, ``plan``), these modules lived at ``placement.<name>``.  ``import
placement.cost`` (or ``from placement.runtime import install_megatron``) still works: the old name
is an alias of the same module object, so patches and ``isinstance`` checks see one module.  New
code should import the new paths; ``python -m`` entry points use the new paths only
(``python -m placement.consumers.checkpoint``, ``python -m placement.sources.realroute``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

#: old module name -> new module name (a package's submodules follow it)
MOVED: dict[str, str] = {
    "placement.calibration": "placement.predict.calibration",
    "placement.checker": "placement.core.checker",
    "placement.checkpoint": "placement.consumers.checkpoint",
    "placement.compute": "placement.predict.compute",
    "placement.controller": "placement.plan.controller",
    "placement.cost": "placement.predict.cost",
    "placement.discovery": "placement.sources.discovery",
    "placement.dispatch": "placement.core.dispatch",
    "placement.executor": "placement.core.executor",
    "placement.export": "placement.consumers.export",
    "placement.formats_replicas": "placement.formats.replicas",
    "placement.generator": "placement.sources.generator",
    "placement.hostfile": "placement.consumers.hostfile",
    "placement.imbalance": "placement.predict.imbalance",
    "placement.importers": "placement.sources.importers",
    "placement.instances": "placement.sources.instances",
    "placement.launch": "placement.consumers.launch",
    "placement.maxtext": "placement.consumers.maxtext",
    "placement.migrate": "placement.consumers.migrate",
    "placement.model": "placement.core.model",
    "placement.movecount": "placement.core.movecount",
    "placement.moves": "placement.predict.moves",
    "placement.perfdata": "placement.core.perfdata",
    "placement.performance": "placement.predict.performance",
    "placement.permutation": "placement.core.permutation",
    "placement.pipeline_layout": "placement.core.pipeline_layout",
    "placement.pipeline_split": "placement.predict.pipeline_split",
    "placement.plan.job": "placement.formats.job",
    "placement.progress": "placement.core.progress",
    "placement.ray_executor": "placement.core.ray_executor",
    "placement.realroute": "placement.sources.realroute",
    "placement.replica_cost": "placement.predict.replica_cost",
    "placement.replica_runtime": "placement.consumers.replica_runtime",
    "placement.replica_search": "solvers.replica_search",
    "placement.replicas": "placement.core.replicas",
    "placement.runlogs": "placement.sources.runlogs",
    "placement.runtime": "placement.consumers.runtime",
    "placement.schema": "placement.formats.schema",
    "placement.show": "placement.app.show",
    "placement.stats": "placement.core.stats",
    "placement.verify": "placement.app.verify",
}


def new_name(fullname: str) -> str | None:
    """The module ``fullname`` moved to, or None when it did not move."""
    for old, new in MOVED.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old):]
    return None


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if new_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        assert new is not None
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported under its new name."""


def install() -> None:
    """Put the alias finder first on ``sys.meta_path``, once.  It answers only for the old names
    (none of which exists as a file any more), and must come before the path finder: a submodule
    of a moved package (``placement.checkpoint.dcp``) would otherwise load a second time under its
    old name from the aliased package's ``__path__``."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
