"""The rules: an Equinox model (and, given, the program it runs in) -> PartitionSpecs.

- `_program` reads each weight's role from the jaxpr of ``loss_fn`` (with
  `_contract` for matmuls and convs, `_facts` for what it records);
- `_roles` turns the program's facts into splits, an ordered table of rules;
- `_names`, `_names_special`, `_name_rules`: the name hints, an ordered table;
- `_decide` gives each leaf its spec (override, program, names), `_specs` the
  pieces (fsdp, overrides, stacked leaves);
- `_public`: `sharding_rules`, `explain` and `specs_from_overrides`, and for
  the planner `program_facts` and `specs_from`.
"""

from ..mesh import named_shardings as named_shardings, sharding_of as sharding_of  # their home is mesh
from ._public import (
    explain as explain,
    program_facts as program_facts,
    sharding_rules as sharding_rules,
    specs_from as specs_from,
    specs_from_overrides as specs_from_overrides,
)
from ._specs import axes_of as axes_of
from ._stacks import declared_ndim as declared_ndim, layer_axes as layer_axes
