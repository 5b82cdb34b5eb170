"""File formats: the instance (JSON + a referenced ``.npz``) and the placement file (JSON).

Readers validate everything before building the model objects and raise
:class:`~placement.core.model.InvalidInputError` with one line naming the file, the field path, what was
expected and what was found.  Writers are atomic: a temporary file in the target folder, then
``os.replace``, so a reader never sees a partial file.

One format per module: :mod:`~placement.formats.spec` (fields and JSON Schemas),
:mod:`~placement.formats.files` (atomic writes), :mod:`~placement.formats.instance`,
:mod:`~placement.formats.placement_file`, :mod:`~placement.formats.job` (job and cluster files),
:mod:`~placement.formats.ladder` (measured runs), :mod:`~placement.formats.replicas` (the replica
block) and :mod:`~placement.formats.schema` (the spec language).  This package re-exports the
names callers use.
"""

from __future__ import annotations

from placement.formats.spec import (  # noqa: F401
    INSTANCE_SCHEMA_VERSION,
    INSTANCE_SPEC,
    MAX_GPUS,
    MAX_INT,
    MAX_JSON_BYTES,
    MAX_LAYER_EXPERTS,
    MAX_NPZ_BYTES,
    MAX_ROUTING_IDS,
    PLACEMENT_SCHEMA_VERSION,
    PLACEMENT_SPEC,
    json_schemas,
)
from placement.formats.files import (  # noqa: F401
    atomic_write_bytes,
    atomic_write_text,
    dumps,
    fsync_dir,
)
from placement.formats.instance import (  # noqa: F401
    _check_instance_semantics,
    _load_json,
    _npz_bytes,
    _performance,
    cluster_from_section,
    cluster_section,
    model_from_section,
    performance_document,
    read_instance,
    write_instance,
)
from placement.formats.placement_file import (  # noqa: F401
    placement_document,
    read_placement,
    write_placement,
)

__all__ = [
    "INSTANCE_SCHEMA_VERSION",
    "PLACEMENT_SCHEMA_VERSION",
    "INSTANCE_SPEC",
    "PLACEMENT_SPEC",
    "read_instance",
    "model_from_section",
    "cluster_from_section",
    "cluster_section",
    "write_instance",
    "read_placement",
    "write_placement",
    "placement_document",
    "atomic_write_bytes",
    "atomic_write_text",
    "fsync_dir",
    "json_schemas",
    "dumps",
    "MAX_INT",
    "MAX_GPUS",
    "MAX_LAYER_EXPERTS",
    "MAX_ROUTING_IDS",
    "MAX_JSON_BYTES",
    "MAX_NPZ_BYTES",
]
